"""The short causal depthwise convolution + SiLU of the DeltaNet-family mixers.

Reference: `kimi_jax.layers.causal_conv_silu`, whose custom VJP is plain XLA (tested against
autodiff in tests/test_short_conv_vjp.py). `pallas_triton.conv_silu_bwd` is its backward as one
Pallas kernel (Triton lowering on GPU, interpret mode on CPU), selected by
`kimi_jax.layers.conv_backward("pallas")`.
"""

from kernels.conv.pallas_triton import conv_silu_bwd

__all__ = ["conv_silu_bwd"]

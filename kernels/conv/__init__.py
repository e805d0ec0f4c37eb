"""The short causal depthwise convolution + SiLU of the DeltaNet-family mixers.

Reference: `kimi_jax.layers.causal_conv_silu`, whose custom VJP is plain XLA (tested against
autodiff in tests/test_short_conv_vjp.py). `pallas_triton.conv_silu_bwd` is its backward as one
Pallas kernel (Triton lowering on GPU, interpret mode on CPU), run per (batch, head) shard of the
active mesh by `conv_silu_bwd_per_shard`, and selected by `kimi_jax.layers.conv_backward("pallas")`.
"""

from kernels.conv.pallas_triton import conv_silu_bwd, conv_silu_bwd_per_shard

__all__ = ["conv_silu_bwd", "conv_silu_bwd_per_shard"]

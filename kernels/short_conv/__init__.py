"""Kernels for the causal short convolution of the recurrent mixers (`kimi_jax.layers.ShortConv`).

The reference is the XLA formulation in `kimi_jax.layers` (`causal_conv_silu` and its VJP);
`pallas_gpu.tap_grads` computes the backward's tap gradients on Hopper GPUs.
"""

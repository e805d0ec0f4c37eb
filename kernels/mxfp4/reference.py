"""Matmuls that consume MXFP4 weights, in pure JAX (dequantise, then an ordinary matmul).

Weights are stored [out, in] with the blocks along `in` (the contraction), as in K3:
    matmul: x [M, K] and W packed [N, K/2], scales [N, K/32] -> x @ W^T [M, N];
    gmm:    x [M, K] rows sorted by group, W packed [G, N, K/2], scales [G, N, K/32],
            group_sizes [G] -> [M, N] (row m uses expert group(m)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.mxfp4.format import dequantize


def matmul(x, packed, scales):
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype (f32 accumulation)."""
    w = dequantize(packed, scales, x.dtype)
    out = jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def gmm(x, packed, scales, group_sizes):
    """Grouped x [M, K] @ dequantize(W[g])^T -> [M, N] by `ragged_dot`."""
    w = jnp.swapaxes(dequantize(packed, scales, x.dtype), 1, 2)
    out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)

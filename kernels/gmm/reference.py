"""Pure-JAX grouped matmul on `jax.lax.ragged_dot`: the ground truth for the Pallas kernels.

gmm:  lhs [M, K] (rows sorted by group), rhs [G, K, N] (or [G, N, K] with transpose_rhs),
      group_sizes [G] int32 -> [M, N]; row m uses the weights of the group that holds it and
      rows past sum(group_sizes) are zero.
tgmm: lhs [M, K], dout [M, N], group_sizes [G] -> [G, K, N] with out[g] = lhs[rows_g]^T dout[rows_g]
      (the weight gradient of gmm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None):
    """Grouped matmul by `ragged_dot`; f32 accumulation, output in lhs's dtype by default."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out_dtype = preferred_element_type or lhs.dtype
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def tgmm(lhs, dout, group_sizes, *, preferred_element_type=None):
    """Transposed grouped matmul by `ragged_dot_general` with the ragged dimension contracted."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out_dtype = preferred_element_type or lhs.dtype
    out = jax.lax.ragged_dot_general(
        lhs, dout, group_sizes, dims, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)

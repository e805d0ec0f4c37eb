"""Chunked (gated) linear attention in pure JAX: the chunked delta rule without the delta.

S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t). In the chunked form of `chunk.py`
this is L = 0, w = 0 and u = v: o_n = qg_n S_n + Aqk_n v_n, S_{n+1} = Diag(decay_n) S_n + kg_n^T v_n,
so the same intra-chunk code, state scan and hand-written backward serve both.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.kda.chunk import run_chunked
from kernels.kda.validate import state_dtype


def linear_attention_impl(q, k, v, g, *, scale, initial_state, segment_ids, output_final_state=True):
    """Canonical-form chunked (gated) linear attention: see `kernels.kda.linear_attention`."""
    del output_final_state
    beta = jnp.ones(q.shape[:3], state_dtype(q.dtype))  # unused without the delta
    return run_chunked(
        q, k, v, g, beta, scale=float(scale), initial_state=initial_state, segment_ids=segment_ids, bounded=False, delta=False
    )

"""Token-serial references: a `lax.scan` over time in float32 (float64 for float64 inputs).

This is the ground truth every other impl is tested against; its gradients come from autodiff
through the scan. Past `REMAT_BLOCK * 4` tokens the scan runs over checkpointed blocks of
`REMAT_BLOCK` tokens, so the backward keeps one state per block and recomputes a block's steps
(O((T / 64 + 64) K V) memory per head instead of O(T K V): the GPU parity tests at 2,4096,16,128
otherwise ask an 80 GB card for 34 GiB). Same values: the blocks run the same steps in order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.kda.validate import segment_starts, state_dtype

_HI = jax.lax.Precision.HIGHEST
REMAT_BLOCK = 64


def delta_step(S, q, k, v, g, beta, scale):
    """One step of the gated delta rule for every (batch, head).

    S [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; all in the state dtype.
    Returns (o [B, H, V], S_new): S' = Diag(exp g) S; S_new = S' + beta k (v - S'^T k)^T;
    o = S_new^T (scale q).
    """
    S = S * jnp.exp(g)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k, S, precision=_HI)
    S = S + jnp.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - pred), precision=_HI)
    o = jnp.einsum("bhk,bhkv->bhv", q * scale, S, precision=_HI)
    return o, S


def linear_step(S, q, k, v, g, scale):
    """One step of (gated) linear attention: S_new = Diag(exp g) S + k v^T; o = S_new^T (scale q)."""
    S = S * jnp.exp(g)[..., None] + jnp.einsum("bhk,bhv->bhkv", k, v, precision=_HI)
    o = jnp.einsum("bhk,bhkv->bhv", q * scale, S, precision=_HI)
    return o, S


def _scan(step, q, k, v, g, beta, scale, initial_state, segment_ids):
    B, T, H, K = q.shape
    V = v.shape[-1]
    sdt = state_dtype(q.dtype)
    S0 = jnp.zeros((B, H, K, V), sdt) if initial_state is None else initial_state.astype(sdt)
    starts = segment_starts(segment_ids, T)
    if starts is None:
        starts = jnp.zeros((B, T), bool)
    tm = lambda x: jnp.moveaxis(x.astype(sdt) if x.dtype != bool else x, 1, 0)
    xs = (tm(q), tm(k), tm(v), tm(g), tm(beta), tm(starts))

    def body(S, x):
        q_t, k_t, v_t, g_t, b_t, start_t = x
        S = jnp.where(start_t[:, None, None, None], 0.0, S)
        o, S = step(S, q_t, k_t, v_t, g_t, b_t, scale)
        return S, o

    if T <= REMAT_BLOCK * 4:
        S, o = jax.lax.scan(body, S0, xs)
    else:  # zero q, k, v, g, beta and no reset past T leave the state unchanged
        pad = -T % REMAT_BLOCK
        blocks = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
            (-1, REMAT_BLOCK) + x.shape[1:])
        block = jax.checkpoint(lambda S, xb: jax.lax.scan(body, S, xb))
        S, o = jax.lax.scan(block, S0, tuple(blocks(x) for x in xs))
        o = o.reshape((-1,) + o.shape[2:])[:T]
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


def kda_impl(q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, output_final_state=True):
    """Canonical-form naive KDA: see `kernels.kda.kda` for the contract."""
    del lower_bound, output_final_state
    return _scan(delta_step, q, k, v, g, beta, scale, initial_state, segment_ids)


def linear_attention_impl(q, k, v, g, *, scale, initial_state, segment_ids, output_final_state=True):
    """Canonical-form naive (gated) linear attention."""
    del output_final_state
    step = lambda S, q_t, k_t, v_t, g_t, b_t, sc: linear_step(S, q_t, k_t, v_t, g_t, sc)
    beta = jnp.ones(q.shape[:3], state_dtype(q.dtype))
    return _scan(step, q, k, v, g, beta, scale, initial_state, segment_ids)

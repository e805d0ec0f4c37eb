"""Public entry points and the one place where an `impl` name is resolved.

Each impl module exposes `kda_impl(q, k, v, g, beta, *, scale, initial_state, segment_ids,
lower_bound, output_final_state) -> (o, final_state)` over the canonical form of
`validate.py`; linear-attention modules expose `linear_attention_impl` likewise.
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp

from kernels.kda import hopper, naive
from kernels.kda.validate import canonicalize, check_float, check_gate_values, state_dtype

log = logging.getLogger(__name__)

IMPLS = {
    "naive": "kernels.kda.naive",
    "chunk": "kernels.kda.chunk",
    "chunk_mosaic": "kernels.kda.chunk_mosaic",
    "pallas_gpu": "kernels.kda.pallas_gpu",
    "pallas_tpu": "kernels.kda.pallas_tpu",
}
LINEAR_IMPLS = {
    "naive": "kernels.kda.naive",
    "chunk": "kernels.kda.linear_chunk",
}


@functools.cache
def _platform() -> str:
    return jax.devices()[0].platform


def resolve_impl(impl: str, table=IMPLS) -> str:
    """Map "auto" to the best impl for this platform; reject unknown names loudly."""
    if impl == "auto":
        if table is IMPLS and _platform() == "tpu":
            return "pallas_tpu"
        # Hopper: chunk with the Mosaic GPU serial passes, the fastest measured forward+backward
        # (1.4x chunk at (8,4096,16,128), 2.3x at (1,65536,16,128); benchmarks/results/
        # kda-h200-20261129T2220.json). Calls its kernels cannot take run chunk's XLA passes and
        # say so once in the log.
        if table is IMPLS and _platform() == "gpu" and hopper.device_kind() == "hopper":
            return "chunk_mosaic"
        return "chunk"
    if impl not in table:
        raise ValueError(f"Unknown impl={impl!r}; expected 'auto' or one of {sorted(table)}")
    return impl


def _module(name: str, table):
    return importlib.import_module(table[name])


def kda(
    q,
    k,
    v,
    g=None,
    beta=None,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    lower_bound=None,
    impl="auto",
):
    """Chunked or serial gated delta rule (DeltaNet / Gated DeltaNet / KDA).

    q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H] | [B, T, H, K] log-decay <= 0;
    beta None (= 1) | [B, T, H]. Per head:
        S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T (scale q_t).
    `lower_bound`: the caller guarantees g >= lower_bound (e.g. -5 for K3's gate), which lets
    kernels take an all-matmul path; checked when g is concrete. Returns (o [B, T, H, V] in v's
    dtype, final state [B, H, K, V] float32 or None).
    """
    c = canonicalize(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids, lower_bound=lower_bound
    )
    name = resolve_impl(impl)
    fn = _module(name, IMPLS).kda_impl
    o, S = fn(
        c.q,
        c.k,
        c.v,
        c.g,
        c.beta,
        scale=c.scale,
        initial_state=c.initial_state,
        segment_ids=c.segment_ids,
        lower_bound=lower_bound,
        output_final_state=output_final_state,
    )
    return o, (S if output_final_state else None)


def linear_attention(
    q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False, segment_ids=None, impl="auto"
):
    """(Gated) linear attention: S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    Same shapes as `kda`; g None is plain linear attention.
    """
    c = canonicalize(
        q, k, v, g, None, scale=scale, initial_state=initial_state, segment_ids=segment_ids, delta=False
    )
    name = resolve_impl(impl, LINEAR_IMPLS)
    fn = _module(name, LINEAR_IMPLS).linear_attention_impl
    o, S = fn(
        c.q,
        c.k,
        c.v,
        c.g,
        scale=c.scale,
        initial_state=c.initial_state,
        segment_ids=c.segment_ids,
        output_final_state=output_final_state,
    )
    return o, (S if output_final_state else None)


STEP_IMPLS = ("naive", "pallas_gpu")


def resolve_step_impl(impl: str) -> str:
    """Decode-step impl: "auto" is the Mosaic GPU kernel on Hopper, else the jnp step."""
    if impl == "auto":
        return "pallas_gpu" if _platform() == "gpu" and hopper.device_kind() == "hopper" else "naive"
    if impl not in STEP_IMPLS:
        raise ValueError(f"Unknown step impl={impl!r}; expected 'auto' or one of {list(STEP_IMPLS)}")
    return impl


def kda_step(state, q, k, v, g=None, beta=None, *, scale=None, impl="auto"):
    """One decoding step: state [B, H, K, V]; q, k [B, H, K]; v [B, H, V]; g None | [B, H] |
    [B, H, K]; beta None | [B, H]. Returns (o [B, H, V] in v's dtype, new_state float32).
    `impl`: "naive" (jnp), "pallas_gpu" (Mosaic GPU decode kernel) or "auto"."""
    step_impl = resolve_step_impl(impl)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must be [B, H, D]; got shape {getattr(x, 'shape', None)}")
        check_float(name, x)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, H, K]; got {q.shape} and {k.shape}")
    B, H, K = q.shape
    if v.shape[:2] != (B, H):
        raise ValueError(f"v must be [B, H, V] = [{B}, {H}, V]; got v.shape={v.shape}")
    V = v.shape[2]
    if getattr(state, "shape", None) != (B, H, K, V):
        raise ValueError(f"state must be [B, H, K, V] = {(B, H, K, V)}; got shape {getattr(state, 'shape', None)}")
    for name, x in (("state", state), ("g", g), ("beta", beta)):
        if x is not None:
            check_float(name, x)
    sdt = state_dtype(q.dtype)
    if g is None:
        g = jnp.zeros((B, H, K), sdt)
    elif g.shape == (B, H):
        check_gate_values(g, None)
        g = jnp.broadcast_to(g.astype(sdt)[..., None], (B, H, K))
    elif g.shape == (B, H, K):
        check_gate_values(g, None)
        g = g.astype(sdt)
    else:
        raise ValueError(f"g must be [B, H] or [B, H, K] = {(B, H)} or {(B, H, K)}; got g.shape={g.shape}")
    if beta is None:
        beta = jnp.ones((B, H), sdt)
    elif beta.shape != (B, H):
        raise ValueError(f"beta must be [B, H] = {(B, H)}; got beta.shape={beta.shape}")
    scale = K**-0.5 if scale is None else float(scale)
    f = lambda x: x.astype(sdt)
    if step_impl == "pallas_gpu":  # v keeps its dtype: the kernel converts it (and writes o in it)
        o, S = _module(step_impl, IMPLS).kda_step_impl(f(state), f(q), f(k), v, g, f(beta), scale)
    else:
        o, S = naive.delta_step(f(state), f(q), f(k), f(v), g, f(beta), scale)
    return o.astype(v.dtype), S

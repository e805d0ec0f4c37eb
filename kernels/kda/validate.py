"""Argument checks and canonicalisation shared by every KDA / linear-attention impl.

Every impl receives the canonical form: q, k `[B, T, H, K]` and v `[B, T, H, V]` of one dtype;
g `[B, T, H, K]` float (zeros for DeltaNet, broadcast over K for Gated DeltaNet); beta
`[B, T, H]` float (ones when omitted); initial_state `[B, H, K, V]` float or None;
segment_ids `[B, T]` int32 or None; a Python float scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class Canonical:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    scale: float
    initial_state: jax.Array | None
    segment_ids: jax.Array | None
    gate_kind: str  # "none" | "head" | "channel": what the caller passed, for dispatch.


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def state_dtype(dtype) -> jnp.dtype:
    """Float32 states and accumulation, float64 when the inputs are float64 (gradient checks)."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def check_float(name: str, x, allowed=FLOAT_DTYPES) -> None:
    if not any(jnp.dtype(x.dtype) == jnp.dtype(d) for d in allowed):
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise ValueError(f"{name} has unsupported dtype {jnp.dtype(x.dtype).name}; expected one of {names}")


def check_gate_values(g, lower_bound: float | None) -> None:
    """Value checks on concrete gates (skipped under jit, where values are unknown)."""
    if g is None or not _is_concrete(g):
        return
    g_np = np.asarray(jax.device_get(g), dtype=np.float64)
    if np.any(g_np > 0):
        raise ValueError(f"g must be <= 0 (a log-decay); max(g) = {g_np.max():.4g}, g.shape={tuple(g.shape)}")
    if lower_bound is not None and np.any(g_np < lower_bound):
        raise ValueError(f"g below lower_bound={lower_bound}: min(g) = {g_np.min():.4g}")


def canonicalize(q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, delta=True) -> Canonical:
    """Validate the arguments of `kda` / `linear_attention` and return the canonical form."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be [B, T, H, D]; got shape {getattr(x, 'shape', None)}")
        check_float(name, x)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, K]; got q.shape={q.shape}, k.shape={k.shape}")
    B, T, H, K = q.shape
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got v.shape={v.shape} (q.shape={q.shape})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    V = v.shape[3]
    sdt = state_dtype(q.dtype)

    if g is None:
        gate_kind, g_c = "none", jnp.zeros((B, T, H, K), sdt)
    else:
        check_float("g", g)
        if g.shape == (B, T, H):
            gate_kind, g_c = "head", jnp.broadcast_to(g.astype(sdt)[..., None], (B, T, H, K))
        elif g.shape == (B, T, H, K):
            gate_kind, g_c = "channel", g.astype(sdt)
        else:
            raise ValueError(f"g must be [B, T, H] or [B, T, H, K] = {(B, T, H)} or {(B, T, H, K)}; got g.shape={g.shape}")
        check_gate_values(g, lower_bound)
    if lower_bound is not None and not (-1e4 < float(lower_bound) < 0):
        raise ValueError(f"lower_bound must be a negative float; got {lower_bound}")

    if beta is None:
        beta_c = jnp.ones((B, T, H), sdt)
    else:
        if not delta:
            raise ValueError("beta is not an argument of linear attention")
        check_float("beta", beta)
        if beta.shape != (B, T, H):
            raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got beta.shape={beta.shape}")
        beta_c = beta.astype(sdt)

    if initial_state is not None:
        check_float("initial_state", initial_state)
        if initial_state.shape != (B, H, K, V):
            raise ValueError(
                f"initial_state must be [B, H, K, V] = {(B, H, K, V)}; got initial_state.shape={initial_state.shape}"
            )
        initial_state = initial_state.astype(sdt)

    if segment_ids is not None:
        if segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got segment_ids.shape={segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integer; got dtype {segment_ids.dtype}")
        segment_ids = segment_ids.astype(jnp.int32)

    if scale is None:
        scale = K**-0.5
    scale = float(scale)
    return Canonical(q, k, v, g_c, beta_c, scale, initial_state, segment_ids, gate_kind)


def segment_starts(segment_ids, T: int):
    """[B, T] bool: True where a new sequence starts (never at t = 0: initial_state applies there)."""
    if segment_ids is None:
        return None
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), change], axis=1)

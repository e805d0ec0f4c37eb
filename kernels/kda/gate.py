"""KDA gates: the log-decay g <= 0 from a raw projection z, in float32.

Kimi Linear (softplus): g = -exp(A_log) * softplus(z + dt_bias), range (-inf, 0).
K3 (bounded):           g = lower_bound * sigmoid(exp(A_log) * (z + dt_bias)), range (lower_bound, 0).
The bounded form keeps every per-token decay >= exp(lower_bound), which is what lets chunked
kernels use plain tensor-core matmuls inside 16-token tiles (see `kda_reference.md`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _softplus(x):
    # flash-linear-attention's softplus: x itself above 20 (matches its kernels bit for bit there).
    return jnp.where(x > 20.0, x, jax.nn.softplus(jnp.minimum(x, 20.0)))


def kda_gate(z, A_log, dt_bias=None, *, lower_bound=None):
    """Log-decay from the raw gate projection.

    z: [..., H, K] (any float dtype); A_log: [H] (one rate per head); dt_bias: [H, K] or None.
    Returns g [..., H, K] float32, all entries <= 0.
    """
    if getattr(z, "ndim", 0) < 2:
        raise ValueError(f"z must be [..., H, K]; got shape {getattr(z, 'shape', None)}")
    H, K = z.shape[-2:]
    if A_log is None:
        if lower_bound is None:
            raise ValueError("A_log is required for the softplus gate (only the bounded gate may omit it)")
    elif A_log.shape != (H,):
        raise ValueError(f"A_log must be [H] = [{H}]; got A_log.shape={A_log.shape} (z.shape={z.shape})")
    if dt_bias is not None and dt_bias.shape != (H, K):
        raise ValueError(f"dt_bias must be [H, K] = {(H, K)}; got dt_bias.shape={dt_bias.shape}")
    if lower_bound is not None and not float(lower_bound) < 0:
        raise ValueError(f"lower_bound must be negative; got {lower_bound}")

    x = z.astype(jnp.float32)
    if dt_bias is not None:
        x = x + dt_bias.astype(jnp.float32)
    if lower_bound is None:
        return -jnp.exp(A_log.astype(jnp.float32))[:, None] * _softplus(x)
    if A_log is not None:
        x = jnp.exp(A_log.astype(jnp.float32))[:, None] * x
    return float(lower_bound) * jax.nn.sigmoid(x)

"""Which calls the Mosaic GPU kernels of `kernels.kda` (`pallas_gpu`, `chunk_mosaic`) can take.

The kernels are written for Hopper (wgmma, TMA); on a CPU-only machine they run in the Mosaic GPU
interpreter, where float32 inputs are accepted too. Callers fall back to XLA with a logged reason
for anything else, so this is the one place that decides.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SUPPORTED_DIMS = (64, 128)  # K and V: whole 64-wide wgmma tiles, the state fits the registers


@functools.cache
def device_kind() -> str:
    """'hopper', 'cpu' (interpret mode) or 'other'."""
    d = jax.devices()[0]
    if d.platform == "cpu":
        return "cpu"
    if d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9."):
        return "hopper"
    return "other"


def unsupported_reason(K: int, V: int, dtype, interpret: bool, kind: str | None = None) -> str | None:
    """Why the kernels cannot take this call (None when they can). `kind` defaults to this
    machine's `device_kind()`."""
    kind = device_kind() if kind is None else kind
    if not interpret and kind != "hopper":
        return f"no Hopper GPU (device kind {kind!r})"
    if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
        return f"K={K}, V={V} (the kernels take K, V in {SUPPORTED_DIMS})"
    allowed = (jnp.bfloat16, jnp.float16) + ((jnp.float32,) if interpret else ())
    if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in allowed):
        return f"dtype {jnp.dtype(dtype).name} (the kernels take bf16/fp16 q, k, v)"
    return None

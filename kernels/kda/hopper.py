"""Which calls the Mosaic GPU kernels of `kernels.kda` (`pallas_gpu`, `chunk_mosaic`) can take.

The kernels are written for Hopper (wgmma, TMA); on a CPU-only machine they run in the Mosaic GPU
interpreter, where float32 inputs are accepted too. Callers fall back to XLA with a logged reason
for anything else, so this is the one place that decides.

Sharding: XLA cannot partition a Mosaic custom call; under a mesh it would gather the whole
batch onto every device and run the kernel there. `per_shard` therefore runs an impl inside
`jax.shard_map` over the batch and head axes of the active mesh (sequence sharding is not
supported: each shard holds whole sequences).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

SUPPORTED_DIMS = (64, 128)  # K and V: whole 64-wide wgmma tiles, the state fits the registers


_ASSUMED: str | None = None  # set by `assume_device_kind`
DEVICE_KINDS = ("hopper", "cpu", "other")


def device_kind() -> str:
    """'hopper', 'cpu' (interpret mode) or 'other': this machine's first device, unless
    `assume_device_kind` says otherwise."""
    return _ASSUMED or _detected_kind()


@contextlib.contextmanager
def assume_device_kind(kind: str):
    """Within the block, trace as on a `kind` device: e.g. "hopper" on a machine without a GPU,
    to compile the kernels ahead of time for an H200 (`benchmarks/mosaic_ptxas.py --deviceless`)."""
    global _ASSUMED
    if kind not in DEVICE_KINDS:
        raise ValueError(f"assume_device_kind({kind!r}): expected one of {DEVICE_KINDS}")
    old, _ASSUMED = _ASSUMED, kind
    try:
        yield
    finally:
        _ASSUMED = old


def num_sms() -> int:
    """The SMs of the first device (132, an H100's / H200's, where it does not say: a CPU host
    compiling ahead of time): the program count of the persistent kernels."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def check_kernel_setting(name: str, mode: str) -> None:
    """A module setting `name` = "mosaic" (a compiled Mosaic GPU kernel) needs a GPU backend, or a
    Hopper assumed for an ahead-of-time compile (`assume_device_kind`); raise otherwise, pointing
    to "interpret" (the Mosaic GPU interpreter) and "xla"."""
    if mode == "mosaic" and jax.default_backend() != "gpu" and device_kind() != "hopper":
        raise ValueError(f"{name}='mosaic' compiles a Mosaic GPU kernel, but the backend is "
                         f"{jax.default_backend()!r}; use 'interpret' (the Mosaic GPU interpreter) or 'xla'")


@functools.cache
def _detected_kind() -> str:
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


def _shard_specs(q):
    """(mesh, spec [B,T,H,*], spec [B,H,K,V], spec [B,T], spec [B,T,H]) under a mesh of more than
    one device that shards the batch or the heads of q [B, T, H, K], else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    from jax.sharding import PartitionSpec as P

    from kimi_jax.sharding import spec_for_shape

    b, _, h, _ = spec_for_shape(("act_batch", None, "act_heads", None), q.shape, mesh)
    if b is None and h is None:
        return None
    return mesh, P(b, None, h, None), P(b, h, None, None), P(b, None), P(b, None, h)


def per_shard(run, q, k, v, g, beta, initial_state, segment_ids):
    """run(q, k, v, g, beta, initial_state, segment_ids) -> (o [B,T,H,V], S [B,H,K,V]) on the
    canonical KDA form (g [B,T,H,K], beta [B,T,H]), called once per (batch, head) shard of the
    active mesh through `jax.shard_map`, or directly without a mesh."""
    specs = _shard_specs(q)
    if specs is None:
        return run(q, k, v, g, beta, initial_state, segment_ids)
    mesh, x4, s4, s2, s3 = specs
    h0_spec = None if initial_state is None else s4
    seg_spec = None if segment_ids is None else s2
    sharded = jax.shard_map(
        run, mesh=mesh, in_specs=(x4, x4, x4, x4, s3, h0_spec, seg_spec), out_specs=(x4, s4), check_vma=False
    )
    return sharded(q, k, v, g, beta, initial_state, segment_ids)

"""Tap gradients of the short convolution through the Mosaic GPU kernel, per shard of the mesh.

    tap_grads(x [B, T, *C], dy [B, T, *C], w [W, *C], segment_ids None | [B, T]) -> dw [W, *C] f32

`kimi_jax.layers` calls this from the convolution's VJP when `CONV_DW = "pallas_gpu"`; the XLA
tap sums there are the reference. XLA cannot partition a Mosaic custom call, so under a mesh
that shards the batch (or, for x [B, T, H, D], the heads) the kernel runs inside
`jax.shard_map` on each shard and the per-batch partial sums are added outside.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels.kda.hopper import device_kind
from kernels.short_conv import pallas_gpu

log = logging.getLogger(__name__)


def tap_masks(segment_ids, B: int, T: int, W: int):
    """[B, W, T] float32: 1 where tap i (reading s = W-1-i steps back) reads a token of row t's
    document: t >= s, and with segment_ids the same id s steps back (the forward's rule)."""
    t = jnp.arange(T)
    rows = []
    for i in range(W):
        s = W - 1 - i
        ok = jnp.broadcast_to(t >= s, (B, T))
        if segment_ids is not None and s:
            prev = jnp.pad(segment_ids, ((0, 0), (s, 0)))[:, :T]
            ok = ok & (prev == segment_ids)
        rows.append(ok)
    return jnp.stack(rows, axis=1).astype(jnp.float32)


def unsupported_reason(x, W: int) -> str | None:
    """Why this call cannot take the kernel (None when it can): the device and each shard's shape."""
    kind = device_kind()
    if kind not in ("hopper", "cpu"):
        return f"no Hopper GPU (device kind {kind!r})"
    specs = _shard_specs(x)
    C = 1
    for i, d in enumerate(x.shape[2:], start=2):
        if specs is not None and specs[1][i] is not None:  # channels of one shard
            axes = (specs[1][i],) if isinstance(specs[1][i], str) else specs[1][i]
            d //= math.prod(specs[0].shape[a] for a in axes)
        C *= d
    return pallas_gpu.unsupported_reason(x.shape[1], C, W, x.dtype)


@functools.cache
def _say_once(why: str) -> None:
    log.warning("short-conv tap gradients: the Mosaic GPU kernel cannot take this call (%s); "
                "using XLA's tap sums", why)


def fallback_reason(x, W: int) -> str | None:
    """`unsupported_reason`, logged once per distinct reason."""
    why = unsupported_reason(x, W)
    if why:
        _say_once(why)
    return why


def _per_batch(x, dy, w, masks, *, from_da):
    """[B_local, W, *C] partial sums of one shard."""
    B, T = x.shape[:2]
    chans = x.shape[2:]
    flat = lambda a: a.reshape(a.shape[:2] + (-1,))
    part = pallas_gpu.tap_grads(flat(x), flat(dy), w.reshape(w.shape[0], -1), masks, from_da=from_da,
                                per_batch=True, interpret=device_kind() == "cpu")
    return part.reshape((B, w.shape[0]) + chans)


def _shard_specs(x):
    """(mesh, spec of x and dy [B, T, *C]) under a mesh that shards the batch or, for
    x [B, T, H, D], the heads; else None. w [W, *C] and the partial sums [B, W, *C] follow."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    from kimi_jax.sharding import spec_for_shape

    names = ("act_batch", None, "act_heads", None) if x.ndim == 4 else ("act_batch",) + (None,) * (x.ndim - 1)
    spec = spec_for_shape(names, x.shape, mesh)
    return None if all(a is None for a in spec) else (mesh, spec)


def tap_grads(x, dy, w, segment_ids=None, *, from_da: bool = False):
    """dw [W, *C] float32 = sum over B, T of dy * silu'(a) * (x shifted by each tap), masked as the
    forward masks (`from_da`: dy is da = dy * silu'(a) already); the caller has checked
    `fallback_reason(x, W)` is None."""
    B, T = x.shape[:2]
    W = w.shape[0]
    masks = tap_masks(segment_ids, B, T, W)
    specs = _shard_specs(x)
    if specs is None:
        return _per_batch(x, dy, w, masks, from_da=from_da).sum(axis=0)
    mesh, xs = specs
    b, chans = xs[0], tuple(xs[2:])
    run = jax.shard_map(functools.partial(_per_batch, from_da=from_da), mesh=mesh,
                        in_specs=(xs, xs, P(None, *chans), P(b, None, None)), out_specs=P(b, None, *chans),
                        check_vma=False)
    return run(x, dy, w, masks).sum(axis=0)

"""Backward of SiLU(causal depthwise conv) as one Pallas kernel (Triton lowering).

The XLA backward (`kimi_jax.layers.causal_conv_silu`) runs as several fusions that recompute the
pre-activation, materialise the float32 gradient of the pre-activation and reduce it against
shifted copies of x for the weight gradient. Here one program per (batch row, T block, channel
block) reads its x and dy tiles (plus W - 1 rows either side, from cache), recomputes the
pre-activation at the W row offsets it needs, and writes dx and its block's partial weight
gradient; XLA sums the partials ([B, T / BT, W, C] float32, small).

Taps reaching before the start or into an earlier packed segment read zero, as in the reference.
x, dy and the segment ids are padded by W - 1 rows on both sides (and T, C up to the block sizes)
so that every load is in bounds.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _kernel(x_ref, dy_ref, seg_ref, w_ref, dx_ref, dw_ref, *, W: int, BT: int, BC: int):
    P = W - 1
    b, t0, c0 = pl.program_id(0), pl.program_id(1) * BT, pl.program_id(2) * BC
    rows = lambda o: pl.ds(t0 + P + o, BT)  # original rows t0 + o ... (the arrays carry P pad rows)
    cols = pl.ds(c0, BC)
    xs = {o: x_ref[b, rows(o), cols].astype(jnp.float32) for o in range(-P, P + 1)}
    segs = {o: seg_ref[b, rows(o)] for o in range(-P, P + 1)}
    ws = [w_ref[i, cols] for i in range(W)]
    same = lambda o1, o2: (segs[o1] == segs[o2])[:, None]  # [BT, 1]: rows t + o1 and t + o2 share a document

    def da(s):  # gradient of the pre-activation at rows t + s
        a = ws[P][None, :] * xs[s]
        for i in range(P):
            src = s - (P - i)  # tap i reads P - i rows back
            a = a + ws[i][None, :] * jnp.where(same(src, s), xs[src], 0.0)
        sig = 1.0 / (1.0 + jnp.exp(-a))
        return dy_ref[b, rows(s), cols].astype(jnp.float32) * (sig * (1.0 + a * (1.0 - sig)))

    das = [da(s) for s in range(W)]
    dx = ws[P][None, :] * das[0]
    for s in range(1, W):
        dx = dx + ws[P - s][None, :] * jnp.where(same(0, s), das[s], 0.0)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    for i in range(W):
        src = -(P - i)
        prod = das[0] * (xs[src] if src == 0 else jnp.where(same(src, 0), xs[src], 0.0))
        dw_ref[i, :] = jnp.sum(prod, axis=0)
    for i in range(W, dw_ref.shape[0]):  # the block's power-of-two padding rows
        dw_ref[i, :] = jnp.zeros((BC,), jnp.float32)


def conv_silu_bwd(x, w, dy, segment_ids=None, *, block_t: int = 64, block_c: int = 128,
                  interpret: bool = False):
    """x, dy [B, T, *C], w [W, *C], segment_ids [B, T] or None -> (dx [B, T, *C] in x's dtype,
    dw [W, *C] in w's dtype): the VJP of `kimi_jax.layers.causal_conv_silu` at x, w for dy."""
    if x.ndim < 3 or dy.shape != x.shape or w.shape[1:] != x.shape[2:]:
        raise ValueError(f"conv_silu_bwd: x {x.shape}, dy {dy.shape}, w {w.shape}: want x = dy = [B, T, *C], "
                         f"w = [W, *C]")
    if segment_ids is not None and segment_ids.shape != x.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {x.shape[:2]}; got {segment_ids.shape}")
    if block_t < 1 or block_c < 1 or block_t & (block_t - 1) or block_c & (block_c - 1):
        raise ValueError(f"block_t and block_c must be powers of two; got {block_t}, {block_c}")
    B, T = x.shape[:2]
    W, C = w.shape[0], math.prod(x.shape[2:])
    P = W - 1
    BT, BC = min(block_t, _pow2(T)), min(block_c, _pow2(C))
    Tp, Cp = -(-T // BT) * BT, -(-C // BC) * BC
    if B * (Tp + 2 * P) * Cp >= 2**31:  # the kernel's element offsets are 32-bit
        raise ValueError(f"conv_silu_bwd: {B} x {Tp + 2 * P} x {Cp} padded elements exceed 2**31; "
                         f"call it on slices of the batch")
    pad3 = ((0, 0), (P, Tp - T + P), (0, Cp - C))
    xp = jnp.pad(x.reshape(B, T, C), pad3)
    dyp = jnp.pad(dy.reshape(B, T, C), pad3)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    segp = jnp.pad(seg, ((0, 0), (P, Tp - T + P)), constant_values=-1)
    wp = jnp.pad(w.reshape(W, C).astype(jnp.float32), ((0, 0), (0, Cp - C)))
    Wb = _pow2(W)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, t, c: (0,) * len(shape))
    dxp, dw_parts = pl.pallas_call(
        functools.partial(_kernel, W=W, BT=BT, BC=BC),
        grid=(B, Tp // BT, Cp // BC),
        in_specs=[whole(xp.shape), whole(dyp.shape), whole(segp.shape), whole(wp.shape)],
        out_specs=[pl.BlockSpec((None, BT, BC), lambda b, t, c: (b, t, c)),
                   pl.BlockSpec((None, None, Wb, BC), lambda b, t, c: (b, t, 0, c))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, Cp), x.dtype),
                   jax.ShapeDtypeStruct((B, Tp // BT, Wb, Cp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="conv_silu_bwd",
    )(xp, dyp, segp, wp)
    dx = dxp[:, :T, :C].reshape(x.shape)
    dw = jnp.sum(dw_parts[:, :, :W, :C], axis=(0, 1)).reshape(w.shape).astype(w.dtype)
    return dx, dw


def conv_silu_bwd_per_shard(x, w, dy, segment_ids=None, *, interpret: bool = False):
    """`conv_silu_bwd` once per (batch, head) shard of the active mesh for x [B, T, H, D] (XLA
    cannot partition the kernel's custom call: under a mesh it would gather the whole batch onto
    every device), the weight gradient summed over the batch shards; directly without a mesh or
    for other layouts."""
    from jax.sharding import PartitionSpec as P

    from kernels.kda.hopper import shard_specs

    run = functools.partial(conv_silu_bwd, interpret=interpret)
    specs = shard_specs(x) if x.ndim == 4 else None
    if specs is None:
        return run(x, w, dy, segment_ids)
    mesh, x4, _, s2, _ = specs
    batch_axes, head_axes = x4[0], x4[2]
    w_spec = P(None, head_axes, None)

    def body(x, w, dy, seg):
        dx, dw = run(x, w, dy, seg)
        return dx, dw if batch_axes is None else jax.lax.psum(dw, batch_axes)

    return jax.shard_map(body, mesh=mesh, in_specs=(x4, w_spec, x4, None if segment_ids is None else s2),
                         out_specs=(x4, w_spec), check_vma=False)(x, w, dy, segment_ids)

"""Backward of SiLU(causal depthwise conv) as one Pallas kernel (Triton lowering).

The XLA backward (`kimi_jax.layers.causal_conv_silu`) runs as several fusions that recompute the
pre-activation, materialise the float32 gradient of the pre-activation and reduce it against
shifted copies of x for the weight gradient (a column reduction XLA runs at about 15% of HBM
bandwidth). Here one program per (batch row, `block_rows` rows, `block_c` channels) walks its rows
in tiles of `block_t`: per tile it recomputes the pre-activation at the W row offsets dx needs,
writes dx and accumulates its weight gradient in registers; XLA sums the per-program partials
([B, T / block_rows, W, C] float32, small).

Rows are addressed by clamped index vectors and masked (taps before the start, past the end or
into an earlier packed segment read zero, as in the reference), so nothing is padded or copied:
the kernel reads x and dy once from HBM (the W - 1 overlapping rows come from cache) and writes dx.
Every live tile is float32 [block_t, block_c]; a handful are live at once, which is what bounds
block_t x block_c per warp (larger tiles spill registers to local memory).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# (block_t, block_c, block_rows, num_warps) measured fastest on an H200 (benchmarks/conv.py).
DEFAULT_BLOCKS = (32, 128, 256, 4)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _kernel(*refs, T: int, C: int, W: int, BT: int, BC: int, steps: int, has_seg: bool):
    if has_seg:
        x_ref, dy_ref, seg_ref, w_ref, dx_ref, dw_ref = refs
    else:
        (x_ref, dy_ref, w_ref, dx_ref, dw_ref), seg_ref = refs, None
    P = W - 1
    # program ids are read here: interpret mode cannot lower them inside the loop body
    b, r0, c0 = pl.program_id(0), pl.program_id(1) * (BT * steps), pl.program_id(2) * BC
    cols = c0 + jnp.arange(BC)
    if C % BC:  # clamping breaks the loads' contiguity, so only when a tail block exists
        cols = jnp.minimum(cols, C - 1)
    ws = [w_ref[i, pl.ds(c0, BC)] for i in range(W)]  # f32 [BC], padded to the blocks

    def step(j, dw):
        t0 = r0 + j * BT
        valid, seg, tile = {}, {}, {}

        def rows(o):  # rows t0 + o ... t0 + o + BT - 1: clamped indices and in-range mask
            if o not in valid:
                r = t0 + o + jnp.arange(BT)
                valid[o] = (r >= 0) & (r < T)
                r = jnp.clip(r, 0, T - 1)
                seg[o] = seg_ref[b, r] if has_seg else None
                tile[o] = r[:, None], cols[None, :]
            return tile[o]

        def same(o1, o2):  # [BT, 1]: rows t + o1 and t + o2 exist and share a document
            rows(o1), rows(o2)
            ok = valid[o1] & valid[o2]
            return (ok if seg_ref is None else ok & (seg[o1] == seg[o2]))[:, None]

        def load(ref, o):
            return ref[(b,) + rows(o)].astype(jnp.float32)

        def da(s):  # gradient of the pre-activation at rows t + s
            a = ws[P][None, :] * load(x_ref, s)
            for i in range(P):
                src = s - (P - i)  # tap i reads P - i rows back
                a = a + ws[i][None, :] * jnp.where(same(src, s), load(x_ref, src), 0.0)
            sig = 1.0 / (1.0 + jnp.exp(-a))
            g = jnp.where(same(s, s), load(dy_ref, s), 0.0)
            return g * (sig * (1.0 + a * (1.0 - sig)))

        da0 = da(0)
        dx = ws[P][None, :] * da0
        for s in range(1, W):
            dx = dx + ws[P - s][None, :] * jnp.where(same(0, s), da(s), 0.0)
        dx_ref[pl.ds(j * BT, BT), :] = dx.astype(dx_ref.dtype)
        return tuple(dw[i] + jnp.sum(da0 * jnp.where(same(i - P, 0), load(x_ref, i - P), 0.0), axis=0)
                     for i in range(W))

    dw = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros((BC,), jnp.float32) for _ in range(W)))
    for i in range(dw_ref.shape[0]):  # rows past W: the block's power-of-two padding
        dw_ref[i, :] = dw[i] if i < W else jnp.zeros((BC,), jnp.float32)


def conv_silu_bwd(x, w, dy, segment_ids=None, *, blocks: tuple[int, int, int, int] | None = None,
                  interpret: bool = False):
    """x, dy [B, T, *C], w [W, *C], segment_ids [B, T] or None -> (dx [B, T, *C] in x's dtype,
    dw [W, *C] in w's dtype): the VJP of `kimi_jax.layers.causal_conv_silu` at x, w for dy.

    blocks = (block_t, block_c, block_rows, num_warps), powers of two with block_rows a multiple
    of block_t; `DEFAULT_BLOCKS` when None. Blocks larger than T or C shrink to them."""
    if x.ndim < 3 or dy.shape != x.shape or w.shape[1:] != x.shape[2:]:
        raise ValueError(f"conv_silu_bwd: x {x.shape}, dy {dy.shape}, w {w.shape}: want x = dy = [B, T, *C], "
                         f"w = [W, *C]")
    if segment_ids is not None and segment_ids.shape != x.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {x.shape[:2]}; got {segment_ids.shape}")
    block_t, block_c, block_rows, num_warps = DEFAULT_BLOCKS if blocks is None else blocks
    if any(v < 1 or v & (v - 1) for v in (block_t, block_c, block_rows, num_warps)) or block_rows < block_t:
        raise ValueError(f"blocks (block_t, block_c, block_rows, num_warps) must be powers of two with "
                         f"block_rows >= block_t; got {blocks}")
    B, T = x.shape[:2]
    W, C = w.shape[0], math.prod(x.shape[2:])
    if B * T * C >= 2**31:  # the kernel's element offsets are 32-bit
        raise ValueError(f"conv_silu_bwd: {B} x {T} x {C} elements exceed 2**31; call it on slices of the batch")
    BT, BC = min(block_t, _pow2(T)), min(block_c, _pow2(C))
    BR = max(min(block_rows, _pow2(T)), BT)
    Tp, Cp = -(-T // BR) * BR, -(-C // BC) * BC
    Wb = _pow2(W)
    args = [x.reshape(B, T, C), dy.reshape(B, T, C)]
    if segment_ids is not None:
        args.append(segment_ids.astype(jnp.int32))
    wf = w.reshape(W, C).astype(jnp.float32)
    args.append(wf if Cp == C else jnp.pad(wf, ((0, 0), (0, Cp - C))))
    whole = lambda a: pl.BlockSpec(a.shape, lambda b, t, c: (0,) * a.ndim)
    dxp, dw_parts = pl.pallas_call(
        functools.partial(_kernel, T=T, C=C, W=W, BT=BT, BC=BC, steps=BR // BT, has_seg=segment_ids is not None),
        grid=(B, Tp // BR, Cp // BC),
        in_specs=[whole(a) for a in args],
        out_specs=[pl.BlockSpec((None, BR, BC), lambda b, t, c: (b, t, c)),
                   pl.BlockSpec((None, None, Wb, BC), lambda b, t, c: (b, t, 0, c))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, Cp), x.dtype),
                   jax.ShapeDtypeStruct((B, Tp // BR, Wb, Cp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="conv_silu_bwd",
    )(*args)
    dx = (dxp if (Tp, Cp) == (T, C) else dxp[:, :T, :C]).reshape(x.shape)
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

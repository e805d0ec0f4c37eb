"""The gated expert FFN's activation fused into grouped matmuls (Mosaic GPU; see `glu.py`).

glu_gmm:      x [M, K] with w_gate, w_up [G, K, N] -> h = act(x @ w_gate, x @ w_up) [Mp, Np] and
              the pre-activations gu = [gate | up] [Mp, 2 Np] (the backward's residual). One
              K-pipeline loads each x block once for both products (two accumulators), and the
              activation runs in the epilogue on the merged tiles, so gate and up are never
              read back from HBM in the forward.
glu_gmm_bwd:  dy [M, D] with w_down [G, N, D] -> [dgate | dup] [Mp, 2 Np]: the down projection's
              input gradient dh = dy @ w_down^T, with the activation's backward in the epilogue
              (the gate and up tiles are loaded by TMA while the products run). dh never reaches
              HBM, and the two gradients land side by side, the operand layout of one grouped
              matmul of contraction 2N for dx and one tgmm for both weight gradients.

Mp, Np: M and N padded to the tile (bm, bn); both kernels take the same tiles, since the backward
reads the forward's gu tiles. Values equal the unfused path's: gate, up and dh are rounded to the
operand dtype before the float32 activation, as separate kernels would store them.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.gmm.glu_math import glu_backward, glu_forward
from kernels.gmm.pallas_gpu import Blocks, _check_dtypes, _pad_to, group_products, grouped_rows_kernel
from kernels.lowering import lowered_once

# Two [bm, bn] float32 accumulators live in one warpgroup's registers: 2 * bm * bn / 128 per
# thread, kept at 128 or fewer (255 is the limit, and the epilogue needs room).
MAX_TILE_ELEMENTS = 64 * 128


def check_glu_blocks(blocks: Blocks) -> None:
    if blocks.wgs != 1:
        raise ValueError(f"fused GLU kernels run one warpgroup per program; got Blocks.wgs={blocks.wgs}")
    if blocks.bm * blocks.bn > MAX_TILE_ELEMENTS:
        raise ValueError(f"fused GLU tile {blocks.bm}x{blocks.bn} holds two float32 accumulators of "
                         f"more than {MAX_TILE_ELEMENTS} elements each (registers); use bm * bn <= "
                         f"{MAX_TILE_ELEMENTS}, e.g. 64x128")


def _padded_lhs(lhs, *others, blocks: Blocks):
    """Check the operands and tiles; lhs [M, K] zero-padded to [Mp, Kp] (tile multiples)."""
    _check_dtypes(lhs, *others)
    check_glu_blocks(blocks)
    return _pad_to(_pad_to(lhs, 0, blocks.bm), 1, blocks.bk)


@lowered_once("act", "blocks", "interpret")
def glu_gmm(x, w_gate, w_up, group_sizes, *, act, blocks, interpret=False):
    """(h [Mp, Np], gu [Mp, 2 Np]) in x's dtype; `act` = (kind, beta, linear_beta); rows past
    sum(group_sizes) and columns past N are zero."""
    x_p = _padded_lhs(x, w_gate, w_up, blocks=blocks)
    kind, beta, linear_beta = act
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    dtype = x.dtype
    wg_p, wu_p = (_pad_to(_pad_to(w, 1, bk), 2, bn) for w in (w_gate, w_up))
    mp, kp = x_p.shape
    np_ = wg_p.shape[2]

    def group_acc(g, mb, nb, in_refs, scratch_refs):
        x_ref, wg_ref, wu_ref = in_refs
        return group_products(x_ref, (wg_ref, wu_ref), g, mb, nb, tile=(bm, bn, bk),
                              num_k=kp // bk, stages=blocks.stages)

    def epilogue(tile_smems, in_refs, out_refs, scratch_refs, row0, nb):
        gate_s, up_s = tile_smems
        (h_s,) = scratch_refs
        h_ref, gu_ref = out_refs
        rows = pl.ds(row0, bm)
        plgpu.copy_smem_to_gmem(gate_s, gu_ref.at[rows, pl.ds(nb * bn, bn)])
        plgpu.copy_smem_to_gmem(up_s, gu_ref.at[rows, pl.ds(np_ + nb * bn, bn)])
        h_s[...] = glu_forward(kind, gate_s[...], up_s[...], beta, linear_beta).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_s, h_ref.at[rows, pl.ds(nb * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    h, gu = grouped_rows_kernel(
        group_acc, group_sizes, (x_p, wg_p, wu_p), shape=(mp, np_), tile=(bm, bn), out_dtype=dtype,
        scratch=[plgpu.SMEM((bm, bn), dtype)], band=blocks.band, interpret=interpret, tiles=2,
        epilogue=epilogue, name="gmm_glu_fwd",
        out_shapes=[jax.ShapeDtypeStruct((mp, np_), dtype), jax.ShapeDtypeStruct((mp, 2 * np_), dtype)])
    return h, gu


@lowered_once("act", "blocks", "interpret")
def glu_gmm_bwd(dy, w_down, gu, group_sizes, *, act, blocks, interpret=False):
    """[dgate | dup] [Mp, 2 Np] in dy's dtype from dy [M, D], w_down [G, N, D] and the forward's
    gu [Mp, 2 Np] (same `blocks`)."""
    dy_p = _padded_lhs(dy, w_down, gu, blocks=blocks)
    kind, beta, linear_beta = act
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    dtype = dy.dtype
    wd_p = _pad_to(_pad_to(w_down, 1, bn), 2, bk)  # [G, Np, Kp]: the transposed operand
    mp, kp = dy_p.shape
    np_ = wd_p.shape[1]
    if gu.shape != (mp, 2 * np_):
        raise ValueError(f"gu {gu.shape} is not the forward's [Mp, 2 Np] = {(mp, 2 * np_)} for these "
                         f"tiles ({bm}x{bn}); run glu_gmm and glu_gmm_bwd with the same blocks")

    def prologue(in_refs, scratch_refs, row0, nb):
        gu_ref = in_refs[2]
        g_s, u_s, bars = scratch_refs
        rows = pl.ds(row0, bm)
        plgpu.copy_gmem_to_smem(gu_ref.at[rows, pl.ds(nb * bn, bn)], g_s, bars.at[0])
        plgpu.copy_gmem_to_smem(gu_ref.at[rows, pl.ds(np_ + nb * bn, bn)], u_s, bars.at[1])

    def group_acc(g, mb, nb, in_refs, scratch_refs):
        dy_ref, wd_ref, _ = in_refs
        (acc,) = group_products(dy_ref, (wd_ref,), g, mb, nb, tile=(bm, bn, bk), num_k=kp // bk,
                                stages=blocks.stages, transpose_rhs=True)
        return acc

    def epilogue(tile_smems, in_refs, out_refs, scratch_refs, row0, nb):
        (dh_s,) = tile_smems
        g_s, u_s, bars = scratch_refs
        (dgu_ref,) = out_refs
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        dg, du = glu_backward(kind, g_s[...], u_s[...], dh_s[...], beta, linear_beta)
        g_s[...] = dg.astype(dtype)  # in place: each thread reads its elements before writing
        u_s[...] = du.astype(dtype)
        plgpu.commit_smem()
        rows = pl.ds(row0, bm)
        plgpu.copy_smem_to_gmem(g_s, dgu_ref.at[rows, pl.ds(nb * bn, bn)])
        plgpu.copy_smem_to_gmem(u_s, dgu_ref.at[rows, pl.ds(np_ + nb * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    (dgu,) = grouped_rows_kernel(
        group_acc, group_sizes, (dy_p, wd_p, gu), shape=(mp, np_), tile=(bm, bn), out_dtype=dtype,
        scratch=[plgpu.SMEM((bm, bn), dtype), plgpu.SMEM((bm, bn), dtype), plgpu.Barrier(num_barriers=2)],
        band=blocks.band, interpret=interpret, prologue=prologue, epilogue=epilogue, name="gmm_glu_bwd",
        out_shapes=[jax.ShapeDtypeStruct((mp, 2 * np_), dtype)])
    return dgu

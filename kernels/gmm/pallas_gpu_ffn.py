"""The whole gated expert FFN of a block of rows in one Mosaic GPU kernel, for narrow experts.

At small expert widths (`configs/k3_small.py`: D = 256, F = 224) every grouped matmul is short
(4 steps of contraction) and reads or writes an [M, D] or [M, F] activation through HBM, so the
FFN's nine matmuls, each a separate launch, are bound by their fill and by those passes, not by
the tensor cores (README, MoE). Here one program owns a block of bm rows and keeps its hidden
activation in SMEM:

ffn_fwd:       x [M, D] -> y [M, D]. Per F block f: gate, up = x @ w_gate[g][:, f], x @ w_up[g][:, f]
               (one K-pipeline, two accumulators), h[:, f] = act(gate, up) into SMEM; then per D
               block d: y[:, d] = sum_f h[:, f] @ w_down[g][f, d]. x is read once and y written
               once: no h, gate or up reaches HBM, and the forward keeps only x as its residual.
ffn_bwd_rows:  x, dy [M, D] -> (dx [M, D], h [Mp, Fp], dgu = [dgate | dup] [Mp, 2 Fp]). Per F block,
               in one K-pipeline: gate and up again (recomputed, as the forward stored neither)
               and dh = dy @ w_down[g][f, :]^T; then h and the activation's backward into SMEM; per D block
               dx[:, d] = sum_f dgate[:, f] @ w_gate[g][d, f]^T + dup[:, f] @ w_up[g][d, f]^T.
               h and dgu leave for the weight gradients (two tgmm launches, `glu.py`).

A block of rows that spans several groups runs each group over all its rows and keeps that
group's rows (a row mask on every merged SMEM tile); products are row-wise, so a row's result
only ever meets its own group's weights. The SMEM the hidden activation needs bounds the widths:
`check_ffn_fits` refuses the shapes that do not fit (e.g. K3's D = 3584), for which
`glu.glu_ffn(..., fusion="glu")` is the kernel. Values round as the unfused path stores them:
gate, up, dh and h in the operand dtype before the float32 activation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.gmm.glu_math import glu_backward, glu_forward
from kernels.gmm.pallas_gpu import (
    Blocks, _block_groups, _check_dtypes, _group_loop, _offsets, _pad_to, _params, _row_iota, _swizzled, group_products)
from kernels.lowering import lowered_once

# Hopper's SMEM per block (227 KiB); the kernels' scratch and pipeline buffers must fit in it.
SMEM_BYTES = 227 * 1024


def padded_widths(D: int, F: int, blocks: Blocks) -> tuple[int, int]:
    """(Dp, Fp): D padded to the contraction and output tiles (bk, bn), F to bn."""
    return -(-D // math.lcm(blocks.bk, blocks.bn)) * math.lcm(blocks.bk, blocks.bn), -(-F // blocks.bn) * blocks.bn


def smem_bytes(D: int, F: int, blocks: Blocks, itemsize: int = 2) -> dict[str, int]:
    """SMEM per program of each kernel: the resident tiles plus the larger of the two phases'
    pipeline buffers (they are scoped one after the other)."""
    Dp, Fp = padded_widths(D, F, blocks)
    bm, bn, bk, s = blocks.bm, blocks.bn, blocks.bk, blocks.stages
    hidden, rows = bm * Fp * itemsize, bm * Dp * itemsize
    gate_up = s * (bm * bk + 2 * bk * bn) * itemsize
    down = s * bn * bn * itemsize
    rows_bwd = s * (2 * bm * bk + 3 * bk * bn) * itemsize  # x, dy and the three weight blocks
    return dict(fwd=hidden + rows + max(gate_up, down), bwd=3 * hidden + rows + max(rows_bwd, 2 * down))


def check_ffn_fits(D: int, F: int, blocks: Blocks) -> None:
    """Raise where the kernels' SMEM would exceed Hopper's (the hidden activation of bm rows
    stays in SMEM, three copies of it in the backward)."""
    if blocks.wgs != 1:
        raise ValueError(f"fused FFN kernels run one warpgroup per program; got Blocks.wgs={blocks.wgs}")
    need = smem_bytes(D, F, blocks)
    if max(need.values()) > SMEM_BYTES:
        raise ValueError(
            f"fused FFN at D={D}, F={F} with tiles {blocks.bm}x{blocks.bn}x{blocks.bk}/{blocks.stages} needs "
            f"{need['fwd'] // 1024} / {need['bwd'] // 1024} KiB of SMEM (forward / backward) of "
            f"{SMEM_BYTES // 1024}: use fewer rows per block or stages, or fusion='glu' (GATE_UP='fused_glu') "
            f"for wide experts")


def _prepare(x, w_gate, w_up, w_down, blocks):
    """Check; pad x to [Mp, Dp], gate/up weights to [G, Dp, Fp], down weights to [G, Fp, Dp]."""
    _check_dtypes(x, w_gate, w_up, w_down)
    G, D, F = w_gate.shape
    check_ffn_fits(D, F, blocks)
    Dp, Fp = padded_widths(D, F, blocks)
    x_p = _pad_to(_pad_to(x, 0, blocks.bm), 1, Dp)
    wg_p, wu_p = (_pad_to(_pad_to(w, 1, Dp), 2, Fp) for w in (w_gate, w_up))
    wd_p = _pad_to(_pad_to(w_down, 1, Fp), 2, Dp)
    return x_p, wg_p, wu_p, wd_p, Dp, Fp


def _merge(dst, val, *, whole, first, keep):
    """Store tile `val` into SMEM `dst`, keeping only this group's rows unless the block is
    `whole`ly the group's; the first group of a block zeroes the rest (no earlier value)."""
    @pl.when(whole)
    def _():
        dst[...] = val

    @pl.when(~whole & first)
    def _():
        dst[...] = jnp.where(keep(), val, 0).astype(dst.dtype)

    @pl.when(~whole & ~first)
    def _():
        dst[...] = jnp.where(keep(), val, dst[...])


def _launch(name, body, group_sizes, inputs, *, num_m, bm, out_shapes, scratch, interpret):
    """One program per block of bm rows; `body(g0, g1, offsets, row0, mb, *refs)`. `name` names
    the kernel (in ptxas's report and profiles)."""
    offsets = _offsets(group_sizes)
    first, last = _block_groups(offsets, num_m, bm)

    def kernel_body(off_ref, first_ref, last_ref, *refs):
        mb = jax.lax.axis_index("m")
        body(first_ref[mb], last_ref[mb], off_ref, mb * bm, mb, *refs)

    return plgpu.kernel(
        kernel_body,
        out_type=out_shapes,
        scratch_types=scratch,
        grid=(num_m,),
        grid_names=("m",),
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_params(interpret),
    )(offsets, first, last, *inputs)


def _products_over_f(lhs_tiles, rhs_refs, g, d, *, bm, bn, nF, stages, transpose_rhs):
    """[bm, bn] f32 tile d of sum_f sum_i lhs_tiles[i][f] @ B_i, B_i the (f, d) block of
    rhs_refs[i][g] ([G, Fp, Dp]; with transpose_rhs [G, Dp, Fp], the (d, f) block transposed):
    the contraction runs over F blocks whose left operands are already in SMEM."""
    def acc_scope(acc_ref):
        def step(idx, *rhs_smems):
            for lhs, rhs in zip(lhs_tiles, rhs_smems):
                plgpu.wgmma(acc_ref, lhs.at[idx[0]], rhs.transpose((1, 0)) if transpose_rhs else rhs)
            plgpu.wgmma_wait(len(rhs_smems))

        index = (lambda f: (d, f)) if transpose_rhs else (lambda f: (f, d))
        plgpu.emit_pipeline(
            step,
            grid=(nF,),
            in_specs=[plgpu.BlockSpec((bn, bn), index, delay_release=1)] * len(rhs_refs),
            max_concurrent_steps=stages,
        )(*(r.at[g] for r in rhs_refs))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))


def _gate_up_dh(x_ref, dy_ref, wg_ref, wu_ref, wd_ref, g, mb, f, *, bm, bn, bk, num_k, stages):
    """[bm, bn] f32 tiles gate, up = x[mb] @ w_gate[g][:, f], x[mb] @ w_up[g][:, f] and dh = dy[mb] @
    w_down[g][f, :]^T: one K-pipeline over D loads the x, dy and three weight blocks of a step
    together (x and dy share the contraction), so the backward fills one pipeline per F block."""
    def acc_scope(acc_g, acc_u, acc_dh):
        def step(_, x_s, dy_s, wg_s, wu_s, wd_s):
            plgpu.wgmma(acc_g, x_s, wg_s)
            plgpu.wgmma(acc_u, x_s, wu_s)
            plgpu.wgmma(acc_dh, dy_s, wd_s.transpose((1, 0)))
            plgpu.wgmma_wait(3)  # the previous step's products are done: its buffers can go

        rows = plgpu.BlockSpec((bm, bk), lambda kk: (mb, kk), delay_release=1)
        cols = plgpu.BlockSpec((bk, bn), lambda kk: (kk, f), delay_release=1)
        plgpu.emit_pipeline(
            step,
            grid=(num_k,),
            in_specs=[rows, rows, cols, cols, plgpu.BlockSpec((bn, bk), lambda kk: (f, kk), delay_release=1)],
            max_concurrent_steps=stages,
        )(x_ref, dy_ref, wg_ref.at[g], wu_ref.at[g], wd_ref.at[g])
        plgpu.wgmma_wait(0)
        return acc_g[...], acc_u[...], acc_dh[...]

    return pl.run_scoped(acc_scope, *[plgpu.ACC((bm, bn))] * 3)


@lowered_once("act", "blocks", "interpret")
def ffn_fwd(x, w_gate, w_up, w_down, group_sizes, *, act, blocks: Blocks, interpret=False):
    """y [M, D] in x's dtype (rows past sum(group_sizes) zero); `act` = (kind, beta, linear_beta).
    `blocks`: bm rows per program, bn the F and D tile, bk the contraction tile over D."""
    x_p, wg_p, wu_p, wd_p, Dp, Fp = _prepare(x, w_gate, w_up, w_down, blocks)
    kind, beta, linear_beta = act
    bm, bn, bk, stages = blocks.bm, blocks.bn, blocks.bk, blocks.stages
    Mp, dt = x_p.shape[0], x.dtype
    nF, nD = Fp // bn, Dp // bn

    def body(g0, g1, off_ref, row0, mb, x_ref, wg_ref, wu_ref, wd_ref, y_ref, h_s, y_s):
        @pl.when(g0 >= g1)  # every row past the total
        def _():
            y_s[...] = jnp.zeros(y_s.shape, dt)

        def one_group(g, carry):
            start, end = off_ref[g], off_ref[g + 1]
            whole = (start <= row0) & (end >= row0 + bm)
            keep = functools.partial(_in_group, row0, start, end, (bm, bn))

            @pl.when(end > start)
            def _():
                @pl.loop(0, nF)  # every row of the block: other groups' rows are masked below
                def _(f):
                    gate, up = group_products(x_ref, (wg_ref, wu_ref), g, mb, f, tile=(bm, bn, bk),
                                              num_k=Dp // bk, stages=stages)
                    h = glu_forward(kind, gate.astype(dt), up.astype(dt), beta, linear_beta)
                    h_s[f] = h.astype(dt)

                plgpu.commit_smem()

                @pl.loop(0, nD)
                def _(d):
                    y = _products_over_f((h_s,), (wd_ref,), g, d, bm=bm, bn=bn, nF=nF, stages=stages,
                                         transpose_rhs=False)
                    _merge(y_s.at[d], y.astype(dt), whole=whole, first=g == g0, keep=keep)

            return carry

        _group_loop(g0, g1, one_group)
        plgpu.commit_smem()
        for d in range(nD):
            plgpu.copy_smem_to_gmem(y_s.at[d], y_ref.at[pl.ds(row0, bm), pl.ds(d * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    tile = functools.partial(plgpu.SMEM, transforms=_swizzled(bn, dt))
    y = _launch("ffn_fwd", body, group_sizes, (x_p, wg_p, wu_p, wd_p), num_m=Mp // bm, bm=bm,
                out_shapes=jax.ShapeDtypeStruct((Mp, Dp), dt),
                scratch=[tile((nF, bm, bn), dt), tile((nD, bm, bn), dt)], interpret=interpret)
    return y[:x.shape[0], :x.shape[1]]


@lowered_once("act", "blocks", "interpret")
def ffn_bwd_rows(x, dy, w_gate, w_up, w_down, group_sizes, *, act, blocks: Blocks, interpret=False):
    """(dx [M, D], h [Mp, Fp], dgu [Mp, 2 Fp] = [dgate | dup]) in x's dtype: the input gradient
    and the operands of the weight gradients (padded rows and columns zero)."""
    _check_dtypes(dy)
    x_p, wg_p, wu_p, wd_p, Dp, Fp = _prepare(x, w_gate, w_up, w_down, blocks)
    dy_p = _pad_to(_pad_to(dy.astype(x.dtype), 0, blocks.bm), 1, Dp)
    kind, beta, linear_beta = act
    bm, bn, bk, stages = blocks.bm, blocks.bn, blocks.bk, blocks.stages
    Mp, dt = x_p.shape[0], x.dtype
    nF, nD = Fp // bn, Dp // bn

    def body(g0, g1, off_ref, row0, mb, x_ref, dy_ref, wg_ref, wu_ref, wd_ref, dx_ref, h_ref, dgu_ref,
             h_s, dg_s, du_s, dx_s):
        @pl.when(g0 >= g1)  # every row past the total
        def _():
            for s in (h_s, dg_s, du_s, dx_s):
                s[...] = jnp.zeros(s.shape, dt)

        def one_group(g, carry):
            start, end = off_ref[g], off_ref[g + 1]
            whole = (start <= row0) & (end >= row0 + bm)
            merge = functools.partial(_merge, whole=whole, first=g == g0,
                                      keep=lambda: _in_group(row0, start, end, (bm, bn)))

            @pl.when(end > start)
            def _():
                @pl.loop(0, nF)
                def _(f):
                    gate, up, dh = _gate_up_dh(x_ref, dy_ref, wg_ref, wu_ref, wd_ref, g, mb, f, bm=bm, bn=bn,
                                               bk=bk, num_k=Dp // bk, stages=stages)
                    gate, up, dh = gate.astype(dt), up.astype(dt), dh.astype(dt)
                    merge(h_s.at[f], glu_forward(kind, gate, up, beta, linear_beta).astype(dt))
                    dg, du = glu_backward(kind, gate, up, dh, beta, linear_beta)
                    merge(dg_s.at[f], dg.astype(dt))
                    merge(du_s.at[f], du.astype(dt))

                plgpu.commit_smem()

                @pl.loop(0, nD)
                def _(d):
                    dx = _products_over_f((dg_s, du_s), (wg_ref, wu_ref), g, d, bm=bm, bn=bn, nF=nF,
                                          stages=stages, transpose_rhs=True)
                    merge(dx_s.at[d], dx.astype(dt))

            return carry

        _group_loop(g0, g1, one_group)
        plgpu.commit_smem()
        rows = pl.ds(row0, bm)
        for d in range(nD):
            plgpu.copy_smem_to_gmem(dx_s.at[d], dx_ref.at[rows, pl.ds(d * bn, bn)])
        for f in range(nF):
            plgpu.copy_smem_to_gmem(h_s.at[f], h_ref.at[rows, pl.ds(f * bn, bn)])
            plgpu.copy_smem_to_gmem(dg_s.at[f], dgu_ref.at[rows, pl.ds(f * bn, bn)])
            plgpu.copy_smem_to_gmem(du_s.at[f], dgu_ref.at[rows, pl.ds(Fp + f * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    tile = functools.partial(plgpu.SMEM, transforms=_swizzled(bn, dt))
    out_shapes = (jax.ShapeDtypeStruct((Mp, Dp), dt), jax.ShapeDtypeStruct((Mp, Fp), dt),
                  jax.ShapeDtypeStruct((Mp, 2 * Fp), dt))
    dx, h, dgu = _launch("ffn_bwd_rows", body, group_sizes, (x_p, dy_p, wg_p, wu_p, wd_p), num_m=Mp // bm, bm=bm,
                         out_shapes=out_shapes,
                         scratch=[tile((nF, bm, bn), dt)] * 3 + [tile((nD, bm, bn), dt)], interpret=interpret)
    return dx[:x.shape[0], :x.shape[1]], h, dgu


def _in_group(row0, start, end, shape):
    rows = row0 + _row_iota(shape)
    return (rows >= start) & (rows < end)

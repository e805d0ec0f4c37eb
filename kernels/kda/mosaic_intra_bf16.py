"""Lean Mosaic GPU kernel for the intra-chunk stage of chunked KDA under a bounded gate (g >= -5).

Same outputs as `mosaic_intra.intra_bounded` (the operands of `mosaic_state.state_output`), with
bf16 operands where bf16 suffices (like flash-linear-attention's kernels); its training form
(`pieces=True`) also writes what `chunk.py`'s backward reads besides them (Ai^T from the inverse's
registers through a^T's SMEM once a^T is sent, k exp(G) from w's operand), chunk-major. One program (one
warpgroup) per (chunk, head), about 107 KiB of SMEM so two programs share an SM. Every [C, K]
tile is handled as K / 64 column halves of [C, 64]: a float32 half is 32 registers per thread,
so no phase holds more than a few (the whole-width version spilled at 255 registers).

The halves are loops, not unrolled copies, as are the inverse's repeated squarings: the kernel
is straight-line code run once per program, and at about 9300 instructions (146 KiB of SASS)
unrolled its warps spent half their cycles waiting for instruction fetch (Nsight Compute on an
H100: 6.7 of 12.8 cycles per issued instruction stalled on "no instruction").

  * The gates enter in base-2 units (g log2(e)), so each exponential is one ex2 instruction.
    D = G - a_I, the block-local cumsum (a_I = G at the first row of 16-row block I), is
    BlockTri (g_hi + g_lo) on the tensor cores (split bf16, about 2^-16 relative); the anchors
    a_I and G_last are Sel (g_hi + g_lo) beside it, 0/1 rows that sum each prefix (both
    column halves in one product, the second's Sel shifted down). Formed here,
    not by XLA, they cost no second and third pass over g (0.59 of the forward's 2.68 GB at
    8,4096,16,128 by the compiled HLO's count). G itself as Tri (g_hi + g_lo) in D's round trip
    (a third register operand) gave wrong qg, kg at random on an H100 with ptxas 13.0, a
    register-operand wgmma hazard; G = D + a_I keeps two.
  * Row side, one half per loop step after its D: Rq = q exp(D), Rk = k exp(D) (factors <= 1),
    Kl = k exp(-D) (<= exp(15 * 5)).
  * Scores, transposed, per row block I: column operand Kc_I = Kl times exp(a_I - a_J) (<= 1) on
    the rows of block J <= I; Aqk^T[:, I] = scale Kc_I Rq_I^T, L^T[:, I] = Kc_I Rk_I^T diag(beta_I):
    64x16 wgmmas into [C, 16] accumulators (eight, held over the column halves' loop). Kc_I is
    Kc_{I-1} times one column vector exp(a_I - a_{I-1}) on the rows before block I, so the operand
    costs a multiply per element, not an exponential and a select per block (0.90 -> 0.78 ms at
    8,4096,16,128 on an H100, `intra-revisions-scores-carry-h100-20261206T1410.json`). Kc_I is
    wgmma's register A operand: no SMEM store and fence per block (0.74 -> 0.70 ms with g loaded
    first, `intra-revisions-scores-rega-h100-20261206T1852.json`).
  * (I + L^T)^{-1} = Ai^T in split-bf16 products, two independent products per round trip:
    Dg = (I - Ud)(I + Ud^2)(I + Ud^4)(I + Ud^8) for the 16x16 diagonal blocks Ud, then with
    N = Dg Uo (N^4 = 0): Ai^T = (I - N)(I + N^2) Dg.
  * qg = scale q exp(G) (= scale Rq exp(a_I)) and kg = k exp(G_last - G) (= Kl exp(G_last - a_I))
    with G = D + a_I: one exponential of a tile each, not four of the per-block anchors; staged
    one half at a time beside g; after the scores k exp(G) = Rk exp(a_I) in place, then
    w = (Ai diag beta)(k exp G), u = (Ai diag beta) v with Ai diag(beta) as hi + lo bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import profiling
from kernels.lowering import lowered_once
from kernels.kda.mosaic_intra import MAX_EXP, _split_store, per_block as _per_block, truncated_parts
from kernels.kda.mosaic_state import C, _smem, flat_grid, grid_indices

SUB = 16
NB = C // SUB  # row blocks per chunk
HW = 64  # column half width
ROW = 8  # rows between the column halves' anchors in their one product
assert HW == C, "one [C, HW] row/column index serves the [C, C] score tiles too"
_W = plgpu.Layout.WGMMA
LOG2E = 1.4426950408889634  # the gates enter in base-2 units: each exponential is one ex2


def _distinct(mats):
    out = []
    for M in mats:
        if not any(M is m for m in out):
            out.append(M)
    return out


def _mm_pair(pairs, m_s, dt, a_s=None):
    """Products X @ Y of f32 [C, C] register matrices in split bf16 (hi*hi + hi*lo + lo*hi), one
    or two of them in one round trip. Each distinct Y's parts go to m_s (at most two, four bf16
    tiles); each X's parts stay in registers (wgmma's register A operand: no SMEM round trip,
    and X = Y needs no second copy). `a_s` (four tiles, the Mosaic GPU interpreter only, which
    does not take register operands) holds the X parts instead."""
    ys, xs = _distinct([Y for _, Y in pairs]), _distinct([X for X, _ in pairs])
    assert len(ys) <= 2 and len(xs) <= 2, "two distinct operands per side"
    for i, Y in enumerate(ys):
        _split_store(Y, m_s.at[2 * i], m_s.at[2 * i + 1], dt, truncated_parts)
    if a_s is not None:
        for i, X in enumerate(xs):
            _split_store(X, a_s.at[2 * i], a_s.at[2 * i + 1], dt, truncated_parts)
    plgpu.commit_smem()
    index = lambda ms, M: next(i for i, m in enumerate(ms) if m is M)  # noqa: E731

    def a_parts(X):
        if a_s is not None:
            i = 2 * index(xs, X)
            return a_s.at[i], a_s.at[i + 1]
        return truncated_parts(X, dt)

    def prod(*accs):
        for acc, (X, Y) in zip(accs, pairs):
            x_hi, x_lo = a_parts(X)
            y = 2 * index(ys, Y)
            plgpu.wgmma(acc, x_hi, m_s.at[y])
            plgpu.wgmma(acc, x_hi, m_s.at[y + 1])
            plgpu.wgmma(acc, x_lo, m_s.at[y])
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(prod, *[plgpu.ACC((C, C), jnp.float32) for _ in pairs])


def _body(q_ref, k_ref, v_ref, g_ref, b_ref, qg_ref, wn_ref, kg_ref, u_ref, a_ref, d_ref, *rest, H, KH, VH, scale, dt,
          grid, pieces):
    ai_ref, kx_ref = rest[:2] if pieces else (None, None)
    q_s, k_s, kl_s, an_s, b_s, a_o, union, bars, *a_s = rest[2:] if pieces else rest
    (g_s, st_s), parts, kc_s, (v_s, m_s), (_, an_full), (_, sel1_s) = union
    phase = profiling.phases()  # named profiler ranges (kernels.profiling), free when not profiling
    phase("load")
    n, bh = grid_indices(grid)
    b, h = lax.div(bh, H), lax.rem(bh, H)
    out = lambda ref, *idx: ref.at[(n, bh, *idx) if pieces else (bh, n, *idx)]  # noqa: E731 - this chunk-head's output
    rows_t = pl.ds(n * C, C)
    half = lambda j: pl.ds(j * HW, HW)  # noqa: E731
    loads = [(g_ref.at[b, rows_t, h, half(j)], g_s.at[j]) for j in range(KH)]
    loads += [(q_ref.at[b, rows_t, h, half(j)], q_s.at[j]) for j in range(KH)]
    loads += [(k_ref.at[b, rows_t, h, half(j)], k_s.at[j]) for j in range(KH)]
    loads += [(b_ref.at[b, h, rows_t], b_s)]
    for i, (src, dst) in enumerate(loads):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    for i in range(KH):  # g; q, k and beta land while the cumsum and the anchors run
        plgpu.barrier_wait(bars.at[i])
    f32 = jnp.float32
    # Tile indices (HW == C: also the [C, C] ones) as a row and a column vector, broadcast where a
    # mask is formed: a full int32 index tile would hold 32 registers per thread for the whole
    # kernel, which runs at the register limit.
    r1 = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=_W.reduce(1))
    c1 = plgpu.broadcasted_iota(jnp.int32, (HW,), 0, layout=_W.reduce(0))
    rows = lambda: lax.broadcast_in_dim(r1, (C, HW), [0])  # noqa: E731
    cols = lambda: lax.broadcast_in_dim(c1, (C, HW), [1])  # noqa: E731
    block_of = lambda v: sum(jnp.where(v >= I * SUB, 1, 0) for I in range(1, NB))  # noqa: E731
    same_block = lambda: (lax.broadcast_in_dim(block_of(r1), (C, HW), [0])  # noqa: E731
                          == lax.broadcast_in_dim(block_of(c1), (C, HW), [1]))
    blocks = lambda fn: _per_block((C, HW), fn, NB)  # noqa: E731 - rows of block I hold fn(I) [HW]
    # [HW] anchor i of column half j (j may be a loop index: an_s is [KH, NB + 2, HW])
    anchor = lambda i, j: plgpu.load(an_s.at[j, i], layout=_W.reduce(0))  # noqa: E731
    halves = lambda fn: lax.fori_loop(0, KH, lambda j, c: fn(j) or c, None)  # noqa: E731 - one copy of fn's code

    phase("cumsum")
    # D = G - a_I, the block-local cumsum: BlockTri (g_hi + g_lo), BlockTri[r, s] = 1 for s in
    # r's block, after its first row, up to r. BlockTri is the products' register operand.
    later_col = lax.broadcast_in_dim(block_of(c1) * SUB != c1, (C, HW), [1])  # not a block's first column
    bt = jnp.where(same_block() & (cols() <= rows()) & later_col, 1.0, 0.0).astype(dt)
    # The anchors, Sel (g_hi + g_lo): Sel's row I < NB sums rows 0 .. 16 I (a_I = G at block I's
    # first row), row NB all 64 (G_last); its other rows are zero.
    def sel_rows(r):  # r: each element's row of Sel (negative: a zero row)
        return jnp.where((r >= 0) & (((r < NB) & (cols() <= r * SUB)) | (r == NB)), 1.0, 0.0).astype(dt)

    sel = sel_rows(rows())
    if a_s:  # the interpreter takes wgmma operands from SMEM only (see _mm_pair)
        a_s[0].at[0][...] = bt
        a_s[0].at[1][...] = sel
        bt, sel = a_s[0].at[0], a_s[0].at[1]

    # g as hi + lo parts in g's own memory (Pallas's barrier before each store: every warp has
    # read it), then the anchors of both halves in one product: Sel (g_hi + g_lo) for the first
    # half, Sel shifted down ROW rows for the second, so one wgmma wait, one tile store and two
    # fences serve both (0.692 -> 0.672 ms at 8,4096,16,128 on an H100,
    # `intra-revisions-anchors-h100-20261206T2016.json`). Its rows go through SMEM (st_s's memory,
    # free until the first half's outputs) to where every warp reads them, and the chunk decay
    # exp(G_last) out (here, not as an XLA op after the kernel). The halves are unrolled here: a
    # store into an_s takes no loop index.
    for j in range(KH):
        g_j = plgpu.load(g_s.at[j], layout=_W) * LOG2E
        _split_store(g_j, parts.at[j, 0], parts.at[j, 1], dt, truncated_parts)
    if KH == 2:  # Sel shifted down by ROW rows: the second half's anchors land beside the first's
        sel1_s[...] = sel_rows(rows() - ROW)
    plgpu.commit_smem()

    def anchors(acc):  # half j's anchors in rows ROW * j .. ROW * j + NB of one product
        for j in range(KH):
            for part in range(2):
                plgpu.wgmma(acc, sel if j == 0 else sel1_s, parts.at[j, part])
        return acc[...]

    an_full[...] = pl.run_scoped(anchors, plgpu.ACC((C, HW), f32))  # over sel1_s: its products are done
    plgpu.commit_smem()
    for j in range(KH):
        for i in range(NB + 1):
            an_s.at[j, i][...] = plgpu.load(an_full.at[ROW * j + i], layout=_W.reduce(0))
        an_s.at[j, NB + 1][...] = jnp.exp2(plgpu.load(an_full.at[ROW * j + NB], layout=_W.reduce(0)))
    plgpu.commit_smem()
    for j in range(KH):
        plgpu.copy_smem_to_gmem(an_s.at[j, NB + 1], out(d_ref, half(j)))

    phase("row_side")
    # Half by half: D, then Rq, Rk in place of q, k; Kl; and from the same registers the outputs
    # qg = scale Rq exp(a_I), kg = Kl exp(G_last - a_I), staged in st_s.
    sub = jax.named_scope  # sub-phases, nested in the phase's range

    def row_half(j):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous half's staged outputs are read
        with sub("block_cumsum"):
            def cumsum(acc_d):
                for part in range(2):
                    plgpu.wgmma(acc_d, bt, parts.at[j, part])
                return acc_d[...]

            D = pl.run_scoped(cumsum, plgpu.ACC((C, HW), f32))
        e = jnp.exp2(D)
        G = D + blocks(lambda I: anchor(I, j))
        qf = plgpu.load(q_s.at[j], layout=_W).astype(f32)
        q_s.at[j][...] = (qf * e).astype(dt)
        st_s.at[0][...] = (qf * jnp.exp2(G) * scale).astype(dt)  # qg = scale Rq exp(a_I)
        kf = plgpu.load(k_s.at[j], layout=_W).astype(f32)
        k_s.at[j][...] = (kf * e).astype(dt)
        kl_s.at[j][...] = (kf * jnp.exp2(jnp.minimum(-D, MAX_EXP * LOG2E))).astype(dt)
        G_last = lax.broadcast_in_dim(anchor(NB, j), (C, HW), [1])
        st_s.at[1][...] = (kf * jnp.exp2(G_last - G)).astype(dt)  # kg = Kl exp(G_last - a_I), exponent <= 0
        plgpu.commit_smem()
        with sub("row_side_out"):
            plgpu.copy_smem_to_gmem(st_s.at[0], out(qg_ref, slice(None), half(j)))
            plgpu.copy_smem_to_gmem(st_s.at[1], out(kg_ref, slice(None), half(j)))

    for i in range(KH, len(loads)):
        plgpu.barrier_wait(bars.at[i])
    halves(row_half)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    phase("scores")
    # Transposed scores, A^T[:, block I] = sum_j Kc_I,j Rq[block I, j]^T with Kc_I = Kl times
    # exp(a_I - a_J) on the rows of each block J <= I. Kc_I is carried from Kc_{I-1} (Kc_0 = Kl) by
    # one column vector, exp(a_I - a_{I-1}) <= 1, on the rows before block I: no exponential or
    # block select per element. Rows after block I still hold Kl (finite); they land only in A^T's
    # entries that the masks below drop. One column half per loop step, the row blocks unrolled in
    # it (an accumulator cannot follow a loop index). Kc_I goes to the products from registers;
    # the interpreter's operand alternates between two SMEM buffers instead.
    def products(*accs):
        def half_scores(j):
            with sub("scores_operand"):
                kc = plgpu.load(kl_s.at[j], layout=_W).astype(f32)
            for I in range(NB):
                if I:
                    with sub("scores_operand"):
                        f = jnp.exp2(jnp.minimum(anchor(I, j) - anchor(I - 1, j), 0.0))
                        before = lax.broadcast_in_dim(r1 < I * SUB, (C, HW), [0])
                        kc = kc * jnp.where(before, lax.broadcast_in_dim(f, (C, HW), [1]), 1.0)
                if a_s:  # the interpreter takes wgmma operands from SMEM only
                    plgpu.wgmma_wait(2)  # the products that read this buffer (block I - 2) are done
                    kc_s.at[I % 2][...] = kc.astype(dt)
                    plgpu.commit_smem()
                    kop = kc_s.at[I % 2]
                else:
                    kop = kc.astype(dt)
                with sub("scores_issue"):
                    blk = pl.ds(I * SUB, SUB)
                    plgpu.wgmma(accs[I], kop, q_s.at[j, blk].transpose((1, 0)))
                    plgpu.wgmma(accs[NB + I], kop, k_s.at[j, blk].transpose((1, 0)))

        halves(half_scores)
        with sub("scores_drain"):
            return tuple(acc[...] for acc in accs)

    scores = pl.run_scoped(products, *[plgpu.ACC((C, SUB), f32) for _ in range(2 * NB)])
    AT, LT = jnp.concatenate(scores[:NB], axis=1), jnp.concatenate(scores[NB:], axis=1)
    phase("scores_out")
    for j in range(VH):  # v lands while the inverse runs (its memory held the scores' operand)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows_t, h, half(j)], v_s.at[j], bars.at[len(loads) + j])
    # rows: column c of the scores; cols: row r.
    beta_r = lax.broadcast_in_dim(plgpu.load(b_s, layout=_W.reduce(0)), (C, C), [1])
    a_o[...] = (jnp.where(cols() >= rows(), AT, 0.0) * scale).astype(dt)  # Aqk^T
    U = jnp.where(cols() > rows(), LT * beta_r, 0.0)  # L^T

    def k_exp_g(j):  # k exp(G) = Rk exp(a_I) in place for w (Rk's last reads were the scores)
        rk = plgpu.load(k_s.at[j], layout=_W).astype(f32)
        k_s.at[j][...] = (rk * jnp.exp2(blocks(lambda I: anchor(I, j)))).astype(dt)

    halves(k_exp_g)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(a_o, out(a_ref))
    if pieces:  # k exp(G) for the backward (its kgam = beta k exp(G)), read from w's operand
        for j in range(KH):
            plgpu.copy_smem_to_gmem(k_s.at[j], out(kx_ref, slice(None), half(j)))

    phase("inverse")
    # (I + U)^{-1} = Ai^T, U = L^T strictly upper: diagonal blocks Dg = (I + Ud)^{-1}, then
    # I + U = (I + Ud)(I + Dg Uo) with N = Dg Uo block-nilpotent (N^4 = 0).
    eye = jnp.where(rows() == cols(), 1.0, 0.0)
    Ud = jnp.where(same_block(), U, 0.0)
    Uo = U - Ud
    mm = functools.partial(_mm_pair, m_s=m_s, dt=dt, a_s=a_s[0] if a_s else None)
    (P,) = mm([(Ud, Ud)])

    def square(_, XP):  # X (I + P), P <- P^2: with P = Ud^2, Ud^4, Ud^8 (the last P^2 = Ud^16 = 0 unused:
        X, P = XP          # one loop body in the code costs less than a third product's own copy)
        XP, P = mm([(X, P), (P, P)])
        return X + XP, P

    Dg, _ = lax.fori_loop(0, 3, square, (eye - Ud, P))
    (N,) = mm([(Dg, Uo)])
    NDg, N2 = mm([(N, Dg), (N, N)])
    Y = Dg - NDg
    (N2Y,) = mm([(N2, Y)])
    AiT = Y + N2Y

    phase("wy")
    # w = (Ai diag beta)(k exp G), u = (Ai diag beta) v: the A operand is the transposed view of
    # diag(beta) Ai^T, stored as hi + lo bf16 in m_s[0], m_s[1]; -w goes to m_s[2:].
    beta_c = lax.broadcast_in_dim(plgpu.load(b_s, layout=_W.reduce(1)), (C, C), [0])
    _split_store(AiT * beta_c, m_s.at[0], m_s.at[1], dt, truncated_parts)
    if pieces:  # Ai^T for the backward in a^T's memory, once a^T's copy has read it
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        a_o[...] = AiT.astype(dt)
    plgpu.commit_smem()
    if pieces:
        plgpu.copy_smem_to_gmem(a_o, out(ai_ref))

    def wy(srcs, *accs):
        for acc, src in zip(accs, srcs):
            for p in range(2):
                plgpu.wgmma(acc, m_s.at[p].transpose((1, 0)), src)
        return tuple(acc[...] for acc in accs)

    ws = pl.run_scoped(functools.partial(wy, [k_s.at[j] for j in range(KH)]), *[plgpu.ACC((C, HW), f32)] * KH)
    for j in range(KH):
        m_s.at[2 + j][...] = (ws[j] if pieces else -ws[j]).astype(dt)
    for j in range(VH):
        plgpu.barrier_wait(bars.at[len(loads) + j])
    us = pl.run_scoped(functools.partial(wy, [v_s.at[j] for j in range(VH)]), *[plgpu.ACC((C, HW), f32)] * VH)
    for j in range(VH):
        v_s.at[j][...] = us[j].astype(dt)
    plgpu.commit_smem()
    for j in range(KH):
        plgpu.copy_smem_to_gmem(m_s.at[2 + j], out(wn_ref, slice(None), half(j)))
    for j in range(VH):
        plgpu.copy_smem_to_gmem(v_s.at[j], out(u_ref, slice(None), half(j)))
    phase("store")
    plgpu.wait_smem_to_gmem(0)
    phase(None)


def intra_bf16(q, k, v, g, beta_t, *, scale, interpret=False, pieces=False):
    """Intra-chunk stage for bounded gates (every g >= -5), no segment resets.

    q, k [B, Tp, H, K] and v [B, Tp, H, V] (bf16, Tp a multiple of 64, K and V in {64, 128});
    g [B, Tp, H, K] f32 gates; beta_t [B, H, Tp] f32. Returns bf16 (qg, wn = -w, kg
    [BH, NT, C, K], u [BH, NT, C, V], a^T [BH, NT, C, C]) for
    `mosaic_state.state_output(..., a_transposed=True)`, and the chunk decays d = exp(G_last)
    [BH, NT, K] f32.

    `pieces`: what a training forward keeps for `chunk.py`'s backward as well, every output
    chunk-major ([NT, BH, ...], `state_output(..., chunk_major=True)`) and w itself instead of -w:
    (qg, w, kg, u, a^T, d, Ai^T [NT, BH, C, C], k exp(G) [NT, BH, C, K]) with Ai = (I + L)^{-1}
    (bf16, its operand dtype there), G the chunk-local cumsum of g.
    """
    return _intra_bf16(q, k, v, g, beta_t, scale=float(scale), interpret=interpret, pieces=bool(pieces))


@lowered_once("scale", "interpret", "pieces")
def _intra_bf16(q, k, v, g, beta_t, *, scale, interpret, pieces):
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    if K % HW or V % HW or K > 2 * HW or V > 2 * HW or Tp % C:
        raise ValueError(f"intra_bf16 takes K, V in (64, 128) and T a multiple of {C}; got K={K}, V={V}, T={Tp}")
    NT = Tp // C
    KH, VH = K // HW, V // HW
    dt = q.dtype
    f32 = jnp.float32
    half = lambda n, dtype: _smem((n, C, HW), dtype)  # noqa: E731
    union = plgpu.RefUnion(
        (half(KH, f32), half(2, dt)),  # g; one half's qg, kg staged
        _smem((KH, 2, C, HW), dt),  # g as hi + lo (half j's over g's half j)
        half(2, dt),  # column operand of the scores, two buffers (the interpreter's; on a GPU it is in registers)
        (half(VH, dt), _smem((4, C, C), dt)),  # v -> u; split operands of the inverse, then Ai diag(beta), -w
        (half(KH, f32), plgpu.SMEM((C, HW), f32)),  # (g's place;) the anchor product, in st_s's place
        (half(KH, f32), _smem((C, C), dt)),  # the second half's Sel, under the anchor product
    )
    scratch = [
        half(KH, dt),  # q -> Rq -> qg
        half(KH, dt),  # k -> Rk -> k exp(G)
        half(KH, dt),  # Kl -> kg
        plgpu.SMEM((KH, NB + 2, HW), f32),  # anchors a_0..a_3, G_last, the decay exp(G_last), by column half
        plgpu.SMEM((C,), f32),  # beta
        _smem((C, C), dt),  # a^T
        union,
        plgpu.Barrier(num_barriers=3 * KH + 1 + VH),
    ]
    if interpret:  # the interpreter takes wgmma operands from SMEM only (see _mm_pair)
        scratch.append(_smem((4, C, C), dt))
    lead = (NT, B * H) if pieces else (B * H, NT)
    sds = lambda *s, dtype=dt: jax.ShapeDtypeStruct((*lead, *s), dtype)  # noqa: E731
    out_type = (sds(C, K), sds(C, K), sds(C, K), sds(C, V), sds(C, C), sds(K, dtype=f32))
    if pieces:
        out_type += (sds(C, C), sds(C, K))
    body = functools.partial(_body, H=H, KH=KH, VH=VH, scale=float(scale), dt=dt, grid=(NT, B * H), pieces=pieces)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        **flat_grid((NT, B * H)),
        kernel_name="kda_intra_bf16",
        compiler_params=profiling.compiler_params(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, v, g, beta_t)

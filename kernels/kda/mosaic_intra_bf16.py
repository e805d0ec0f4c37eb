"""Lean Mosaic GPU kernel for the intra-chunk stage of chunked KDA under a bounded gate (g >= -5).

Same outputs as `mosaic_intra.intra_bounded` (the operands of `mosaic_state.state_output`), with
bf16 operands where bf16 suffices (like flash-linear-attention's kernels); its training form
(`pieces=True`) also writes what `chunk.py`'s backward reads besides them (Ai^T from the inverse's
registers through a^T's SMEM once a^T is sent, k exp(G) from w's operand), chunk-major. One program (one
warpgroup) per (chunk, head), about 110 KiB of SMEM so two programs share an SM. Every [C, K]
tile is handled as K / 64 column halves of [C, 64]: a float32 half is 32 registers per thread,
so no phase holds more than a few (the whole-width version spilled at 255 registers).

The halves are loops, not unrolled copies, as are the inverse's repeated squarings: the kernel
is straight-line code run once per program, and at about 9300 instructions (146 KiB of SASS)
unrolled its warps spent half their cycles waiting for instruction fetch (Nsight Compute on an
H100: 6.7 of 12.8 cycles per issued instruction stalled on "no instruction").

  * The gates enter in base-2 units (g log2(e)), so each exponential is one ex2 instruction.
    D = G - a_I, the block-local cumsum (a_I = G at the last row of 16-row block I - 1, a_0 = 0),
    is BlockTri (g_hi + g_lo) on the tensor cores (split bf16, about 2^-16 relative), formed
    here, not by XLA (no second and third pass over g: 0.59 of the forward's 2.68 GB at
    8,4096,16,128 by the compiled HLO's count). The anchors follow from D's last rows,
    a_{I+1} = a_I + D[16 I + 15] (a_NB = G_last), read back as vectors, where a product of 0/1
    selector rows with g's parts gave them before. G itself as Tri (g_hi + g_lo) in D's round
    trip (a third register operand) gave wrong qg, kg at random on an H100 with ptxas 13.0, a
    register-operand wgmma hazard; G = D + a_I keeps two.
  * Row side, one half per loop step after its D: Rq = q exp(D), Rk = k exp(D) (factors <= 1),
    Kl = k exp(-D) (<= exp(16 * 5)).
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
    N = Dg Uo (N^4 = 0): Ai^T = (I - N)(I + N^2) Dg. Each matrix is four [C, 16] column blocks
    and each product takes only its nonzero 16x16 blocks (43 of the 176 block products that
    eleven whole 64x64x64 products hold), as m64n16k16 wgmmas on 32-byte swizzled operands.
  * qg = scale q exp(G) = scale Rq exp(a_I), with exp(a_I) formed once per anchor (not per
    element), and kg = k exp(G_last - G) with G = D + a_I, one exponential of a tile (its
    exponent <= 0, where Kl exp(G_last - a_I) could underflow in the second factor); staged
    one half at a time beside g; after the scores k exp(G) = Rk exp(a_I) in place, then
    w = (Ai diag beta)(k exp G), u = (Ai diag beta) v with Ai diag(beta) as hi + lo bf16.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import profiling
from kernels.lowering import lowered_once
from kernels.kda.mosaic_intra import MAX_EXP, _split_store, per_block as _per_block, truncated_parts
from kernels.kda.mosaic_state import C, _smem, flat_grid, grid_indices, smem_transforms

SUB = 16
NB = C // SUB  # row blocks per chunk
HW = 64  # column half width
assert HW == C, "one [C, HW] row/column index serves the [C, C] score tiles too"
_W = plgpu.Layout.WGMMA
LOG2E = 1.4426950408889634  # the gates enter in base-2 units: each exponential is one ex2


def _distinct(mats):
    out = []
    for M in mats:
        if not any(M is m for m in out):
            out.append(M)
    return out


# Which 16-column blocks J of X meet block (J, c) of Y in column block c of X @ Y, for the
# inverse's block-structured operands (None: column block c of the product is zero).
DIAG = ((0,), (1,), (2,), (3,))  # block diagonal @ block diagonal
DG_UO = (None, (0,), (0, 1), (0, 1, 2))  # block diagonal @ strictly block upper
N_DG = (None, (1,), (2,), (3,))  # N (column block 0 zero) @ block diagonal
N_N = (None, None, (1,), (1, 2))  # N @ N, both strictly block upper
N2_Y = (None, None, (2,), (2, 3))  # N^2 (blocks two above the diagonal) @ block upper


def _mm_blocks(products, m_s, dt, a_s=None):
    """Products X @ Y of f32 [C, C] register matrices held as NB column blocks [C, SUB] (None: a
    zero block), in split bf16 (hi*hi + hi*lo + lo*hi), one or two per round trip. `products`:
    (X, Y, terms) with terms[c] the column blocks J of X that meet block (J, c) of Y (None: none),
    so only the nonzero 16x16 blocks go to the tensor cores: one m64n16k16 wgmma per term and part
    (the inverse's operands are block diagonal or block triangular; a whole 64x64x64 product per
    part is 16 such, where these take 4 to 6). Each distinct Y's parts go to m_s (at most two,
    four bf16 tiles swizzled 32 bytes wide, so a 16x16 block is one (8, 16)-tiled slice), only
    the column blocks some term reads; each X's parts stay in registers (wgmma's register A
    operand, one [C, SUB] column block per term). `a_s` (the Mosaic GPU interpreter only, which
    does not take register operands) holds the X parts instead. Returns each product's column
    blocks (None where terms[c] is None)."""
    ys, xs = _distinct([Y for _, Y, _ in products]), _distinct([X for X, _, _ in products])
    assert len(ys) <= 2 and len(xs) <= 2, "two distinct operands per side"
    index = lambda ms, M: next(i for i, m in enumerate(ms) if m is M)  # noqa: E731
    cols = lambda c: pl.ds(c * SUB, SUB)  # noqa: E731
    # The column blocks each Y gives (and each X) start at its first nonzero one: stored as one
    # slice, not block by block (Pallas fences every SMEM store).
    first_y = [min(c for X, Y, t in products if Y is M for c in range(NB) if t[c]) for M in ys]
    read_x = [sorted({J for X, Y, t in products if X is M for c in range(NB) if t[c] for J in t[c]}) for M in xs]
    for i, (Y, c0) in enumerate(zip(ys, first_y)):
        tail = pl.ds(c0 * SUB, C - c0 * SUB)
        _split_store(jnp.concatenate(Y[c0:], axis=1), m_s.at[2 * i, :, tail], m_s.at[2 * i + 1, :, tail], dt,
                     truncated_parts)
    if a_s is None:
        x_parts = [{J: truncated_parts(X[J], dt) for J in used} for X, used in zip(xs, read_x)]
    else:
        for i, (X, used) in enumerate(zip(xs, read_x)):
            tail = pl.ds(used[0] * SUB, C - used[0] * SUB)
            _split_store(jnp.concatenate(X[used[0]:], axis=1), a_s.at[2 * i, :, tail], a_s.at[2 * i + 1, :, tail], dt,
                         truncated_parts)
        x_parts = [{J: (a_s.at[2 * i, :, cols(J)], a_s.at[2 * i + 1, :, cols(J)]) for J in used}
                   for i, used in enumerate(read_x)]
    plgpu.commit_smem()
    slots = [(k, c) for k, (_, _, t) in enumerate(products) for c in range(NB) if t[c]]

    def prod(*accs):
        for acc, (k, c) in zip(accs, slots):
            X, Y, terms = products[k]
            x, y = index(xs, X), 2 * index(ys, Y)
            for J in terms[c]:
                x_hi, x_lo = x_parts[x][J]
                blk = (pl.ds(J * SUB, SUB), cols(c))
                plgpu.wgmma(acc, x_hi, m_s.at[(y, *blk)])
                plgpu.wgmma(acc, x_hi, m_s.at[(y + 1, *blk)])
                plgpu.wgmma(acc, x_lo, m_s.at[(y, *blk)])
        return tuple(acc[...] for acc in accs)

    done = iter(pl.run_scoped(prod, *[plgpu.ACC((C, SUB), jnp.float32) for _ in slots]))
    return [[next(done) if t[c] else None for c in range(NB)] for _, _, t in products]


def _blocks_op(op, X, Y):
    """op on two block lists (None: a zero block)."""
    return [x if y is None else (op(0.0, y) if x is None else op(x, y)) for x, y in zip(X, Y)]


def _body(q_ref, k_ref, v_ref, g_ref, b_ref, qg_ref, wn_ref, kg_ref, u_ref, a_ref, d_ref, *rest, H, KH, VH, scale, dt,
          grid, pieces):
    ai_ref, kx_ref = rest[:2] if pieces else (None, None)
    q_s, k_s, kl_s, an_s, b_s, a_o, union, bars, *a_s = rest[2:] if pieces else rest
    (g_s, st_s), parts, kc_s, (v_s, m_s), (_, d_rows), (_, m32_s) = union
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
    # [HW] anchor row i of column half j (j may be a loop index: an_s is [KH, 2 NB + 2, HW])
    anchor = lambda i, j: plgpu.load(an_s.at[j, i], layout=_W.reduce(0))  # noqa: E731
    halves = lambda fn: lax.fori_loop(0, KH, lambda j, c: fn(j) or c, None)  # noqa: E731 - one copy of fn's code

    phase("cumsum")
    # D = G - a_I, the block-local cumsum: BlockTri (g_hi + g_lo), BlockTri[r, s] = 1 for s in
    # r's block up to r, so a_I is G at the last row of block I - 1 (a_0 = 0). BlockTri is the
    # product's register operand. D goes to g's own memory (its parts are read by then), and the
    # anchors come from its rows: a_{I+1} = a_I + D[16 I + 15], a_NB = G_last.
    bt = jnp.where(same_block() & (cols() <= rows()), 1.0, 0.0).astype(dt)
    if a_s:  # the interpreter takes wgmma operands from SMEM only (see _mm_blocks)
        a_s[0].at[0][...] = bt
        bt = a_s[0].at[0]
    for j in range(KH):  # unrolled: a store into an_s takes no loop index
        g_j = plgpu.load(g_s.at[j], layout=_W) * LOG2E
        _split_store(g_j, parts.at[j, 0], parts.at[j, 1], dt, truncated_parts)
        plgpu.commit_smem()

        def cumsum(acc_d):
            for part in range(2):
                plgpu.wgmma(acc_d, bt, parts.at[j, part])
            return acc_d[...]

        D = pl.run_scoped(cumsum, plgpu.ACC((C, HW), f32))
        g_s.at[j][...] = D  # over parts j: its products are done
        d_rows[...] = D
        plgpu.commit_smem()
        an_s.at[j, 0][...] = plgpu.layout_cast(jnp.zeros((HW,), f32), _W.reduce(0))
        a = None
        for I in range(NB):
            d = plgpu.load(d_rows.at[I * SUB + SUB - 1], layout=_W.reduce(0))
            a = d if a is None else a + d
            an_s.at[j, I + 1][...] = a
        an_s.at[j, NB + 1][...] = jnp.exp2(a)  # the chunk decay exp(G_last)
    plgpu.commit_smem()
    # exp(a_I) for qg = scale Rq exp(a_I) and k exp(G) = Rk exp(a_I) (products of factors <= 1,
    # where exp(G) of the tile was an exponential per element), in a layout that holds each
    # anchor once across the warpgroup, not once per row as a tile's column vector does.
    strided = plgpu.Layout.WG_STRIDED((KH, NB, HW), vec_size=2)
    an_s.at[:, pl.ds(NB + 2, NB)][...] = jnp.exp2(plgpu.load(an_s.at[:, pl.ds(0, NB)], layout=strided))
    plgpu.commit_smem()
    for j in range(KH):
        plgpu.copy_smem_to_gmem(an_s.at[j, NB + 1], out(d_ref, half(j)))

    phase("row_side")
    # Half by half: D, then Rq, Rk in place of q, k; Kl; and from the same registers the outputs
    # qg = scale Rq exp(a_I), kg = Kl exp(G_last - a_I), staged in st_s.
    sub = jax.named_scope  # sub-phases, nested in the phase's range

    def row_half(j):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous half's staged outputs are read
        D = plgpu.load(g_s.at[j], layout=_W)
        e = jnp.exp2(D)
        rq = plgpu.load(q_s.at[j], layout=_W).astype(f32) * e
        q_s.at[j][...] = rq.astype(dt)
        st_s.at[0][...] = (rq * blocks(lambda I: anchor(NB + 2 + I, j)) * scale).astype(dt)  # qg = scale Rq exp(a_I)
        kf = plgpu.load(k_s.at[j], layout=_W).astype(f32)
        k_s.at[j][...] = (kf * e).astype(dt)
        kl_s.at[j][...] = (kf * jnp.exp2(jnp.minimum(-D, MAX_EXP * LOG2E))).astype(dt)
        # kg = k exp(G_last - G), G = D + a_I: the exponent is <= 0 (Kl exp(G_last - a_I) could underflow
        # in its second factor where kg does not)
        G_last = lax.broadcast_in_dim(anchor(NB, j), (C, HW), [1])
        st_s.at[1][...] = (kf * jnp.exp2(G_last - D - blocks(lambda I: anchor(I, j)))).astype(dt)
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
    AT = jnp.concatenate(scores[:NB], axis=1)
    phase("scores_out")
    for j in range(VH):  # v lands while the inverse runs (its memory held the scores' operand)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows_t, h, half(j)], v_s.at[j], bars.at[len(loads) + j])
    # rows: column c of the scores; cols: row r.
    a_o[...] = (jnp.where(cols() >= rows(), AT, 0.0) * scale).astype(dt)  # Aqk^T

    def k_exp_g(j):  # k exp(G) = Rk exp(a_I) in place for w (Rk's last reads were the scores)
        rk = plgpu.load(k_s.at[j], layout=_W).astype(f32)
        k_s.at[j][...] = (rk * blocks(lambda I: anchor(NB + 2 + I, j))).astype(dt)

    halves(k_exp_g)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(a_o, out(a_ref))
    if pieces:  # k exp(G) for the backward (its kgam = beta k exp(G)), read from w's operand
        for j in range(KH):
            plgpu.copy_smem_to_gmem(k_s.at[j], out(kx_ref, slice(None), half(j)))

    phase("inverse")
    # (I + U)^{-1} = Ai^T, U = L^T strictly upper: diagonal blocks Dg = (I + Ud)^{-1}, then
    # I + U = (I + Ud)(I + Dg Uo) with N = Dg Uo block-nilpotent (N^4 = 0). Every matrix is held
    # as its four [C, SUB] column blocks (the scores' accumulators), so the products take only
    # the blocks that are not zero (see _mm_blocks).
    r_blk = lambda: lax.broadcast_in_dim(block_of(r1), (C, SUB), [0])  # noqa: E731 - each row's block
    c1b = plgpu.broadcasted_iota(jnp.int32, (SUB,), 0, layout=_W.reduce(0))
    r_in = lambda c: lax.broadcast_in_dim(r1 - c * SUB, (C, SUB), [0])  # noqa: E731 - row - first column
    c_in = lambda: lax.broadcast_in_dim(c1b, (C, SUB), [1])  # noqa: E731
    beta_b = lambda c: lax.broadcast_in_dim(plgpu.load(b_s.at[pl.ds(c * SUB, SUB)], layout=_W.reduce(0)),  # noqa: E731
                                            (C, SUB), [1])
    U = [jnp.where(c_in() > r_in(c), scores[NB + c] * beta_b(c), 0.0) for c in range(NB)]  # L^T
    Ud = [jnp.where(r_blk() == c, U[c], 0.0) for c in range(NB)]
    Uo = [jnp.where(r_blk() < c, U[c], 0.0) for c in range(NB)]
    mm = functools.partial(_mm_blocks, m_s=m32_s, dt=dt, a_s=a_s[0] if a_s else None)
    (P,) = mm([(Ud, Ud, DIAG)])

    def square(_, XP):  # X (I + P), P <- P^2: with P = Ud^2, Ud^4, Ud^8 (the last P^2 = Ud^16 = 0 unused:
        X, P = XP          # one loop body in the code costs less than a third product's own copy)
        XP, P = mm([(X, P, DIAG), (P, P, DIAG)])
        return [x + xp for x, xp in zip(X, XP)], P

    eye_minus_ud = [jnp.where(c_in() == r_in(c), 1.0, 0.0) - Ud[c] for c in range(NB)]
    Dg, _ = lax.fori_loop(0, 3, square, (eye_minus_ud, P))
    (N,) = mm([(Dg, Uo, DG_UO)])
    NDg, N2 = mm([(N, Dg, N_DG), (N, N, N_N)])
    Y = _blocks_op(operator.sub, Dg, NDg)
    (N2Y,) = mm([(N2, Y, N2_Y)])
    AiT = jnp.concatenate(_blocks_op(operator.add, Y, N2Y), axis=1)

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


def _smem16(shape, dtype):
    """SMEM tiles swizzled 32 bytes wide: any 16x16 bf16 block is one (8, 16)-tiled slice."""
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(SUB, dtype))


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
        _smem((KH, 2, C, HW), dt),  # g as hi + lo (half j's over g's half j), then D over them (g_s)
        half(2, dt),  # column operand of the scores, two buffers (the interpreter's; on a GPU it is in registers)
        (half(VH, dt), _smem((4, C, C), dt)),  # v -> u; split operands of the inverse, then Ai diag(beta), -w
        (half(KH, f32), plgpu.SMEM((C, HW), f32)),  # one half's D unswizzled (its rows read as vectors), in st_s's place
        (half(VH, dt), _smem16((4, C, C), dt)),  # m_s's memory as the inverse's 16x16-block operands
    )
    scratch = [
        half(KH, dt),  # q -> Rq -> qg
        half(KH, dt),  # k -> Rk -> k exp(G)
        half(KH, dt),  # Kl -> kg
        plgpu.SMEM((KH, 2 * NB + 2, HW), f32),  # anchors a_0..a_3, G_last, the decay exp(G_last), exp(a_0..a_3)
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

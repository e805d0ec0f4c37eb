"""Mosaic GPU kernel for the backward of the bounded decayed scores (g >= -5), and their VJP.

The scores of `chunk_intra.decayed_scores` for one chunk of C = 64 tokens and row operands a_x
(x = 0: scale q; x = 1: k for the delta rule):

    A_x[r, c] = sum_d a_x,r[d] k_c[d] exp(G_r[d] - G_c[d]),   r >= c.

Given their cotangents dA_x (zero above the diagonal), the gradients are

    da_x[r] = exp(G_r - G_{a(r)}) * sum_c dA_x[r, c] k_c exp(G_{a(r)} - G_c)        (row side)
    dk_c    = exp(G_{b(c)} - G_c) * sum_x sum_r dA_x[r, c] a_x,r exp(G_r - G_{b(c)}) (column side)
    dG      = sum_x a_x da_x - k dk_col

with a(r) the first row of r's 16-row tile and b(c) the last row of c's tile: every exponent of
the outer factors is <= 0, and the inner ones are <= 15 * 5 = 75 (the bounded-gate assumption).
The XLA pull-back of the dense scores materialises the per-tile anchored copies of k and a_x and
their gradients in float32 (about 4.5 copies of k each way); this kernel builds them in SMEM.

One program per (chunk, batch*head, 64 key channels, row operand x), 74 KiB of SMEM so three
can share an SM. Per tile i, one loop step, the anchored column operand Ka_i = k exp(a_i - G)
(zero past tile i) goes through wgmmas with N = 16: P_x^T[:, tile i] = Ka_i^T dA_x[tile i, :]^T;
and the anchored row operand Ab_x,i = a_x exp(G - b_i) (zero before tile i):
Q_x^T[:, tile i] = Ab_x,i^T dA_x^T[tile i, :]^T; each step's [K, 16] results go out by TMA. Both operands are split into bf16 hi + lo
parts and multiplied hi*hi + hi*lo + lo*hi against the cotangents' hi + lo parts (split by XLA),
about float32 accuracy, which the gate gradient needs. The tile anchors come from XLA too (no
cross-warp reductions in the kernel). The tiles are a loop, not unrolled copies: straight-line
code run once per program stalls on instruction fetch once it outgrows the instruction cache
(`mosaic_intra_bf16` says how that was measured). The kernel writes P_x^T and Q_x^T ([K, C] per
chunk, float32); `dense_scores`' VJP sums Q over x, applies the outer factors and forms dG in XLA,
where they fuse with the transposes back to the token layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.chunk_intra import TILE, decayed_scores, hi_lo
from kernels.kda.mosaic_intra import _split_store, per_block as _per_block
from kernels.kda.mosaic_state import C, _smem, flat_grid, grid_indices

KB = 64  # key channels per program
NB = C // TILE  # 16-row tiles per chunk
_W = plgpu.Layout.WGMMA


def _body(q_ref, k_ref, G_ref, an_ref, dA_ref, dAT_ref, p_ref, qc_ref, an_s, inputs, cots, out_s, bars, *, X, scale,
          dt, operands, grid):
    (a_s, k_s, G_s), (op_s, op2_s) = inputs  # the operands (each hi + lo) reuse the inputs' memory
    dAs_s, dATs_s = cots
    n, bh, kx = grid_indices(grid)
    kh, x = lax.div(kx, X), lax.rem(kx, X)
    ks = pl.ds(kh * KB, KB)
    srcs = [(k_ref.at[n, bh, :, ks], k_s), (G_ref.at[n, bh, :, ks], G_s), (an_ref.at[n, bh, :, ks], an_s)]
    srcs += [(ref.at[n, bh, x, part], dst.at[part]) for part in range(2) for ref, dst in ((dA_ref, dAs_s),
                                                                                       (dAT_ref, dATs_s))]
    for i, (src, dst) in enumerate(srcs):  # one 2D tile per copy
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    is_q = x == 0  # the row operand is scale q (x = 0) or k (x = 1, which needs no q)

    @pl.when(is_q)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[n, bh, :, ks], a_s, bars.at[len(srcs)])

    f32 = jnp.float32
    for i in range(len(srcs)):
        plgpu.barrier_wait(bars.at[i])

    @pl.when(is_q)
    def _():
        plgpu.barrier_wait(bars.at[len(srcs)])

    rows = plgpu.broadcasted_iota(jnp.int32, (C, KB), 0, layout=_W)
    # [KB]: G at tile i's first (i < NB) or tile i - NB's last row (i may be the loop index)
    vec = lambda i: plgpu.load(an_s.at[i], layout=_W.reduce(0))  # noqa: E731
    per_block = lambda fn: _per_block(rows.shape, fn, NB)  # noqa: E731 - [C, KB] rows of tile I: fn(I)

    G = plgpu.load(G_s, layout=_W)  # [C, KB]
    kf = plgpu.load(k_s, layout=_W).astype(f32)
    # The row operand a_x (a_s holds no data for x = 1: the select drops it).
    a = jnp.where(lax.broadcast_in_dim(is_q, (C, KB), ()), plgpu.load(a_s, layout=_W).astype(f32) * scale, kf)
    if operands == "factored":  # one [C, KB] exponential of each kind for all tiles, factors in [1, e^75]
        Ea = kf * jnp.exp(per_block(vec) - G)  # k_c exp(G_{a(c)} - G_c)
        Eb = a * jnp.exp(G - per_block(lambda I: vec(NB + I)))  # a_r exp(G_r - G_{b(r)})

    def tile_operands(i):
        """Tile i's (column operand, row operand) [C, KB]: "factored" from Ea, Eb times per-tile-block
        vector factors exp(a_i - a_J) <= 1 and exp(b_I - b_i) <= 1; "direct" each from one [C, KB]
        exponential, whose masked entries' exponents may overflow and the select drops."""
        if operands == "factored":
            fi, li = vec(i), vec(NB + i)
            return (Ea * per_block(lambda J: jnp.exp(jnp.minimum(fi - vec(J), 0.0)) * (J <= i).astype(f32)),
                    Eb * per_block(lambda I: jnp.exp(jnp.minimum(vec(NB + I) - li, 0.0)) * (I >= i).astype(f32)))
        row = lax.broadcast_in_dim(vec(i), (C, KB), [1])
        col = lax.broadcast_in_dim(vec(NB + i), (C, KB), [1])
        return (jnp.where(rows < (i + 1) * TILE, kf * jnp.exp(row - G), 0.0),
                jnp.where(rows >= i * TILE, a * jnp.exp(G - col), 0.0))

    def split_products(acc, op, cot, blk):
        """acc += op^T cot[blk]^T with both operands as hi + lo parts (three wgmmas)."""
        opT = (op.at[0].transpose((1, 0)), op.at[1].transpose((1, 0)))
        cotT = (cot.at[0].at[blk].transpose((1, 0)), cot.at[1].at[blk].transpose((1, 0)))
        plgpu.wgmma(acc, opT[0], cotT[0])
        plgpu.wgmma(acc, opT[0], cotT[1])
        plgpu.wgmma(acc, opT[1], cotT[0])

    def tile(i, carry):
        Ka, Ab = tile_operands(i)
        # (Pallas's barrier before each store: every warp's products of tile i - 1 are done.)
        _split_store(Ka, op_s.at[0], op_s.at[1], dt)  # row tile i: k_c exp(G_{a_i} - G_c), c up to its end
        _split_store(Ab, op2_s.at[0], op2_s.at[1], dt)  # column tile i: a_r exp(G_r - G_{b_i}), r from its start
        plgpu.commit_smem()
        blk = pl.ds(i * TILE, TILE)

        def products(acc_p, acc_q):
            split_products(acc_p, op_s, dAs_s, blk)
            split_products(acc_q, op2_s, dATs_s, blk)
            return acc_p[...], acc_q[...]

        P, Q = pl.run_scoped(products, plgpu.ACC((KB, TILE), f32), plgpu.ACC((KB, TILE), f32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile i - 1's results are read
        out_s.at[0][...] = P
        out_s.at[1][...] = Q
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s.at[0], p_ref.at[n, bh, x, ks, blk])
        plgpu.copy_smem_to_gmem(out_s.at[1], qc_ref.at[n, bh, x, ks, blk])
        return carry

    plgpu.commit_smem()  # every thread has read q, k and G before the operands reuse their SMEM
    lax.fori_loop(0, NB, tile, None)
    plgpu.wait_smem_to_gmem(0)


OPERANDS = ("factored", "direct")


def scores_bwd_kernel(q, k, G, anchors, dA, dAT, *, scale, interpret=False, operands="direct"):
    """The kernel's inner sums. q, k [N, BH, C, K] (bf16); G [N, BH, C, K] float32; anchors
    [N, BH, 2 NB, K] float32 (G at each tile's first row, then at each tile's last row); dA, dAT
    [N, BH, X, 2, C, C] bf16: dA_x (zero above the diagonal) and its transpose as hi + lo parts.
    Returns (P^T, Q^T), both [N, BH, X, K, C] float32: P_x[r] = sum_c dA_x[r, c] k_c
    exp(G_{a(r)} - G_c), Q_x[c] = sum_r dA_x[r, c] a_x,r exp(G_r - G_{b(c)}). One program per
    (chunk, batch*head, 64 channels, x). `operands` (OPERANDS): how the anchored operands are
    formed, "direct" (two [C, K] exponentials per tile, fewer instructions in all) or "factored"
    (two [C, K] exponentials, then per-tile vector factors). A tile's operands are built once the
    previous tile's products are done. On an H200 at 8,4096,16,128, with the tiles unrolled:
    direct 1.37 ms, factored 1.97 (benchmarks/results/kda-stages-h200-20261130T1528.json; building
    them while the products ran, in a second slot, was slower: 1.57 and 2.15)."""
    if operands not in OPERANDS:
        raise ValueError(f"operands={operands!r}; expected one of {OPERANDS}")
    N, BH, Cc, K = q.shape
    X = dA.shape[2]
    if Cc != C or K % KB or q.dtype != jnp.bfloat16 or X not in (1, 2) or dA.dtype != jnp.bfloat16:
        raise ValueError(f"scores_bwd_kernel needs C={C}, K a multiple of {KB}, bf16 q/k/dA and X in (1, 2); "
                         f"got C={Cc}, K={K}, {q.dtype}, {dA.dtype}, X={X}")
    dt = q.dtype
    f32 = jnp.float32
    # The inputs (read into registers first) and the anchored operands share memory.
    inputs = plgpu.RefUnion(
        (_smem((C, KB), dt), _smem((C, KB), dt), _smem((C, KB), f32)),  # q, k, G
        (_smem((2, C, KB), dt), _smem((2, C, KB), dt)),  # the anchored operands, hi + lo
    )
    cots = (_smem((2, C, C), dt), _smem((2, C, C), dt))  # dA_x, dA_x^T as hi + lo
    scratch = [plgpu.SMEM((2 * NB, KB), f32), inputs, cots, _smem((2, KB, TILE), f32),  # one tile's P^T, Q^T
               plgpu.Barrier(num_barriers=8)]
    out_type = (jax.ShapeDtypeStruct((N, BH, X, K, C), f32),) * 2
    grid = (N, BH, (K // KB) * X)
    body = functools.partial(_body, X=X, scale=float(scale), dt=dt, operands=operands, grid=grid)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        **flat_grid(grid),
        kernel_name="kda_scores_bwd",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, G, anchors, dA, dAT)


def supported(K: int, cd) -> bool:
    """Whether the kernel takes scores of K channels with compute dtype `cd`."""
    return K % KB == 0 and jnp.dtype(cd) == jnp.bfloat16


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def dense_scores(qf, kf, G, scale, delta, mm, interpret):
    """`chunk_intra.decayed_scores` of rows [scale q, k] (delta) or [scale q] on the bounded path,
    with this kernel as its backward. qf, kf [..., C, K] float32 holding bf16 values (the inputs
    upcast); G [..., C, K] float32 chunk-local cumsum; `mm` the off-diagonal product (operands in
    bf16). Returns the list of [..., C, C] scores, as `decayed_scores` does."""
    rows = [qf * scale, kf] if delta else [qf * scale]
    return decayed_scores(rows, kf, G, bounded=True, mm=mm, cd=jnp.bfloat16)


def _fwd(qf, kf, G, scale, delta, mm, interpret):
    # Residuals in bf16 (the values are bf16), not the float32 per-tile copies autodiff keeps.
    return dense_scores(qf, kf, G, scale, delta, mm, interpret), (qf.astype(jnp.bfloat16), kf.astype(jnp.bfloat16), G)


def _split(x):
    """float32 [..., C, C] -> bf16 [..., 2, C, C]: hi and lo parts (about 16 mantissa bits)."""
    return jnp.stack(hi_lo(x, jnp.bfloat16), axis=-3)


def tile_anchors(G):
    """G [..., C, K] -> [..., 2 NB, K]: G at each tile's first row, then at each tile's last row
    (the kernel's `anchors`)."""
    Gt = G.reshape(*G.shape[:-2], NB, TILE, G.shape[-1])
    return jnp.concatenate([Gt[..., 0, :], Gt[..., -1, :]], axis=-2)


def _bwd(scale, delta, mm, interpret, res, dAs):
    q, k, G = res
    *lead, _, K = G.shape
    flat = lambda x: x.reshape(lead[0], -1, *x.shape[len(lead):])  # [N, ..., C, K] -> [N, BH, C, K]
    dA = jnp.stack(dAs, axis=-3).astype(jnp.float32)  # [..., X, C, C]
    P, Q = scores_bwd_kernel(flat(q), flat(k), flat(G), flat(tile_anchors(G)), flat(_split(dA)),
                             flat(_split(jnp.swapaxes(dA, -1, -2))), scale=scale, interpret=interpret)
    P = jnp.swapaxes(P, -1, -2).reshape(*lead, len(dAs), C, K)
    Q = jnp.swapaxes(jnp.sum(Q, axis=2), -1, -2).reshape(*lead, C, K)
    Gt = G.reshape(*lead, NB, TILE, K)
    row_decay = jnp.exp(Gt - Gt[..., :1, :]).reshape(G.shape)  # exp(G_r - G_{a(r)})
    col_decay = jnp.exp(Gt[..., -1:, :] - Gt).reshape(G.shape)  # exp(G_{b(c)} - G_c)
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    da = P * row_decay[..., None, :, :]
    dk_col = Q * col_decay
    dq = scale * da[..., 0, :, :]
    dG = qf * dq - kf * dk_col
    dk = dk_col
    if delta:
        dk = dk + da[..., 1, :, :]
        dG = dG + kf * da[..., 1, :, :]
    return dq, dk, dG


dense_scores.defvjp(_fwd, _bwd)

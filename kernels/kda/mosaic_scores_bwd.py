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

One program per (chunk, batch*head, 64 key channels). Per row tile i, the anchored column
operand Ka_i = k exp(a_i - G) (zero past tile i) goes through one wgmma with N = 16:
P^T[:, tile i] += Ka_i^T dA_x[tile i, :]^T; per column tile j, the anchored row operand
Ab_x,j = a_x exp(G - b_j) (zero before tile j): Q^T[:, tile j] += Ab_x,j^T dA_x^T[tile j, :]^T.
Both operands are split into bf16 hi + lo parts and multiplied hi*hi + hi*lo + lo*hi (about
float32 accuracy, which the gate gradient needs). The kernel writes P^T and Q^T ([K, C] per chunk,
float32); `dense_scores`' VJP applies the outer factors and forms dG in XLA, where they fuse
with the transposes back to the token layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.chunk_intra import TILE, decayed_scores
from kernels.kda.mosaic_intra import _split_store
from kernels.kda.mosaic_state import C, _smem

KB = 64  # key channels per program
NB = C // TILE  # 16-row tiles per chunk
_W = plgpu.Layout.WGMMA


def _body(q_ref, k_ref, G_ref, dA_ref, dAT_ref, p_ref, qc_ref, *scratch, X, scale, dt):
    q_s, k_s, G_s, dAs_s, dATs_s, stage, bars = scratch
    (dA_f, dAT_f), (op_s, op2_s), out_s = stage
    n, bh, kh = lax.axis_index("n"), lax.axis_index("bh"), lax.axis_index("kh")
    ks = pl.ds(kh * KB, KB)
    srcs = ((q_ref.at[n, bh, :, ks], q_s), (k_ref.at[n, bh, :, ks], k_s), (G_ref.at[n, bh, :, ks], G_s))
    srcs += tuple((ref.at[n, bh, x], dst.at[x]) for x in range(X) for ref, dst in ((dA_ref, dA_f), (dAT_ref, dAT_f)))
    for i, (src, dst) in enumerate(srcs):  # one copy per tile: TMA strides at most 5 dimensions
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    f32 = jnp.float32

    # The cotangents as bf16 hi + lo tiles (their float32 staging is then free for the operands).
    for i in range(3, len(srcs)):
        plgpu.barrier_wait(bars.at[i])
    for x in range(X):
        _split_store(plgpu.load(dA_f.at[x], layout=_W), dAs_s.at[x, 0], dAs_s.at[x, 1], dt)
        _split_store(plgpu.load(dAT_f.at[x], layout=_W), dATs_s.at[x, 0], dATs_s.at[x, 1], dt)
    for i in range(3):
        plgpu.barrier_wait(bars.at[i])
    G = plgpu.load(G_s, layout=_W)  # [C, KB]
    rows = plgpu.broadcasted_iota(jnp.int32, (C, KB), 0, layout=_W)
    row_of = lambda r: jnp.sum(jnp.where(rows == r, G, 0.0), axis=0)  # [KB]: G at row r
    first = [row_of(TILE * i) for i in range(NB)]
    last = [row_of(TILE * i + TILE - 1) for i in range(NB)]

    def per_block(fn):
        """[C, KB] array whose rows in tile I hold the vector fn(I) (None: zeros)."""
        out = None
        for I in reversed(range(NB)):
            v = fn(I)
            v = jnp.zeros((C, KB), f32) if v is None else lax.broadcast_in_dim(v, (C, KB), [1])
            out = v if out is None else jnp.where(rows < (I + 1) * TILE, v, out)
        return out

    Ea = jnp.exp(per_block(lambda I: first[I]) - G)  # exp(G_{a(c)} - G_c), in [1, e^75]
    Eb = jnp.exp(G - per_block(lambda I: last[I]))  # exp(G_r - G_{b(r)}), in [1, e^75]
    kf = plgpu.load(k_s, layout=_W).astype(f32)
    a = [plgpu.load(q_s, layout=_W).astype(f32) * scale, kf][:X]
    plgpu.commit_smem()  # the split cotangents are visible to the tensor cores

    def split_products(acc, op, cot, blk):
        """acc[:, blk] += op^T cot[blk]^T with both operands as hi + lo parts (three wgmmas)."""
        opT = (op.at[0].transpose((1, 0)), op.at[1].transpose((1, 0)))
        cotT = (cot.at[0].at[blk].transpose((1, 0)), cot.at[1].at[blk].transpose((1, 0)))
        plgpu.wgmma(acc.at[:, blk], opT[0], cotT[0])
        plgpu.wgmma(acc.at[:, blk], opT[0], cotT[1])
        plgpu.wgmma(acc.at[:, blk], opT[1], cotT[0])

    def row_side(*accs):
        for i in range(NB):
            if i:
                plgpu.wgmma_wait(0)  # the previous tile's products have read op_s
            Ka = kf * Ea * per_block(lambda J: None if J > i else jnp.exp(first[i] - first[J]))
            _split_store(Ka, op_s.at[0], op_s.at[1], dt)
            plgpu.commit_smem()
            for x in range(X):
                split_products(accs[x], op_s, dAs_s.at[x], pl.ds(i * TILE, TILE))
        return tuple(acc[...] for acc in accs)

    def col_side(acc):
        for j in range(NB):
            if j:
                plgpu.wgmma_wait(0)
            fac = Eb * per_block(lambda I: None if I < j else jnp.exp(last[I] - last[j]))
            for x in range(X):
                _split_store(a[x] * fac, op2_s.at[x, 0], op2_s.at[x, 1], dt)
            plgpu.commit_smem()
            for x in range(X):
                split_products(acc, op2_s.at[x], dATs_s.at[x], pl.ds(j * TILE, TILE))
        return acc[...]

    P = pl.run_scoped(row_side, *[plgpu.ACC((KB, C), f32)] * X)
    Q = pl.run_scoped(col_side, plgpu.ACC((KB, C), f32))
    for x in range(X):
        out_s.at[x][...] = P[x]
    out_s.at[X][...] = Q
    plgpu.commit_smem()
    for x in range(X):
        plgpu.copy_smem_to_gmem(out_s.at[x], p_ref.at[n, bh, x, ks])
    plgpu.copy_smem_to_gmem(out_s.at[X], qc_ref.at[n, bh, ks])
    plgpu.wait_smem_to_gmem(0)


def scores_bwd_kernel(q, k, G, dA, dAT, *, scale, interpret=False):
    """The kernel's inner sums. q, k [N, BH, C, K] (bf16); G [N, BH, C, K] float32; dA, dAT
    [N, BH, X, C, C] float32 (dA_x and its transpose; zero above the diagonal).
    Returns (P^T [N, BH, X, K, C], Q^T [N, BH, K, C]) float32: P_x[r] = sum_c dA_x[r, c] k_c
    exp(G_{a(r)} - G_c), Q[c] = sum_x sum_r dA_x[r, c] a_x,r exp(G_r - G_{b(c)})."""
    N, BH, Cc, K = q.shape
    X = dA.shape[2]
    if Cc != C or K % KB or q.dtype != jnp.bfloat16 or X not in (1, 2):
        raise ValueError(f"scores_bwd_kernel needs C={C}, K a multiple of {KB}, bf16 q/k and X in (1, 2); "
                         f"got C={Cc}, K={K}, {q.dtype}, X={X}")
    dt = q.dtype
    f32 = jnp.float32
    stage = plgpu.RefUnion(
        (_smem((X, C, C), f32), _smem((X, C, C), f32)),  # the cotangents as loaded
        (_smem((2, C, KB), dt), _smem((X, 2, C, KB), dt)),  # the anchored operands, hi + lo
        _smem((X + 1, KB, C), f32),  # the results on their way out
    )
    scratch = [
        _smem((C, KB), dt),
        _smem((C, KB), dt),
        _smem((C, KB), f32),
        _smem((X, 2, C, C), dt),  # dA_x hi, lo
        _smem((X, 2, C, C), dt),  # dA_x^T hi, lo
        stage,
        plgpu.Barrier(num_barriers=3 + 2 * X),
    ]
    out_type = (jax.ShapeDtypeStruct((N, BH, X, K, C), f32), jax.ShapeDtypeStruct((N, BH, K, C), f32))
    body = functools.partial(_body, X=X, scale=float(scale), dt=dt)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(N, BH, K // KB),
        grid_names=("n", "bh", "kh"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, G, dA, dAT)


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


def _bwd(scale, delta, mm, interpret, res, dAs):
    q, k, G = res
    *lead, _, K = G.shape
    flat = lambda x: x.reshape(lead[0], -1, *x.shape[len(lead):])  # [N, ..., C, K] -> [N, BH, C, K]
    dA = jnp.stack(dAs, axis=-3).astype(jnp.float32)  # [..., X, C, C]
    P, Q = scores_bwd_kernel(flat(q), flat(k), flat(G), flat(dA), flat(jnp.swapaxes(dA, -1, -2)),
                             scale=scale, interpret=interpret)
    P = jnp.swapaxes(P, -1, -2).reshape(*lead, len(dAs), C, K)
    Q = jnp.swapaxes(Q, -1, -2).reshape(*lead, C, K)
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

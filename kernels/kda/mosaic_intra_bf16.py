"""Lean Mosaic GPU kernel for the intra-chunk stage of chunked KDA under a bounded gate (g >= -5).

Same outputs as `mosaic_intra.intra_bounded` (the operands of `mosaic_state.state_output`), with
bf16 operands where bf16 suffices (like flash-linear-attention's kernels) and a small footprint
(about 100 KiB of SMEM, so two programs share an SM and hide each other's latency):

  * Row side, once per chunk: with the anchor a_I = G at the first row of the row's 16-row block,
    Rq = q exp(G - a_I), Rk = k exp(G - a_I) (factors <= 1) and Kl = k exp(a_I - G) (factors
    <= exp(15 * 5) under the bound), in place of q and k in SMEM.
  * Scores, transposed, for row block I: column operand Kc = Kl scaled per column block J by the
    vector exp(a_I - a_J) (<= 1; zero for J > I), so no per-block exponential of the whole tile;
    Aqk^T[:, I] = scale Kc Rq_I^T and L^T[:, I] = Kc Rk_I^T diag(beta_I), each a 64x16 wgmma into a
    column slice of one accumulator (no row selection, a quarter of the full-tile products).
  * (I + L^T)^{-1} = Ai^T: the split-bf16 nilpotent products of `mosaic_intra` (about float32
    accuracy: the inverse amplifies rounding), then Ai diag(beta) as hi + lo bf16 for w and u.
  * qg, kg, k exp(G) by per-row-block vector factors from Rq, Kl, Rk in place.
  * With `cumsum`, the chunk-local cumsum of the gates too: G = Tri (g_hi + g_lo) on the tensor
    cores (Tri the lower-triangular ones), the anchors as masked column sums of G.

SMEM phases that never overlap in time (G, then the column operand, then the inverse's tiles,
then Ai diag(beta) and w) share one `plgpu.RefUnion`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.mosaic_intra import MAX_EXP, _mm_split, _rows_in, _split_store, per_block as _per_block
from kernels.kda.mosaic_state import C, _smem

SUB = 16
NB = C // SUB  # row blocks per chunk
_W = plgpu.Layout.WGMMA


def _body(q_ref, k_ref, v_ref, G_ref, b_ref, qg_ref, wn_ref, kg_ref, u_ref, a_ref, *rest, H, K, V, scale, dt, cumsum):
    d_ref, rest = (rest[0], rest[1:]) if cumsum else (None, rest)
    q_s, k_s, v_s, kl_s, an_s, b_s, a_o, union, bars = rest
    G_s, kc_s, m_s, (ab_s, wn_o) = union
    n = lax.axis_index("n")
    bh = lax.axis_index("bh")
    b, h = lax.div(bh, H), lax.rem(bh, H)
    rows_t = pl.ds(n * C, C)
    srcs = ((q_ref.at[b, rows_t, h], q_s), (k_ref.at[b, rows_t, h], k_s), (G_ref.at[b, rows_t, h], G_s),
            (b_ref.at[b, h, rows_t], b_s), (v_ref.at[b, rows_t, h], v_s))
    anchors = tuple(range(0, C, SUB)) + (C - 1,)
    if not cumsum:
        srcs += tuple((G_ref.at[b, n * C + r, h], an_s.at[i]) for i, r in enumerate(anchors))
    for i, (src, dst) in enumerate(srcs):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    f32 = jnp.float32
    rows_k = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=_W)
    vec = lambda i: plgpu.load(an_s.at[i], layout=_W.reduce(0))  # [K]

    per_block = lambda fn: _per_block(rows_k, fn, NB)  # noqa: E731 - [C, K] rows of block I: fn(I)

    for i in range(len(srcs)):
        if i != 4:  # v is needed only at the end
            plgpu.barrier_wait(bars.at[i])
    if cumsum:  # G_s holds g: G = Tri g on the tensor cores, g split hi + lo (about 16 mantissa bits)
        G = _chunk_cumsum(G_s, kc_s, a_o, K, dt)
        rows_g = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=_W)
        vecs = [jnp.sum(jnp.where(rows_g == r, G, 0.0), axis=0) for r in anchors]
        vec = lambda i: vecs[i]  # noqa: E731 - the anchors as [K] vectors
        an_s[...] = jnp.exp(vecs[NB])  # the chunk's state decay exp(G_last)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(an_s, d_ref.at[bh, n])
    else:
        G = plgpu.load(G_s, layout=_W)

    # Row side: Rq, Rk, Kl in place of q, k (G is dead afterwards).
    D = G - per_block(vec)  # G - a_I <= 0
    qf = plgpu.load(q_s, layout=_W).astype(f32)
    q_s[...] = (qf * jnp.exp(D)).astype(dt)
    kf = plgpu.load(k_s, layout=_W).astype(f32)
    k_s[...] = (kf * jnp.exp(D)).astype(dt)
    kl_s[...] = (kf * jnp.exp(jnp.minimum(-D, MAX_EXP))).astype(dt)
    plgpu.commit_smem()  # every thread has read G before the column operand reuses its memory

    def col_factor(I, J):
        """Column block J's factor for row block I: exp(a_I - a_J) <= 1, 1 on the diagonal, 0 above."""
        if J > I:
            return None
        return jnp.ones((K,), f32) if J == I else jnp.exp(vec(I) - vec(J))

    # Transposed scores, one row block I at a time: A^T[:, block I] = Kc_I Rq[block I]^T (wgmma
    # N = 16 into a column slice of one accumulator), Kc_I = Kl times per-column-block vectors,
    # written to alternating SMEM slots while the previous block's products run.
    Kl = plgpu.load(kl_s, layout=_W).astype(f32)

    def scores(acc_q, acc_k):
        for I in range(NB):
            slot = I % 2
            if I >= 2:
                plgpu.wgmma_wait(2)  # the products of block I - 2 (the last readers of this slot) are done
            kc_s.at[slot][...] = (Kl * per_block(functools.partial(col_factor, I))).astype(dt)
            plgpu.commit_smem()
            blk = pl.ds(I * SUB, SUB)
            plgpu.wgmma(acc_q.at[:, blk], kc_s.at[slot], q_s.at[blk].transpose((1, 0)))
            plgpu.wgmma(acc_k.at[:, blk], kc_s.at[slot], k_s.at[blk].transpose((1, 0)))
        return acc_q[...], acc_k[...]

    AT, LT = pl.run_scoped(scores, plgpu.ACC((C, C), f32), plgpu.ACC((C, C), f32))
    rows = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=_W)  # column c of the scores
    cols = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=_W)  # row r of the scores
    beta_r = lax.broadcast_in_dim(plgpu.load(b_s, layout=_W.reduce(0)), (C, C), [1])
    a_o[...] = (jnp.where(cols >= rows, AT, 0.0) * scale).astype(dt)  # Aqk^T
    U = jnp.where(cols > rows, LT * beta_r, 0.0)  # L^T

    # Elementwise outputs from the row-side tiles, in place (each tile's last use was the scores).
    g_last = vec(NB)
    rescale = lambda ref, fn: (plgpu.load(ref, layout=_W).astype(f32) * per_block(fn)).astype(dt)
    q_s[...] = rescale(q_s, lambda I: jnp.exp(vec(I)) * scale)  # qg = scale q exp(G)
    kl_s[...] = rescale(kl_s, lambda I: jnp.exp(g_last - vec(I)))  # kg = k exp(G_last - G)
    k_s[...] = rescale(k_s, lambda I: jnp.exp(vec(I)))  # k exp(G)
    plgpu.commit_smem()
    for src, dst in ((a_o, a_ref), (q_s, qg_ref), (kl_s, kg_ref)):
        plgpu.copy_smem_to_gmem(src, dst.at[bh, n])

    # (I + U)^{-1} = Ai^T: diagonal 16x16 blocks by a nilpotent product, then the block-nilpotent
    # rest: I + U = (I + Ud)(I + Dg Uo) with Dg = (I + Ud)^{-1}, and N = Dg Uo has N^4 = 0.
    diag = rows < 0
    for I in range(NB):
        diag = diag | (_rows_in(rows, I * SUB, (I + 1) * SUB) & _rows_in(cols, I * SUB, (I + 1) * SUB))
    eye = plgpu.layout_cast(jnp.where(rows == cols, 1.0, 0.0), _W)
    Ud = jnp.where(diag, U, 0.0)
    mm3 = functools.partial(_mm_split, m_s=m_s, dt=dt)
    P2 = mm3(Ud, Ud)
    X = mm3(eye - Ud, eye + P2)
    P4 = mm3(P2, P2)
    X = mm3(X, eye + P4)
    Dg = mm3(X, eye + mm3(P4, P4))
    N = mm3(Dg, U - Ud)
    AiT = mm3(mm3(eye - N, eye + mm3(N, N)), Dg)

    # w = (Ai diag beta)(k exp G), u = (Ai diag beta) v: the A operand is the transposed view of
    # diag(beta) Ai^T, stored as hi + lo bf16.
    beta_c = lax.broadcast_in_dim(plgpu.load(b_s, layout=_W.reduce(1)), (C, C), [0])
    _split_store(AiT * beta_c, ab_s.at[0], ab_s.at[1], dt)
    plgpu.commit_smem()
    plgpu.barrier_wait(bars.at[4])

    def wy(acc_w, acc_u):
        for ab in (ab_s.at[0], ab_s.at[1]):
            plgpu.wgmma(acc_w, ab.transpose((1, 0)), k_s)
            plgpu.wgmma(acc_u, ab.transpose((1, 0)), v_s)
        return acc_w[...], acc_u[...]

    w, u = pl.run_scoped(wy, plgpu.ACC((C, K), f32), plgpu.ACC((C, V), f32))
    wn_o[...] = (-w).astype(dt)
    v_s[...] = u.astype(dt)
    plgpu.commit_smem()
    for src, dst in ((wn_o, wn_ref), (v_s, u_ref)):
        plgpu.copy_smem_to_gmem(src, dst.at[bh, n])
    plgpu.wait_smem_to_gmem(0)


def _chunk_cumsum(g_s, parts_s, tri_s, K, dt):
    """Chunk-local cumsum G [C, K] (f32 registers) of the gate tile in g_s, as Tri (g_hi + g_lo)
    with Tri the lower-triangular ones: exact products, f32 accumulation; g is represented to
    about 2^-17 relative. parts_s (aliasing g_s) and tri_s are free SMEM tiles."""
    g = plgpu.load(g_s, layout=_W)
    plgpu.commit_smem()  # every thread has read g before parts_s, its alias, is written
    _split_store(g, parts_s.at[0], parts_s.at[1], dt)
    rows = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=_W)
    cols = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=_W)
    tri_s[...] = jnp.where(rows >= cols, 1.0, 0.0).astype(dt)
    plgpu.commit_smem()

    def prod(acc):
        plgpu.wgmma(acc, tri_s, parts_s.at[0])
        plgpu.wgmma(acc, tri_s, parts_s.at[1])
        return acc[...]

    return pl.run_scoped(prod, plgpu.ACC((C, K), jnp.float32))


def intra_bf16(q, k, v, G, beta_t, *, scale, interpret=False, cumsum=False):
    """Intra-chunk stage for bounded gates (every g >= -5), no segment resets.

    q, k [B, Tp, H, K] and v [B, Tp, H, V] (bf16, Tp a multiple of 64); G [B, Tp, H, K] f32
    chunk-local cumsum of g, or with `cumsum` the gate g itself (the kernel sums it, saving XLA a
    pass over the gates); beta_t [B, H, Tp] f32. Returns bf16 (qg, wn, kg [BH, NT, C, K],
    u [BH, NT, C, V], a^T [BH, NT, C, C]) for `mosaic_state.state_output(..., a_transposed=True)`,
    and with `cumsum` also the chunk decays d = exp(G_last) [BH, NT, K] f32.
    """
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    NT = Tp // C
    dt = q.dtype
    f32 = jnp.float32
    union = plgpu.RefUnion(
        _smem((C, K), f32),  # G (row side only; swizzled like every tile read into registers)
        _smem((2, C, K), dt),  # column operand of the scores, two slots
        _smem((4, C, C), dt),  # split-bf16 operands of the inverse
        (_smem((2, C, C), dt), _smem((C, K), dt)),  # Ai diag(beta) as hi + lo, -w
    )
    scratch = [
        _smem((C, K), dt),  # q -> Rq -> qg
        _smem((C, K), dt),  # k -> Rk -> k exp(G)
        _smem((C, V), dt),  # v -> u
        _smem((C, K), dt),  # Kl -> kg
        plgpu.SMEM((K,), f32) if cumsum else plgpu.SMEM((NB + 1, K), f32),  # d, or anchors a_0..a_3, G_last
        plgpu.SMEM((C,), f32),  # beta
        _smem((C, C), dt),  # a
        union,
        plgpu.Barrier(num_barriers=5 if cumsum else 5 + NB + 1),
    ]
    sds = lambda *s: jax.ShapeDtypeStruct((B * H, NT, *s), dt)
    out_type = (sds(C, K), sds(C, K), sds(C, K), sds(C, V), sds(C, C))
    if cumsum:
        out_type += (jax.ShapeDtypeStruct((B * H, NT, K), f32),)
    body = functools.partial(_body, H=H, K=K, V=V, scale=float(scale), dt=dt, cumsum=cumsum)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(NT, B * H),
        grid_names=("n", "bh"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, v, G, beta_t)

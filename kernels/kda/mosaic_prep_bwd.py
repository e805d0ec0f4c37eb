"""Mosaic GPU kernel for the pull-back of the intra-chunk pieces under a bounded gate (g >= -5).

`chunk_intra.prep` forms, per chunk of C = 64 tokens (G the chunk-local cumsum of g, G_L its last
row, no segment resets):

    qg = scale q exp(G)     kg = k exp(G_L - G)     decay = exp(G_L)     kgam = beta k exp(G)
    Aqk[r, c] = scale sum_d q_r k_c exp(G_r - G_c)  (r >= c)
    L[r, c]   = beta_r sum_d k_r k_c exp(G_r - G_c) (r > c)

Given the cotangents of those pieces this kernel forms dq, dk, dg and the kgam / L part of dbeta
in one pass per (chunk, head, 64 key channels); XLA's autodiff of `prep` moves about 20 GB
through HBM at 8,4096,16,128 for the same sums (the anchored float32 copies of the score
operands and their gradients, then the assembly). The scores' pull-back, with D = G - a_I
(a_I = G at the first row of r's 16-row block I, so -75 <= D <= 0):

    dq_r  = scale exp(D_r) sum_{J <= I} exp(a_I - a_J) Y_J[r],  Y_J = dA[:, J] Kl[J]
    X_r   =       exp(D_r) sum_{J <= I} exp(a_I - a_J) Z_J[r],  Z_J = dL[:, J] Kl[J]
    dk_c  = exp(-D_c) sum_{I >= J} exp(a_I - a_J) (dA[I, :]^T sRq[I] + dL[I, :]^T bRk[I])[c]

with Kl = k exp(-D) (<= e^75), sRq = scale q exp(D), bRk = beta k exp(D) (both <= 1). Each
block product is a wgmma with K = 16 (a 16-row slice of the operand, the cotangent's matching
16-row slice transposed as the A operand); the sums over blocks run as Horner steps, the
accumulator scaled by exp(a_J - a_{J-1}) between steps (one [64] exponential per step), so one
loop walks the row side up and the column side down with three accumulators. The operands are
split into bf16 hi + lo parts (about float32 accuracy, which the gate gradient needs: it is a
difference of the row and column terms); the cotangents arrive in bf16 (the "compute"
cotangents of `chunk.COTANGENTS`), exact there. Then, element by element,

    dq = Pq + scale exp(G) dqg
    dk = beta X + Pc + exp(G_L - G) dkg + beta exp(G) dkgam
    dG' = q dq + k (beta X - Pc + beta exp(G) dkgam),   E = k exp(G_L - G) dkg
    dbeta_part = sum_d k (X + exp(G) dkgam)
    dg = Upper dG' + StrictLower E + ddecay exp(G_L)

the reverse cumsum (and G_L's gradient, the sum of E) as two triangular 0/1 matrices times dG'
and E in three bf16 parts each (float32 accuracy: the ones are exact).

SMEM: about 98 KiB, so two programs share an SM (228 KiB): G (16 KiB), the four cotangent tiles
dA, dA^T, dL, dL^T (32; dqg, dkg, dkgam land there once the products are done, then two of E's
parts and the 0/1 matrices), the six split operands (48, which first hold q and k; after the
products the float32 stash of X and Pc, q and k again, then dG' and E's first part). dq, dk and
dg are staged in q, k and G's places (each thread overwrites the elements it read, in the same
layout). The 0/1 matrices are SMEM operands: as wgmma register operands they gave wrong sums on
an H100 (NaN in some rows of dg), against 32-byte and against 128-byte swizzled B tiles alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import profiling
from kernels.kda.mosaic_intra import per_block as _per_block, split_parts
from kernels.kda.mosaic_state import C, _smem, flat_grid, grid_indices
from kernels.lowering import lowered_once

SUB = 16
NB = C // SUB  # 16-row blocks per chunk
HW = 64  # key channels per program
_W = plgpu.Layout.WGMMA


def _narrow(shape, dt):
    """A bf16 SMEM tile swizzled at 32 bytes: wgmma's K steps are one swizzle wide, and the block
    products take 16-row slices (K = 16) of these tiles."""
    return plgpu.SMEM(shape, dt, transforms=(plgpu.TilingTransform((8, SUB)), plgpu.SwizzleTransform(32)))


def _three_parts(x, dt):
    """f32 x as hi + mid + lo in `dt` (about float32's 24 bits for bf16)."""
    hi = x.astype(dt)
    r = x - hi.astype(jnp.float32)
    mid = r.astype(dt)
    return hi, mid, (r - mid.astype(jnp.float32)).astype(dt)


def _body(q_ref, k_ref, G_ref, b_ref, dd_ref, dA_ref, dAT_ref, dL_ref, dLT_ref, dqg_ref, dkg_ref, dkgam_ref,
          dq_ref, dk_ref, dg_ref, db_ref, G_u, cots_u, ops_u, an_s, b_s, dd_s, db_s, bars, *, scale, dt, grid,
          interpret, heads, cumsum):
    # ops_u: the six split operands (bf16, narrow swizzle); Pq, X, Pc's float32 stash; q, k (and
    # then dq, dk) in the last 16 KiB, which the stash's first two tiles leave free.
    ops, stash, (_, qk_s), ops_w = ops_u
    cots, cots_w = cots_u
    G_s, G_plain = G_u  # G_plain: the same memory unswizzled, whose rows the anchors are read from
    phase = profiling.phases()
    phase("load")
    n, bh, j = grid_indices(grid)
    cs = pl.ds(j * HW, HW)
    f32 = jnp.float32
    if heads:  # q, k, G, dq, dk, dg in the inputs' [B, T, H, K] layout: rows n C .. n C + 63 of (b, h)
        b, h = lax.div(bh, heads), lax.rem(bh, heads)
        tile = lambda ref, r=pl.ds(n * C, C): ref.at[b, r, h, cs]  # noqa: E731
    else:
        tile = lambda ref, r=slice(None): ref.at[n, bh, r, cs]  # noqa: E731
    qk_loads = [(tile(q_ref), qk_s.at[0]), (tile(k_ref), qk_s.at[1])]
    loads = qk_loads + [(tile(G_ref), G_s), (b_ref.at[n, bh], b_s), (dd_ref.at[n, bh, cs], dd_s)]
    loads += [(ref.at[n, bh], cots.at[i]) for i, ref in enumerate((dA_ref, dAT_ref, dL_ref, dLT_ref))]
    row = lambda I: min(I * SUB, C - 1) + (n * C if heads else 0)  # noqa: E731 - block I's first row, the last
    if not cumsum:  # G_ref holds G: the anchors are its rows
        loads += [(tile(G_ref, row(I)), an_s.at[I]) for I in range(NB + 1)]
    for i, (src, dst) in enumerate(loads):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    for i in range(len(loads)):
        plgpu.barrier_wait(bars.at[i])
    late = len(loads)  # the epilogue's loads: dqg, dkg, dkgam, then q and k again

    r1 = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=_W.reduce(1))
    c1 = plgpu.broadcasted_iota(jnp.int32, (HW,), 0, layout=_W.reduce(0))
    block_of = lambda v: sum(jnp.where(v >= I * SUB, 1, 0) for I in range(1, NB))  # noqa: E731
    row_block = lambda: lax.broadcast_in_dim(block_of(r1), (C, HW), [0])  # noqa: E731
    # [HW]: G at block i's first row (i < NB) or at the last row (i = NB); i may be traced
    anchor = lambda i: plgpu.load(an_s.at[i], layout=_W.reduce(0))  # noqa: E731
    wide = lambda v: lax.broadcast_in_dim(v, (C, HW), [1])  # noqa: E731
    load = lambda ref: plgpu.load(ref, layout=_W).astype(f32)  # noqa: E731

    if cumsum:  # G_ref held g: G = Tri g and the anchors Sel g, g as three bf16 parts (about float32)
        _chunk_cumsum(G_s, G_plain, ops_w, an_s, dt, r1, c1)

    def local_decay():
        """D = G - a_I [C, HW] from G's tile and the block anchors."""
        return plgpu.load(G_s, layout=_W) - _per_block((C, HW), anchor, NB)

    phase("operands")
    # Kl = k exp(-D), sRq = scale q exp(D), bRk = beta k exp(D) as hi + lo parts, written over q
    # and k once every thread has read them.
    D = local_decay()
    q = plgpu.load(qk_s.at[0], layout=_W)
    k = plgpu.load(qk_s.at[1], layout=_W)
    plgpu.commit_smem()
    beta = lax.broadcast_in_dim(plgpu.load(b_s, layout=_W.reduce(1)), (C, HW), [0])
    kf = k.astype(f32)
    ops.at[0][...], ops.at[1][...] = split_parts(kf * jnp.exp(-D), dt)
    eD = jnp.exp(D)
    ops.at[2][...], ops.at[3][...] = split_parts((scale * q.astype(f32)) * eD, dt)
    ops.at[4][...], ops.at[5][...] = split_parts((beta * kf) * eD, dt)
    plgpu.commit_smem()

    phase("products")
    zero = plgpu.layout_cast(jnp.full((C, HW), 0.0, f32), _W)

    def step(t, accs):
        """Row block J = t up (dq and X accumulators), column block I = NB - 1 - t down (dk's)."""
        acc_q, acc_k, acc_c = accs
        J, I = t, NB - 1 - t
        # Horner factors: exp(a_J - a_{J-1}) on rows of blocks >= J, exp(a_{I+1} - a_I) on rows of
        # blocks <= I (1 at the first step, where the accumulators are still zero).
        up = wide(jnp.exp(anchor(J) - anchor(jnp.maximum(J - 1, 0))))
        down = wide(jnp.exp(anchor(jnp.minimum(I + 1, NB - 1)) - anchor(I)))
        rb = row_block()
        m_row = jnp.where(rb >= J, up, 1.0)
        m_col = jnp.where(rb <= I, down, 1.0)

        def issue(refs):
            aq, ak, ac = refs
            rj, ri = pl.ds(J * SUB, SUB), pl.ds(I * SUB, SUB)
            for part in range(2):  # Kl's hi, lo
                plgpu.wgmma(aq, cots.at[1, rj].transpose((1, 0)), ops.at[part, rj])  # dA[:, J] Kl[J]
                plgpu.wgmma(ak, cots.at[3, rj].transpose((1, 0)), ops.at[part, rj])  # dL[:, J] Kl[J]
            for part in range(2):
                plgpu.wgmma(ac, cots.at[0, ri].transpose((1, 0)), ops.at[2 + part, ri])  # dA[I]^T sRq[I]
                plgpu.wgmma(ac, cots.at[2, ri].transpose((1, 0)), ops.at[4 + part, ri])  # dL[I]^T bRk[I]

        scaled = (acc_q * m_row, acc_k * m_row, acc_c * m_col)
        if interpret:  # the interpreter does not run pl.run_state: the same sums from zeroed accumulators
            def fresh(*refs):
                issue(refs)
                return tuple(ref[...] for ref in refs)

            products = pl.run_scoped(fresh, *[plgpu.ACC((C, HW), f32)] * 3)
            return tuple(a + p for a, p in zip(scaled, products))
        # The scaled sums go in as the accumulators' initial values (no second set of registers).
        return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in scaled))

    acc_q, acc_k, acc_c = lax.fori_loop(0, NB, step, (zero, zero, zero))

    phase("epilogue")
    # The products are done with the cotangent tiles and the operands: dqg, dkg, dkgam land in the
    # first, q and k in the operands' last 16 KiB.
    plgpu.wgmma_wait(0)
    plgpu.commit_smem()
    srcs = [(ref.at[n, bh, :, cs], cots.at[i]) for i, ref in enumerate((dqg_ref, dkg_ref, dkgam_ref))]
    for i, (src, dst) in enumerate(srcs + qk_loads):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[late + i])
    # Few [C, HW] values live at once (each is 32 registers per thread): X and Pc stashed in
    # float32, read back where used.
    D = local_decay()
    stash.at[1][...] = jnp.exp(-D) * acc_c  # Pc
    eD = jnp.exp(D)
    stash.at[0][...] = eD * acc_k  # X
    Pq = (scale * eD) * acc_q
    G = plgpu.load(G_s, layout=_W)
    G_last = anchor(NB)
    eG = jnp.exp(G)
    eK = jnp.exp(wide(G_last) - G)
    for i in range(5):
        plgpu.barrier_wait(bars.at[late + i])
    dq = Pq + (scale * eG) * load(cots.at[0])
    dGp = load(qk_s.at[0]) * dq
    qk_s.at[0][...] = dq.astype(dt)  # each thread overwrites the elements it read
    gam = eG * load(cots.at[2])
    kg_part = eK * load(cots.at[1])
    k = load(qk_s.at[1])
    X = plgpu.load(stash.at[0], layout=_W)
    db_s[...] = jnp.sum(k * (X + gam), axis=1)
    beta = lax.broadcast_in_dim(plgpu.load(b_s, layout=_W.reduce(1)), (C, HW), [0])
    u = beta * (X + gam)
    Pc = plgpu.load(stash.at[1], layout=_W)
    qk_s.at[1][...] = (u + Pc + kg_part).astype(dt)  # dk
    dGp = dGp + k * (u - Pc)
    E = k * kg_part
    plgpu.commit_smem()  # every thread has read the stash and the cotangents: dG' and E go there
    plgpu.copy_smem_to_gmem(qk_s.at[0], tile(dq_ref))
    plgpu.copy_smem_to_gmem(qk_s.at[1], tile(dk_ref))
    plgpu.copy_smem_to_gmem(db_s, db_ref.at[n, bh, j])
    # 128-byte swizzled views of the same memory: the reverse cumsum's operands share one swizzle
    parts = (ops_w.at[0], ops_w.at[1], ops_w.at[2], ops_w.at[3], cots_w.at[0], cots_w.at[1])  # clear of dq, dk
    for ref, part in zip(parts, _three_parts(dGp, dt) + _three_parts(E, dt)):
        ref[...] = part

    phase("cumsum")
    # dg[t] = sum_{s >= t} dG'[s] + sum_{s < t} E[s] + ddecay exp(G_L): the 0/1 matrices exact in bf16,
    # from SMEM (the last two cotangent tiles; as register operands the sums came out wrong on an H100).
    rows = lax.broadcast_in_dim(r1, (C, C), [0])
    cols = lax.broadcast_in_dim(c1, (C, C), [1])
    upper, lower = cots_w.at[2], cots_w.at[3]
    upper[...] = jnp.where(cols >= rows, 1.0, 0.0).astype(dt)
    lower[...] = jnp.where(cols < rows, 1.0, 0.0).astype(dt)
    plgpu.commit_smem()

    def cumsum(acc):
        for i in range(3):
            plgpu.wgmma(acc, upper, parts[i])
            plgpu.wgmma(acc, lower, parts[3 + i])
        return acc[...]

    dg = pl.run_scoped(cumsum, plgpu.ACC((C, HW), f32))
    dd = plgpu.load(dd_s, layout=_W.reduce(0))
    G_s[...] = dg + wide(dd * jnp.exp(G_last))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(G_s, tile(dg_ref))
    plgpu.wait_smem_to_gmem(0)
    phase(None)


def _chunk_cumsum(G_s, G_plain, ops_w, an_s, dt, r1, c1):
    """g in G_s -> G = Tri g in G_s and the anchors (G at each 16-row block's first row, G_last) in
    an_s, on the tensor cores: g as hi + mid + lo bf16 in ops_w[0:3] (free before the operands are
    formed), the 0/1 matrix in ops_w[3], first Sel (row I < NB sums rows 0 .. 16 I, row NB all of
    them) through the unswizzled view of G's memory, whose rows can be read, then Tri (s <= t) into
    G's place. ptxas (deviceless, K = 128) reports 100 bytes of spills for the kernel with this
    phase, none without it (the Tri product alone already spills 96). r1, c1: the body's row and
    column index vectors."""
    f32 = jnp.float32
    rows, cols = lax.broadcast_in_dim(r1, (C, C), [0]), lax.broadcast_in_dim(c1, (C, C), [1])
    for i, part in enumerate(_three_parts(plgpu.load(G_s, layout=_W), dt)):
        ops_w.at[i][...] = part

    def product(acc):
        for i in range(3):
            plgpu.wgmma(acc, ops_w.at[3], ops_w.at[i])
        return acc[...]

    ops_w.at[3][...] = jnp.where(((rows < NB) & (cols <= rows * SUB)) | (rows == NB), 1.0, 0.0).astype(dt)
    plgpu.commit_smem()
    G_plain[...] = pl.run_scoped(product, plgpu.ACC((C, HW), f32))
    plgpu.commit_smem()
    for i in range(NB + 1):
        an_s.at[i][...] = plgpu.load(G_plain.at[i], layout=_W.reduce(0))
    ops_w.at[3][...] = jnp.where(cols <= rows, 1.0, 0.0).astype(dt)
    plgpu.commit_smem()  # the anchors read before G overwrites their rows; Tri in place of Sel
    G_s[...] = pl.run_scoped(product, plgpu.ACC((C, HW), f32))
    plgpu.commit_smem()


def supported(K: int, cd) -> str | None:
    """Why the kernel cannot take K key channels in compute dtype `cd` (None when it can)."""
    if K % HW:
        return f"K={K} is not a multiple of {HW}"
    if jnp.dtype(cd) != jnp.bfloat16:
        return f"the kernel takes bf16 operands, not {jnp.dtype(cd).name}"
    return None


def prep_bwd(q, k, G, beta, ddecay, dAqk, dL, dqg, dkg, dkgam, *, scale, interpret=False, heads=None, dLT=None,
             dAT=None, cumsum=False):
    """The pull-back of `chunk_intra.prep`'s pieces on the bounded path (no segment resets),
    except bv's (dv = beta dbv and its dbeta term are the caller's).

    q, k [N, BH, C, K] bf16; G [N, BH, C, K] float32 chunk-local cumsum of the gates; beta
    [N, BH, C] float32; ddecay [N, BH, K] float32; dAqk, dL [N, BH, C, C] (masked here to r >= c and
    r > c; rounded to bf16); dqg, dkg, dkgam [N, BH, C, K] (rounded to bf16). Returns dq, dk
    [N, BH, C, K] bf16, dg [N, BH, C, K] float32, dbeta [N, BH, C] float32 (kgam's and L's terms).
    With `heads` = H: q, k, G and dq, dk, dg are [B, N C, H, K] instead (the inputs' layout, BH =
    B H): the caller's chunking transposes then cancel against its un-chunking ones. With `dLT`
    [N, BH, C, C]: dL comes masked already and dLT is its transpose (as `mosaic_wy_bwd` writes
    them), taken as they are; likewise `dAT` for dAqk (masked to r >= c). With `cumsum`: G holds
    the gates g themselves and the kernel forms
    their chunk-local cumsum (no XLA pass over g writing G).
    """
    if heads:
        B, Tp, H, K = q.shape
        N, BH, Cc = Tp // C, B * H, C
        if H != heads or Tp % C or beta.shape[:2] != (N, BH):
            raise ValueError(f"prep_bwd(heads={heads}): q {q.shape} is not [B, N * {C}, {heads}, K] for beta "
                             f"{beta.shape} [N, B * H, C]")
    else:
        N, BH, Cc, K = q.shape
    reason = supported(K, q.dtype)
    if Cc != C or reason:
        raise ValueError(f"prep_bwd takes chunks of {C} tokens and K a multiple of {HW} in bf16; got C={Cc}: "
                         f"{reason}")
    bf = jnp.bfloat16
    cast = lambda x: x.astype(bf)  # noqa: E731

    def with_transpose(x, xT, name, diagonal):
        """(x, x^T) as the kernel takes them: given (masked already), or masked here (r >= c with the
        diagonal, else r > c) and transposed."""
        if xT is not None:
            if xT.shape != x.shape:
                raise ValueError(f"prep_bwd: {name}T has shape {xT.shape}; expected {name}'s {x.shape}")
            return cast(x), cast(xT)
        r = jnp.arange(C)
        keep = r[:, None] >= r[None, :] if diagonal else r[:, None] > r[None, :]
        xm = cast(jnp.where(keep, x, 0))
        return xm, jnp.swapaxes(xm, -1, -2)

    dA, dAT = with_transpose(dAqk, dAT, "dA", diagonal=True)
    dL, dLT = with_transpose(dL, dLT, "dL", diagonal=False)
    dq, dk, dg, db = _prep_bwd(q.astype(bf), k.astype(bf), G.astype(jnp.float32), beta.astype(jnp.float32),
                               ddecay.astype(jnp.float32), dA, dAT, dL, dLT, cast(dqg), cast(dkg),
                               cast(dkgam), scale=float(scale), interpret=bool(interpret), heads=heads,
                               cumsum=bool(cumsum))
    return dq, dk, dg, jnp.sum(db, axis=2)


@lowered_once("scale", "interpret", "heads", "cumsum")
def _prep_bwd(q, k, G, beta, ddecay, dA, dAT, dL, dLT, dqg, dkg, dkgam, *, scale, interpret, heads=None,
              cumsum=False):
    N, BH = beta.shape[:2]
    K = q.shape[-1]
    KH = K // HW
    dt = q.dtype
    f32 = jnp.float32
    tile = lambda n, dtype: _smem((n, C, HW), dtype)  # noqa: E731
    scratch = [
        plgpu.RefUnion(_smem((C, HW), f32), plgpu.SMEM((C, HW), f32)),  # (g ->) G -> dg; unswizzled view
        plgpu.RefUnion(_narrow((4, C, HW), dt), tile(4, dt)),  # dA, dA^T, dL, dL^T -> dqg, dkg, dkgam -> E parts
        plgpu.RefUnion(_narrow((6, C, HW), dt),  # Kl, sRq, bRk as hi + lo
                       _smem((3, C, HW), f32),  # the stash (Pq's tile unused)
                       (_smem((2, C, HW), f32), tile(2, dt)),  # q, k -> dq, dk in the last 16 KiB
                       tile(6, dt)),  # dG', E parts (first four tiles)
        plgpu.SMEM((NB + 1, HW), f32),  # the block anchors, G_last
        plgpu.SMEM((C,), f32),  # beta
        plgpu.SMEM((HW,), f32),  # ddecay
        plgpu.SMEM((C,), f32),  # dbeta
        plgpu.Barrier(num_barriers=9 + NB + 1 + 5),
    ]
    grid = (N, BH, KH)
    sds = lambda dtype, *s: jax.ShapeDtypeStruct((N, BH, *s), dtype)  # noqa: E731
    tiles = (lambda dtype: jax.ShapeDtypeStruct(q.shape, dtype)) if heads else (lambda dtype: sds(dtype, C, K))  # noqa: E731
    out_type = (tiles(dt), tiles(dt), tiles(f32), sds(f32, KH, C))
    body = functools.partial(_body, scale=scale, dt=dt, grid=grid, interpret=interpret, heads=heads, cumsum=cumsum)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        **flat_grid(grid),
        kernel_name="kda_prep_bwd",
        compiler_params=profiling.compiler_params(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, G, beta, ddecay, dA, dAT, dL, dLT, dqg, dkg, dkgam)

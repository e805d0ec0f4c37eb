"""Decayed intra-chunk scores over the lower tile pairs only, with a hand-written VJP.

For row operands a_x (x = 0: scale q; x = 1: k for the delta rule) and one chunk of C = 64 tokens
in nt = 4 tiles of 16, with G the chunk-local cumsum of g <= 0:

    A[x, r, c] = sum_d a_x,r[d] k_c[d] exp(G_r[d] - G_c[d]),   r >= c.

Off-diagonal tile pairs (row tile i > column tile j) use the anchor of row tile i, its first row
a_i = 16 i:  exp(G_r - G_c) = exp(G_r - G_{a_i}) exp(G_{a_i} - G_c), both factors <= 1. Row tile
i's operand is a_r exp(G_r - G_{a_i}) (one copy of each row input) and its column operand is
k_c exp(G_{a_i} - G_c) for the 16 i columns before the tile (16 + 32 + 48 columns: 1.5 copies of
k, not a masked copy per row tile). Both are built in the compute dtype (bf16 for bf16 inputs);
an underflowing factor means an even smaller true term. Upper tile pairs are never formed.

Diagonal tiles (c in r's tile) stay in the state dtype, as in `chunk_intra.decayed_scores`: pair
by pair for any g <= 0 (exact for g = -1000), or with the same anchor as one HIGHEST-precision
matmul per tile when g >= -5 (`bounded`: exp(G_a - G_c) <= e^75 fits float32).

The VJP recomputes every factor from (q, k, G), so nothing larger than the inputs is stored. Its
gate gradient is the one of the anchored form (d/dG_r of exp(G_r - G_c) is +e, d/dG_c is -e, and
the anchor's terms are their negated sums): with bf16 operands, the plain identity
dG = sum_x a_x da_x - k dk_col is 25% less accurate in dg, whose reverse cumsum carries each
pair's rounding error to every earlier token of the chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.kda.chunk_intra import TILE, pair_decay, diag_product



def _rows(q, k, scale, delta):
    """[..., C, K] each -> [..., X, C, K] row operands (scale q, and k for the delta rule)."""
    return jnp.stack([q * scale, k], axis=-3) if delta else (q * scale)[..., None, :, :]


def _factors(rows, k, G, cd):
    """Shared pieces: rows, k, G in the state dtype. Returns (row decay exp(G_r - G_a)
    [..., nt, T, K], anchors G_a [..., nt, 1, K], row operands in `cd` [..., X, nt, T, K], the
    column operand of row tile i in `cd` [..., 16 i, K] for i = 1 .. nt - 1)."""
    *lead, C, K = G.shape
    nt = C // TILE
    Gt = G.reshape(*lead, nt, TILE, K)
    Ga = Gt[..., :1, :]
    rd = jnp.exp(Gt - Ga)
    at = rows.reshape(*rows.shape[:-2], nt, TILE, K)
    a_hat = (at * rd[..., None, :, :, :]).astype(cd)
    cols = [(k[..., : TILE * i, :] * jnp.exp(Ga[..., i, :, :] - G[..., : TILE * i, :])).astype(cd) for i in range(1, nt)]
    return Gt, Ga, rd, at, a_hat, cols


def _diag(at, kt, Gt, bounded, cd):
    """Diagonal tiles in the state dtype: at [..., X, nt, T, K]; kt, Gt [..., nt, T, K] ->
    [..., X, nt, T, T] (entries r < c are finite and meaningless)."""
    if bounded:
        Ga = Gt[..., :1, :]
        a_hat = at * jnp.exp(Gt - Ga)[..., None, :, :, :]
        return diag_product("...xird,...icd->...xirc", a_hat, kt * jnp.exp(Ga - Gt), cd)
    return jnp.sum(at[..., :, None, :] * (kt[..., None, :, :] * pair_decay(Gt))[..., None, :, :, :, :], axis=-1)


def _diag_bwd(at, kt, Gt, dD, bounded, cd):
    """Gradients of `_diag` for the cotangent dD [..., X, nt, T, T] (zero where r < c): w.r.t.
    the anchored rows a_hat = at exp(G_r - G_a) ([..., X, nt, T, K]) on the bounded path or at
    itself on the exact path (`row_anchored`), w.r.t. kt, and w.r.t. Gt with the anchor terms."""
    if bounded:
        Ga = Gt[..., :1, :]
        a_hat = at * jnp.exp(Gt - Ga)[..., None, :, :, :]
        kt_hat = kt * jnp.exp(Ga - Gt)
        d_ahat = diag_product("...xirc,...icd->...xird", dD, kt_hat, cd)
        # r >= c: a_hat_r <= exp(G_c - G_a), so dkt_hat * exp(G_a - G_c) stays bounded.
        dkt_hat = diag_product("...xirc,...xird->...icd", dD, a_hat, cd)
        p = jnp.sum(a_hat * d_ahat, axis=-4) - kt_hat * dkt_hat  # [..., nt, T, K]
        dG = p - jnp.sum(p, axis=-2, keepdims=True) * (jnp.arange(Gt.shape[-2]) == 0)[:, None]
        return d_ahat, dkt_hat * jnp.exp(Ga - Gt), dG
    p = dD[..., None] * pair_decay(Gt)[..., None, :, :, :, :]  # [..., X, nt, r, c, K]
    d_at = jnp.sum(p * kt[..., None, :, None, :, :], axis=-2)
    d_kt = jnp.sum(p * at[..., :, :, :, None, :], axis=(-5, -3))
    # float32 pair products: the identity form (no anchor) is as accurate and forms no third product.
    return d_at, d_kt, jnp.sum(at * d_at, axis=-4) - kt * d_kt


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def tiled_scores(q, k, G, scale, delta, bounded, cd, prec):
    """q, k, G [..., C, K] in the state dtype -> A [..., X, C, C] in the state dtype, X = 2 for
    the delta rule (rows scale q, then k) else 1. Entries r < c are zero or meaningless (callers
    mask them). Off-diagonal products take operands in `cd` with state-dtype accumulation at
    `prec`."""
    *lead, C, K = G.shape
    nt = C // TILE
    rows = _rows(q, k, scale, delta)
    X = rows.shape[-3]
    Gt, _, _, at, a_hat, cols = _factors(rows, k, G, cd)
    D = _diag(at, k.reshape(*lead, nt, TILE, K), Gt, bounded, cd)
    out = []
    for i in range(nt):
        parts = [D[..., i, :, :]]
        if i:
            parts.insert(0, jnp.einsum("...xrd,...cd->...xrc", a_hat[..., i, :, :], cols[i - 1],
                                       preferred_element_type=G.dtype, precision=prec))
        if i < nt - 1:
            parts.append(jnp.zeros((*lead, X, TILE, C - TILE * (i + 1)), G.dtype))
        out.append(jnp.concatenate(parts, axis=-1))
    return jnp.concatenate(out, axis=-2)


def _fwd(q, k, G, scale, delta, bounded, cd, prec):
    return tiled_scores(q, k, G, scale, delta, bounded, cd, prec), (q, k, G)


def _bwd(scale, delta, bounded, cd, prec, res, dA):
    q, k, G = res
    *lead, C, K = G.shape
    nt = C // TILE
    sdt = G.dtype
    rows = _rows(q, k, scale, delta)
    Gt, Ga, rd, at, a_hat, cols = _factors(rows, k, G, cd)
    kt = k.reshape(*lead, nt, TILE, K)
    a32 = at * rd[..., None, :, :, :]
    dAt = dA.reshape(*dA.shape[:-2], nt, TILE, C)
    tri = jnp.arange(TILE)[:, None] >= jnp.arange(TILE)[None, :]
    dD = jnp.stack([dAt[..., i, :, TILE * i : TILE * (i + 1)] for i in range(nt)], axis=-3)
    d_diag, dk_diag, dG_diag = _diag_bwd(at, kt, Gt, jnp.where(tri, dD, 0), bounded, cd)
    mm = functools.partial(jnp.einsum, preferred_element_type=sdt, precision=prec)
    # Off-diagonal pairs. The gate gradient keeps the anchored form (terms at r and c, their
    # negated sums at the anchor), so each pair's rounding errors cancel in dg = reverse cumsum
    # of dG above the pair's columns instead of reaching every earlier token of the chunk.
    d_ahat = [jnp.zeros_like(a32[..., 0, :, :])]  # row tile 0 has no off-diagonal pairs
    dk, dG_col, anchor = [], [], []
    for i in range(1, nt):
        n = TILE * i
        dAi = dAt[..., i, :, :n].astype(cd)  # [..., X, T, n]
        d_ahat.append(mm("...xrc,...cd->...xrd", dAi, cols[i - 1]))
        e = jnp.exp(Ga[..., i, :, :] - G[..., :n, :])
        dcol = mm("...xrc,...xrd->...cd", dAi, a_hat[..., i, :, :]) * e  # d/dk_c, c < 16 i
        qc = k[..., :n, :] * dcol
        pad = [(0, 0)] * len(lead) + [(0, C - n), (0, 0)]
        dk.append(jnp.pad(dcol, pad))
        dG_col.append(jnp.pad(qc, pad))
        anchor.append(jnp.sum(qc, axis=-2))
    d_off = jnp.stack(d_ahat, axis=-3)  # [..., X, nt, T, K]
    p_off = jnp.sum(a32 * d_off, axis=-4)  # [..., nt, T, K]
    first = (jnp.arange(TILE) == 0)[:, None]
    anchors = jnp.stack([jnp.zeros_like(anchor[0])] + anchor, axis=-2)[..., None, :]  # [..., nt, 1, K]
    dG_rows = p_off + first * (anchors - jnp.sum(p_off, axis=-2, keepdims=True))
    dG = (dG_rows + dG_diag).reshape(*lead, C, K) - sum(dG_col)
    if bounded:  # d_diag is w.r.t. the anchored rows, like d_off
        d_rows = (d_off + d_diag) * rd[..., None, :, :, :]
    else:
        d_rows = d_off * rd[..., None, :, :, :] + d_diag
    d_rows = d_rows.reshape(rows.shape)
    dk = dk_diag.reshape(*lead, C, K) + sum(dk)
    dq = d_rows[..., 0, :, :] * scale
    dk_total = dk + d_rows[..., 1, :, :] if delta else dk
    return dq.astype(q.dtype), dk_total.astype(k.dtype), dG.astype(sdt)


tiled_scores.defvjp(_fwd, _bwd)

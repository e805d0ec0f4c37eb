"""In-kernel building blocks of the TPU KDA kernels: matmuls, decayed intra-chunk products, the
unit-lower-triangular inverse. They operate on values (already loaded from VMEM refs).

Per-channel decay sits inside the sum over K, so it cannot be applied after a Q K^T matmul. The
chunk is cut into 16-row sub-blocks. Off-diagonal sub-blocks factor exp(G_r - G_c) around an
anchor row between c and r into two factors with exponents <= 0 and go to the MXU; the 16x16
diagonal sub-blocks are evaluated elementwise (exponents <= 0 too). Every exponent that reaches
exp is therefore <= 0: exact, and no overflow for any gate (g = -1000 included).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

SUB = 16
F32 = jnp.float32
NN = (((1,), (0,)), ((), ()))  # a @ b
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def mm(a, b, dims=NN, cd=F32):
    """MXU product with operands in the compute dtype `cd` and float32 accumulation (full f32
    passes when cd is float32)."""
    prec = jax.lax.Precision.HIGHEST if cd == F32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a.astype(cd), b.astype(cd), dims, precision=prec, preferred_element_type=F32)


def iota(shape, axis, offset=0):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis) + offset


def _pick_col(X, c):
    """Column c of X [R, C] as [R, 1] (a masked lane reduction: no lane slicing)."""
    return jnp.sum(jnp.where(iota(X.shape, 1) == c, X, 0.0), axis=1, keepdims=True)


def decayed_scores(a, b, G, rows, cd, *, strict: bool, bounded: bool = False):
    """[C, C] f32: S[r, c] = sum_d a[r, d] b[c, d] exp(G[r, d] - G[c, d]) for c <= r (c < r if
    strict), zero above. a, b, G: [C, K] float32; G non-increasing down the rows. `rows(c)` gives
    (b[c], G[c]) as [1, K] for a traced c (a dynamic single-row VMEM load). `bounded`: see
    `BOUNDED_MIN_G`; each 16-row block is then one matmul around its middle row."""
    C = a.shape[0]
    col = iota((SUB, C), 1)
    blocks = []
    for i in range(C // SUB):
        r0 = i * SUB
        ai, Gi = a[r0 : r0 + SUB], G[r0 : r0 + SUB]
        row = iota((SUB, 1), 0, r0)
        if bounded:
            s = _bounded_product(ai, Gi, b, G, rows, r0, cd, transposed=False, dims=NT)
            blocks.append(jnp.where(row > col if strict else row >= col, s, 0.0))
            continue
        out = jnp.zeros((SUB, C), F32)
        if i:  # columns c < r0, anchored at row r0
            Gn = rows(r0)[1]
            off = mm(ai * jnp.exp(Gi - Gn), b * jnp.exp(jnp.minimum(Gn - G, 0.0)), NT, cd)
            out = jnp.where(col < r0, off, 0.0)

        def diag(j, out, ai=ai, Gi=Gi, row=row, r0=r0):
            c = r0 + j
            bc, Gc = rows(c)
            s = jnp.sum(ai * bc * jnp.exp(jnp.minimum(Gi - Gc, 0.0)), axis=1, keepdims=True)
            s = jnp.where(row > c if strict else row >= c, s, 0.0)
            return out + jnp.where(col == c, s, 0.0)

        out = jax.lax.fori_loop(0, SUB, diag, out)
        blocks.append(out)
    return jnp.concatenate(blocks, axis=0)


def decayed_apply(X, b, G, rows, cd, *, transposed: bool, bounded: bool = False):
    """[C, K] f32, the products that back-propagate through `decayed_scores`.

    transposed=False (X lower triangular): out[r] = sum_{c<=r} X[r, c] b[c] * exp(G[r] - G[c]),
        anchored at the first row of each 16-row block of r.
    transposed=True (X = Y^T, upper triangular): out[c] = sum_{r>=c} X[c, r] b[r] * exp(G[r] - G[c]),
        anchored at the last row of each 16-row block of c.
    `rows(c)` gives (b[c], G[c]) as [1, K] for a traced c; `bounded` as in `decayed_scores`.
    """
    C = X.shape[0]
    nblk = C // SUB
    col = iota((SUB, C), 1)
    blocks = []
    for i in range(nblk):
        r0 = i * SUB
        Xi, Gi = X[r0 : r0 + SUB], G[r0 : r0 + SUB]
        if bounded:
            blocks.append(_bounded_product(Xi, Gi, b, G, rows, r0, cd, transposed=transposed, dims=NN))
            continue
        acc = jnp.zeros((SUB, b.shape[1]), F32)
        if not transposed and i:
            Gn = rows(r0)[1]
            far = mm(jnp.where(col < r0, Xi, 0.0), b * jnp.exp(jnp.minimum(Gn - G, 0.0)), NN, cd)
            acc = jnp.exp(Gi - Gn) * far
        if transposed and i < nblk - 1:
            a = r0 + SUB - 1
            Ga = rows(a)[1]
            far = mm(jnp.where(col > a, Xi, 0.0), b * jnp.exp(jnp.minimum(G - Ga, 0.0)), NN, cd)
            acc = jnp.exp(Ga - Gi) * far

        def diag(j, acc, Xi=Xi, Gi=Gi, r0=r0):
            c = r0 + j
            bc, Gc = rows(c)
            delta = Gc - Gi if transposed else Gi - Gc
            return acc + _pick_col(Xi, c) * bc * jnp.exp(jnp.minimum(delta, 0.0))

        blocks.append(jax.lax.fori_loop(0, SUB, diag, acc))
    return jnp.concatenate(blocks, axis=0)


# The all-MXU path needs g >= BOUNDED_MIN_G: anchored at the middle row m of a 16-row block,
# |G_r - G_m| <= 8 * 5 = 40 inside the block, so every factor stays below e^40 (and
# BOUNDED_CLAMP keeps masked-out entries finite: 0 * inf would be NaN inside a matmul).
BOUNDED_MIN_G = -5.0
BOUNDED_CLAMP = 64.0


def _bounded_product(Xi, Gi, b, G, rows, r0, cd, *, transposed, dims):
    """One 16-row block as a single matmul around its middle row m (g >= BOUNDED_MIN_G).

    transposed=False: exp(G_i - G_m) * (Xi . (b exp(G_m - G)) over rows c < r0 + 16);
    transposed=True:  exp(G_m - G_i) * (Xi . (b exp(G - G_m)) over rows r >= r0).
    """
    C = G.shape[0]
    Gm = rows(r0 + SUB // 2)[1]
    idx = iota((C, 1), 0)
    if transposed:
        keep, inner, outer = idx >= r0, G - Gm, Gm - Gi
    else:
        keep, inner, outer = idx < r0 + SUB, Gm - G, Gi - Gm
    bh = jnp.where(keep, b * jnp.exp(jnp.minimum(inner, BOUNDED_CLAMP)), 0.0)
    if dims == NT:  # scores: the outer factor goes on the row operand before the product
        return mm(Xi * jnp.exp(outer), bh, NT, cd)
    return jnp.exp(outer) * mm(Xi, bh, NN, cd)


def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L [C, C] (C a power of 2), in float32 on the MXU.

    With N = -L nilpotent (N^C = 0): sum_k N^k = (I + N)(I + N^2)(I + N^4)...(I + N^(C/2)),
    2 log2(C) - 2 matmuls instead of C dependent row substitutions.
    """
    C = L.shape[0]
    eye = jnp.where(iota((C, C), 0) == iota((C, C), 1), 1.0, 0.0).astype(F32)
    N = -L
    P = eye + N
    for _ in range(int(math.log2(C)) - 1):
        N = mm(N, N)
        P = P + mm(P, N)
    return P

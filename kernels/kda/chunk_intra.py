"""Intra-chunk pieces of the chunked delta rule, batched over every chunk at once.

Chunked arrays are `[N, B, H, C, D]` (chunk index first, so `lax.scan` slices it for free), with
C = 64 tokens per chunk and 16-token sub-chunks (tiles). `G` is the chunk-local inclusive cumsum of
the log-decay g <= 0, so G is non-increasing inside a chunk.

Stability: the decay between tokens r >= c, exp(G_r - G_c), is never formed by dividing out a whole
chunk's decay. For tile i (rows r in [16i, 16i+16)) the anchor is its first row a = 16i:
    exp(G_r - G_c) = exp(G_r - G_a) * exp(G_a - G_c),
both factors <= 1 for c < a. The diagonal tiles (c in the same tile) are either computed pair by
pair, exp(G_r - G_c) with r >= c (exact for any g <= 0, e.g. g = -1000), or, when the caller
bounds g >= -5 (`bounded`), with the same anchor: exp(G_a - G_c) <= exp(15 * 5) ~ 4e32 fits float32
and bfloat16, so the whole row tile is one matmul (the K3 "safe gate" all-matmul path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.kda.hopper import check_kernel_setting

CHUNK = 64
TILE = 16
# The bounded (all-matmul) path needs exp(-(TILE - 1) * lower_bound) to fit in float32.
SAFE_LOWER_BOUND = -5.0
# The bounded path's diagonal tiles for bf16/f16 inputs (both score formulations): "f32"
# (HIGHEST-precision float32 products; on an H200 XLA runs them on CUDA cores, ~0.7 ms per KDA
# layer of the 1.3B train step), "split" (hi/lo split of both operands in the compute dtype,
# three tensor-core products with float32 accumulation, forward and backward), or "bf16x3" /
# "bf16x6" (XLA's dot algorithms BF16_BF16_F32_X3 / _X6: the same split done inside one
# tensor-core GEMM, so the parts never reach memory; X3 forms the three products of "split", X6
# six, about float32 accuracy). Plain bf16 operands would give dg errors of 0.02-0.03 against the
# reference (tolerance 0.02). "split" was slower on an H200 (train step 467 vs 457 ms,
# benchmarks/results/train-diag-h200-20261130T0350.json): the three 16x16 products and the
# splitting cost more bytes than the CUDA-core matmul. XLA on CPU runs the bf16xN algorithms as
# float32 products. On an H200 at 8 x 4096 x 16 x 128 (chunk_mosaic, one run,
# benchmarks/results/kda-diagalg-h200-20261130T1315.json), forward / forward + backward: "f32"
# 4.10 / 11.29 ms, "bf16x3" 3.93 / 10.96, "bf16x6" 3.98 / 11.15; with CUMSUM_MODE "matmul_bf16x6"
# too 3.79 / 10.96 (the defaults). The GPU tests hold every error at or under the "f32" one's.
DIAG_MODES = ("f32", "split", "bf16x3", "bf16x6")
DIAG_MODE = "bf16x3"
# How the dense formulation scores its rows (q and, for the delta rule, k) against the shared
# column side: "stacked" (both row tiles in one product of 2 x 16 rows, so the backward forms one
# gradient of the column side instead of two that are then added) or "separate" (one product per
# row). Both give the same values. "stacked" runs half as many matmuls, each twice as tall, but
# concatenates its operands, and XLA's CPU cost model counts slightly more bytes for it than for
# "separate", so the default stays "separate" until a GPU timing (benchmarks/train.py row
# setting rows=stacked) says otherwise.
ROW_MODES = ("stacked", "separate")
ROW_MODE = "separate"
# How the dense scores group their rows' products (q and, for the delta rule, k) when ROW_MODE
# keeps them "separate": DIAG_STACK for the bounded path's float32 diagonal tiles (when not split
# by hand), OFFDIAG_STACK for the off-diagonal tiles' compute-dtype product. "stacked": every row's
# tiles in one product (a float32 concatenation of the anchored rows for the diagonal tiles, one
# in the compute dtype for the others), so the backward forms the shared column side's gradient
# in one GEMM contracting over all rows instead of one GEMM per row and their sum (and the rows'
# gradients in one GEMM); "separate": one product per row. The same values up to float32
# summation order. XLA bytes of a forward+backward (`benchmarks/xla_bytes.py --deviceless`,
# chunk_mosaic), both "separate" / DIAG_STACK alone / OFFDIAG_STACK alone / both "stacked":
# 1,65536,16,128 52.31 / 50.68 / 50.16 / 48.77 GB, 8,4096,16,128 29.29 / 27.83 / 27.89 / 27.23
# (xla-bytes-deviceless-stack-{t65536,8x4096}-20261205.json). Both "stacked" are the defaults,
# ranked by those bytes; timed on an H100 at 1,65536,16,128: 21.77 ms forward+backward against
# 22.77 with both "separate" (kda-t65536-stack-h100-20261205T1010.json).
STACKS = ("stacked", "separate")
DIAG_STACK = "stacked"
OFFDIAG_STACK = "stacked"
# How the chunk-local cumsum G of the gates is formed: "scan" (jnp.cumsum; XLA on an H200 lowers
# it to a two-level reduce-window that ran at 22% of HBM bandwidth, 0.29 ms per call at
# 4 x 4096 x 16 x 128, benchmarks/results/kda-profile-h200-20261130.json) or "matmul" (a lower-
# triangular ones matrix times g in float32 at HIGHEST precision, one batched GEMM whose
# transpose is the backward's reverse cumsum). Same values up to float32 summation order (the
# matmul was as close to float64 or closer in the tests). On an H200 (chunk_mosaic,
# benchmarks/results/kda-cumsum-h200-20261130T1228.json) "matmul" took the forward from 4.24 to
# 4.00 ms at 8 x 4096 x 16 x 128 and from 2.49 to 2.20 at 4 x 4096, forward + backward from
# 11.51 to 11.20 and 5.87 to 5.86 ms: the default.
# "matmul_bf16x6" is the same matmul as XLA's BF16_BF16_F32_X6 dot algorithm (g split into three
# bf16 parts inside one tensor-core GEMM; the ones matrix is exact in bf16, so about float32's
# precision) instead of a float32 GEMM on CUDA cores: the default (see DIAG_MODES' timings).
CUMSUM_MODES = ("scan", "matmul", "matmul_bf16x6")
CUMSUM_MODE = "matmul_bf16x6"


# The backward of the dense scores on the bounded path for bf16 inputs: "xla" (autodiff of
# `decayed_scores`: the per-tile anchored float32 copies of k and of the rows and their gradients
# pass through HBM) or "mosaic" (`mosaic_scores_bwd`: a Mosaic GPU kernel builds them in SMEM;
# "interpret" runs it under the Mosaic GPU interpreter, for CPU tests). Other calls (float32 or
# float16 inputs, unbounded gates, K not a multiple of 64, scores="tiled") always take "xla".
SCORES_BWD_MODES = ("xla", "mosaic", "interpret")
SCORES_BWD = "xla"
# How `unit_lower_inverse` inverts the 16x16 diagonal blocks: "substitute" (forward substitution,
# a 15-step loop: on an H200 about 30 small kernel launches per KDA forward+backward, 0.19 ms at
# 4 x 4096 x 16 x 128, benchmarks/results/kda-profile-diagalg-h200-20261130.json) or "doubling"
# ((I + L)^{-1} = (I - L)(I + L^2)(I + L^4)(I + L^8) for strictly lower L: six batched products,
# as the TPU kernel does for whole chunks). Not yet timed on a GPU.
INVERSE_MODES = ("substitute", "doubling")
INVERSE_MODE = "substitute"


def traced_settings() -> tuple[str, str, str, str, str, str, str]:
    """(DIAG_MODE, ROW_MODE, CUMSUM_MODE, SCORES_BWD, INVERSE_MODE, DIAG_STACK, OFFDIAG_STACK), the
    module settings read while tracing (a jit cache key for the callers that jit); an unknown value
    raises."""
    for name, value, allowed in (("DIAG_MODE", DIAG_MODE, DIAG_MODES), ("ROW_MODE", ROW_MODE, ROW_MODES),
                                 ("CUMSUM_MODE", CUMSUM_MODE, CUMSUM_MODES),
                                 ("SCORES_BWD", SCORES_BWD, SCORES_BWD_MODES),
                                 ("INVERSE_MODE", INVERSE_MODE, INVERSE_MODES),
                                 ("DIAG_STACK", DIAG_STACK, STACKS), ("OFFDIAG_STACK", OFFDIAG_STACK, STACKS)):
        if value not in allowed:
            raise ValueError(f"chunk_intra.{name}={value!r}; expected one of {allowed}")
    return DIAG_MODE, ROW_MODE, CUMSUM_MODE, SCORES_BWD, INVERSE_MODE, DIAG_STACK, OFFDIAG_STACK


def chunk_cumsum(g):
    """Inclusive cumsum of g [..., C, K] over C, formed as CUMSUM_MODE says."""
    if traced_settings()[2] == "scan":
        return jnp.cumsum(g, axis=-2)
    prec = jax.lax.Precision.HIGHEST
    if CUMSUM_MODE == "matmul_bf16x6" and g.dtype == jnp.float32:
        prec = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
    if g.ndim >= 3:
        return _token_major_cumsum(g, prec)
    tri = jnp.tril(jnp.ones((g.shape[-2],) * 2, g.dtype))  # tri[d, c] = 1 for c <= d
    return jnp.einsum("dc,...ck->...dk", tri, g, precision=prec)


def _tri_product(g, prec, reverse: bool):
    """[.., H, C, K] as [.., C, H, K] (chunked [N, B, H, C, K] as [B, N, C, H, K]) against a
    batched lower-triangular ones matrix (its transpose if `reverse`) as the GEMM's first operand:
    the product reads g and writes the result in the token-major layout [B, T, H, K] the inputs
    arrive in, so the chunking's transposes fuse into the element-wise ops around it. An unbatched
    matrix leaves the chunk's leading dims free, and XLA then transposes g, G and their gradients
    around the GEMM (1.31 GB more in the XLA ops of a forward+backward at 1,65536,16,128)."""
    C = g.shape[-2]
    tri = jnp.tril(jnp.ones((C, C), g.dtype))  # tri[d, c] = 1 for c <= d
    perm = (1, 0, 3, 2, 4) if g.ndim == 5 else tuple(range(g.ndim - 3)) + (g.ndim - 2, g.ndim - 3, g.ndim - 1)
    x = jnp.transpose(g, perm)
    tb = jnp.broadcast_to(tri.T if reverse else tri, x.shape[:-3] + tri.shape)
    return jnp.transpose(jnp.einsum("...dc,...chk->...dhk", tb, x, precision=prec), perm)  # perm is its inverse


# The reverse cumsum (the gradient) is the same product with the transposed matrix, written out
# rather than left to autodiff: autodiff's transpose puts the cotangent first in the GEMM, so XLA
# writes it with the summed axis minor (an element-wise fusion transposing its [C, K] tiles at
# 38% of HBM bandwidth, 1.30 ms at 8,4096,16,128 on an H100,
# kda-profile-loops-bodies-8x4096-h100-20261205T1923.json) and transposes the result back.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _token_major_cumsum(g, prec):
    return _tri_product(g, prec, reverse=False)


def _token_major_cumsum_fwd(g, prec):
    return _tri_product(g, prec, reverse=False), None


def _token_major_cumsum_bwd(prec, _, dG):
    return (_tri_product(dG, prec, reverse=True),)


_token_major_cumsum.defvjp(_token_major_cumsum_fwd, _token_major_cumsum_bwd)


def to_chunks(x, C: int = CHUNK):
    """[B, T, H, ...] with T % C == 0 -> [N, B, H, C, ...]."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // C, C, H, *x.shape[3:])
    return jnp.moveaxis(x, (1, 3), (0, 2))


def from_chunks(x):
    """[N, B, H, C, ...] -> [B, N * C, H, ...]."""
    N, B, H, C = x.shape[:4]
    x = jnp.moveaxis(x, (0, 2), (1, 3))
    return x.reshape(B, N * C, H, *x.shape[4:])


def segment_counts(starts, C: int = CHUNK):
    """starts [B, T] bool (T % C == 0) -> [N, B, 1, C] int32: resets seen so far inside the chunk.

    Tokens r, c of one chunk belong to the same sequence iff their counts are equal; count 0 means
    the token still continues the sequence of the chunk's incoming state."""
    B, T = starts.shape
    s = jnp.moveaxis(starts.reshape(B, T // C, C), 1, 0).astype(jnp.int32)
    return jnp.cumsum(s, axis=-1)[:, :, None, :]


def _tri(C: int, strict: bool):
    r = jnp.arange(C)
    return (r[:, None] > r[None, :]) if strict else (r[:, None] >= r[None, :])


def decayed_scores(rows, k, G, *, bounded: bool, mm, cd=None):
    """For each a in `rows`: A[r, c] = sum_d a_r[d] k_c[d] exp(G_r[d] - G_c[d]) for r >= c.

    rows: list of [..., C, K]; k, G [..., C, K]. Returns a list of [..., C, C]; entries with r < c
    are finite but meaningless (callers mask them). Tiles below the diagonal use the anchored
    product through `mm(spec, x, y)` (operands in the compute dtype, float32 accumulation); the
    diagonal tiles are float32: pair by pair (exact path) or an anchored float32 matmul (bounded;
    `DIAG_MODE` "split" for compute dtype `cd`; `DIAG_STACK` "stacked": all rows in one product),
    because their gate gradient is a difference of anchored terms that bf16 operands would swamp."""
    *lead, C, K = G.shape
    nt = C // TILE
    Gt = G.reshape(*lead, nt, TILE, K)
    Ga = Gt[..., :1, :]  # [..., nt, 1, K] the anchor of each row tile
    # The diagonal tiles' product a_r k_c exp(G_r - G_a) exp(G_a - G_c) does not depend on G_a, so
    # its anchor takes no gradient: autodiff's G_a terms (sums over each tile's rows and columns
    # that XLA materialises) add up to the rounding difference of the two sides, negligible at the
    # diagonal tiles' float32 precision (the same errors in the tests; 58.48 -> 54.51 GB of XLA ops
    # at 1,65536,16,128). The bf16 off-diagonal tiles keep their anchor's gradient: there it cancels
    # the two sides' roundings in dg's reverse cumsum (dropping it took dg's error from 0.0030 to
    # 0.0043 at T = 512).
    Ga_diag = jax.lax.stop_gradient(Ga)
    # Column side for row tile i >= 1: k_c exp(G_a(i) - G_c) for c < 16 i (exponent <= 0), else 0.
    # Row tile 0 has no column below its diagonal tile and no row tile has one at c >= C - 16, so
    # the product covers row tiles 1.. and columns ..C-16 only (the rest of A is zero off the
    # diagonal tiles): [..., nt - 1, C - 16, K], 56% of the full [..., nt, C, K] at C = 64.
    k_hat = column_operand(k, G, Ga[..., 1:, :, :], jnp.dtype(k.dtype if cd is None else cd))
    row_decay = jnp.exp(Gt - Ga)  # [..., nt, TILE, K], <= 1
    kt = k.reshape(*lead, nt, TILE, K)
    if bounded:  # exp(G_a - G_c) <= exp(-(TILE - 1) * lower_bound) for c in the anchor's tile
        row_decay_d = jnp.exp(Gt - Ga_diag)  # the same values as row_decay
        kt_hat = kt * jnp.exp(Ga_diag - Gt)
    # Which rows' tiles share one product: all of them (ROW_MODE "stacked", or DIAG_STACK /
    # OFFDIAG_STACK "stacked" for their tiles; the backward then forms the shared column side's
    # gradient in one GEMM contracting over all rows, and the rows' in one), or one row at a time.
    stacked_diag, stacked_off = (mode == "stacked" for mode in traced_settings()[5:])  # (unknown ones raise)
    tiles = [a.reshape(*lead, nt, TILE, K) for a in rows]
    groups = lambda stacked: [tiles] if ROW_MODE == "stacked" or stacked else [[a] for a in tiles]  # noqa: E731
    # Off-diagonal tiles: row tiles 1.. against the column side, [..., nt - 1, R * TILE, Cm] per group.
    off = [mm("...ird,...icd->...irc",
              jnp.concatenate([(a * row_decay)[..., 1:, :, :].astype(k_hat.dtype) for a in group], axis=-2), k_hat)
           for group in groups(stacked_off)]
    # Diagonal tiles [..., nt, R * TILE, TILE] per group: float32 products of the anchored rows
    # (split by hand for `DIAG_MODE` "split"), or pair by pair on the exact path.
    split = bounded and cd is not None and diag_split(cd, G.dtype)
    diag = []
    for group in groups(stacked_diag and bounded and not split):
        if bounded:
            a_hat = jnp.concatenate([a * row_decay_d for a in group], axis=-2)
            diag.append(_diag_split(a_hat, kt_hat, jnp.dtype(cd)) if split else jnp.einsum(
                "...ird,...icd->...irc", a_hat, kt_hat, precision=diag_precision(cd, a_hat.dtype)))
        else:
            diag.append(jnp.concatenate([_diag_tiles(a, kt, Gt) for a in group], axis=-2))
    # Row x of the rows: its slice of its group's products, the diagonal tiles on the block diagonal.
    row_of = lambda parts, x: parts[0][..., x * TILE:(x + 1) * TILE, :] if len(parts) == 1 else parts[x]  # noqa: E731
    out = []
    for x in range(len(rows)):
        s = jnp.pad(row_of(off, x), [(0, 0)] * len(lead) + [(1, 0), (0, 0), (0, TILE)])  # [..., nt, TILE, C]
        out.append(s.reshape(*lead, C, C) + _block_diag(row_of(diag, x)))
    return out


def _column_factors(G, Ga):
    """exp(G_a(i) - G_c) for c < 16 i, else 0: G [..., C, K], Ga [..., nt - 1, 1, K] (row tiles 1..)
    -> [..., nt - 1, C - 16, K]."""
    nt, Cm = Ga.shape[-3] + 1, G.shape[-2] - TILE
    keep = (jnp.arange(Cm)[None, :] < TILE * jnp.arange(1, nt)[:, None])[:, :, None]  # [nt - 1, Cm, 1]
    return jnp.exp(jnp.where(keep, Ga - G[..., None, :Cm, :], -jnp.inf))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def column_operand(k, G, Ga, cd):
    """The column side of the off-diagonal tiles, k_c exp(G_a(i) - G_c) for c < 16 i (else 0), in the
    compute dtype `cd` (its only use is as a matmul operand): k, G [..., C, K], Ga [..., nt - 1, 1, K]
    -> [..., nt - 1, C - 16, K]. The VJP recomputes the factors from G, so the float32 operand and
    the float32 gradient of its exponent are never stored (autodiff wrote both)."""
    return (k[..., None, :G.shape[-2] - TILE, :] * _column_factors(G, Ga)).astype(cd)


def _column_operand_fwd(k, G, Ga, cd):
    return column_operand(k, G, Ga, cd), (k, G, Ga)


def _column_operand_bwd(cd, res, ct):
    k, G, Ga = res
    pad = [(0, 0)] * (k.ndim - 2) + [(0, TILE), (0, 0)]
    ct, kc = ct.astype(k.dtype), k[..., None, :G.shape[-2] - TILE, :]
    d_hat = ct * _column_factors(G, Ga)  # d k_hat * factor: [..., nt - 1, Cm, K]
    # The exponent's gradient d k_hat * k_hat, summed over row tiles (dG) and over columns (dGa).
    # The two sums are formed from differently associated products so that XLA recomputes the
    # factors in each reduction instead of storing their float32 product for both.
    dG = -jnp.sum(d_hat * kc, axis=-3)
    dGa = jnp.sum(ct * (kc * _column_factors(G, Ga)), axis=-2, keepdims=True)
    return jnp.pad(jnp.sum(d_hat, axis=-3), pad), jnp.pad(dG, pad), dGa


column_operand.defvjp(_column_operand_fwd, _column_operand_bwd)


def diag_split(cd, sdt) -> bool:
    """Whether the bounded diagonal tiles take the split products (`DIAG_MODE`, compute dtype
    `cd` narrower than the state dtype `sdt`)."""
    return traced_settings()[0] == "split" and jnp.dtype(cd).itemsize < jnp.dtype(sdt).itemsize


_DIAG_ALGORITHMS = {"bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


def diag_precision(cd, sdt):
    """The precision of the bounded diagonal tiles' state-dtype products when they are not split
    by hand: `DIAG_MODE`'s dot algorithm for float32 state and a narrower compute dtype `cd`
    (None: q's dtype is the state dtype), else HIGHEST."""
    mode = traced_settings()[0]
    narrow = cd is not None and jnp.dtype(cd).itemsize < jnp.dtype(sdt).itemsize
    if mode in _DIAG_ALGORITHMS and narrow and jnp.dtype(sdt) == jnp.float32:
        return _DIAG_ALGORITHMS[mode]
    return jax.lax.Precision.HIGHEST


def hi_lo(x, cd):
    """x (state dtype) as hi + lo parts in the narrower dtype `cd` (about 16 mantissa bits for bf16)."""
    hi = x.astype(cd)
    return hi, (x - hi.astype(x.dtype)).astype(cd)


def diag_product(spec, x, y, cd):
    """einsum(spec, x, y) of state-dtype operands: at `diag_precision`, or (`diag_split`) the sum
    xh yh + xh yl + xl yh of their hi/lo parts in the compute dtype `cd`, accumulated in x's dtype."""
    sdt = x.dtype
    if not diag_split(cd, sdt):
        return jnp.einsum(spec, x, y, precision=diag_precision(cd, sdt))
    mm = functools.partial(jnp.einsum, preferred_element_type=sdt)
    (xh, xl), (yh, yl) = hi_lo(x, cd), hi_lo(y, cd)
    return mm(spec, xh, yh) + (mm(spec, xh, yl) + mm(spec, xl, yh))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _diag_split(a_hat, kt_hat, cd):
    """Bounded diagonal tiles by split products, with a VJP of split products too (autodiff would
    round the cotangent to `cd` and lose the gate gradient's precision)."""
    return diag_product("...ird,...icd->...irc", a_hat, kt_hat, cd)


def _diag_split_fwd(a_hat, kt_hat, cd):
    return _diag_split(a_hat, kt_hat, cd), (a_hat, kt_hat)


def _diag_split_bwd(cd, res, ct):
    a_hat, kt_hat = res
    return (diag_product("...irc,...icd->...ird", ct, kt_hat, cd),
            diag_product("...irc,...ird->...icd", ct, a_hat, cd))


_diag_split.defvjp(_diag_split_fwd, _diag_split_bwd)


def pair_decay(Gt):
    """[..., T, K] -> [..., T, T, K]: exp(G_r - G_c) for r >= c, else 0 (no positive exponent)."""
    T = Gt.shape[-2]
    diff = Gt[..., :, None, :] - Gt[..., None, :, :]
    return jnp.exp(jnp.where(_tri(T, False)[:, :, None], diff, -jnp.inf))


@jax.custom_vjp
def _diag_tiles(at, kt, Gt):
    """Diagonal tiles pair by pair, exact for any g <= 0: at, kt, Gt [..., nt, TILE, K] ->
    [..., nt, TILE, TILE]. The VJP recomputes the pair decays inside each reduction, so the
    [..., TILE, TILE, K] factors are never stored (autodiff would keep them as residuals)."""
    return jnp.sum(at[..., :, None, :] * kt[..., None, :, :] * pair_decay(Gt), axis=-1)


def _diag_tiles_fwd(at, kt, Gt):
    return _diag_tiles(at, kt, Gt), (at, kt, Gt)


def _diag_tiles_bwd(res, ct):
    at, kt, Gt = res
    p = ct[..., None] * pair_decay(Gt)  # [..., r, c, K]
    x = p * at[..., :, None, :] * kt[..., None, :, :]
    d_at = jnp.sum(p * kt[..., None, :, :], axis=-2)
    d_kt = jnp.sum(p * at[..., :, None, :], axis=-3)
    d_G = jnp.sum(x, axis=-2) - jnp.sum(x, axis=-3)  # d/dG_r exp(G_r - G_c) = +e, d/dG_c = -e
    return d_at, d_kt, d_G


_diag_tiles.defvjp(_diag_tiles_fwd, _diag_tiles_bwd)


def _block_diag(d):
    """[..., nt, T, T] -> [..., nt * T, nt * T] with the tiles on the diagonal."""
    *lead, nt, T, _ = d.shape
    eye = jnp.eye(nt, dtype=d.dtype)
    return (d[..., :, :, None, :] * eye[:, None, :, None]).reshape(*lead, nt * T, nt * T)


SCORES = ("tiled", "dense")


def prep(q, k, v, g, beta, counts, *, scale: float, bounded: bool, delta: bool, mm, scores="dense", cd=None,
         prec=None):
    """Everything that depends on the inputs only (not on the carried state), all chunks at once.

    `scores` picks how Aqk and L are formed: "tiled" (`chunk_scores.tiled_scores`: lower tile pairs
    only, operands in the compute dtype `cd` (default q's) at matmul precision `prec`, a
    hand-written VJP) or "dense" (`decayed_scores`: every row tile against a masked float32 copy
    of k, through `mm`; differentiated by autodiff, or on the bounded bf16 path by the Mosaic GPU
    kernel of `mosaic_scores_bwd` when `SCORES_BWD` says so).

    q, k, g [N, B, H, C, K]; v [N, B, H, C, V]; beta [N, B, H, C]; counts [N, B, 1, C] or None.
    Returns a dict (state dtype):
      qg   [.., C, K]  scale * q * exp(G), zero after a reset    (output from the incoming state)
      kg   [.., C, K]  k * exp(G_last - G), zero before a reset  (write into the outgoing state)
      decay [.., K]    exp(G_last), zero if the chunk has a reset (incoming -> outgoing state)
      Aqk  [.., C, C]  scale * q_r . (k_c exp(G_r - G_c)), r >= c, same sequence
    and for the delta rule also
      L    [.., C, C]  beta_r k_r . (k_c exp(G_r - G_c)), r > c, same sequence
      kgam [.., C, K]  beta * k * exp(G), zero after a reset
      bv   [.., C, V]  beta * v
    Differentiable by `jax.vjp` (used by the backward pass)."""
    sdt = g.dtype
    G = chunk_cumsum(g)
    G_last = G[..., -1, :]
    gam = jnp.exp(G)
    C = G.shape[-2]
    qf, kf = q.astype(sdt), k.astype(sdt)
    if counts is None:
        z = tail = same = None
    else:
        z = (counts == 0)[..., None]  # [N, B, 1, C, 1]
        tail = (counts == counts[..., -1:])[..., None]
        same = counts[..., :, None] == counts[..., None, :]  # [N, B, 1, C, C]

    def keep(x, m):
        return x if m is None else jnp.where(m, x, 0)

    if scores == "tiled":
        from kernels.kda.chunk_scores import tiled_scores

        A = tiled_scores(qf, kf, G, scale, delta, bounded, jnp.dtype(q.dtype if cd is None else cd), prec)
        scores = [A[..., x, :, :] for x in range(A.shape[-3])]
    elif scores == "dense" and bounded and _kernel_scores_bwd(q.dtype if cd is None else cd, q.shape[-1]):
        from kernels.kda import mosaic_scores_bwd

        scores = mosaic_scores_bwd.dense_scores(qf, kf, G, scale, delta, mm, traced_settings()[3] == "interpret")
    elif scores == "dense":
        rows = [qf * scale, kf] if delta else [qf * scale]
        scores = decayed_scores(rows, kf, G, bounded=bounded, mm=mm, cd=jnp.dtype(q.dtype if cd is None else cd))
    else:
        raise ValueError(f"scores={scores!r}; expected one of {SCORES}")
    incl = _tri(C, False) if same is None else _tri(C, False) & same
    out = dict(
        qg=keep(qf * scale * gam, z),
        kg=keep(kf * jnp.exp(G_last[..., None, :] - G), tail),
        decay=keep(jnp.exp(G_last), None if z is None else z[..., -1, :]),
        Aqk=jnp.where(incl, scores[0], 0),
    )
    if delta:
        strict = _tri(C, True) if same is None else _tri(C, True) & same
        out["L"] = jnp.where(strict, beta[..., None] * scores[1], 0)
        out["kgam"] = keep(beta[..., None] * kf * gam, z)
        out["bv"] = beta[..., None] * v.astype(sdt)
    return out


def _kernel_scores_bwd(cd, K: int) -> bool:
    """Whether the dense scores' backward runs as the Mosaic GPU kernel (`SCORES_BWD`)."""
    mode = traced_settings()[3]
    check_kernel_setting("chunk_intra.SCORES_BWD", mode)
    return mode != "xla" and jnp.dtype(cd) == jnp.bfloat16 and K % 64 == 0


def unit_lower_inverse(L, precision):
    """(I + L)^{-1} for strictly lower-triangular L [..., C, C], C a multiple of 16.

    Diagonal 16x16 tiles at full precision (`INVERSE_MODE`: forward substitution or the doubling
    product), then block rows merged with matmuls at `precision`:
    Ai[i, :i] = -X_ii L[i, :i] Ai[:i, :i]. All in L's dtype."""
    *lead, C, _ = L.shape
    nt = C // TILE
    mm = functools.partial(jnp.einsum, precision=precision)
    mm_hi = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    Lt = L.reshape(*lead, nt, TILE, nt, TILE)
    Ld = jnp.stack([Lt[..., i, :, i, :] for i in range(nt)], axis=-3)  # [..., nt, T, T]
    eye = jnp.broadcast_to(jnp.eye(TILE, dtype=L.dtype), Ld.shape)

    if traced_settings()[4] == "doubling":  # N = -Ld is nilpotent (N^16 = 0): sum_k N^k
        N = -Ld
        X = eye + N
        for _ in range(TILE.bit_length() - 2):  # X (I + N^2) (I + N^4) (I + N^8)
            N = mm_hi("...rm,...mc->...rc", N, N)
            X = X + mm_hi("...rm,...mc->...rc", X, N)
    else:
        def substitute(i, X):  # X[i] = e_i - L[i] X: rows m >= i of X are still e_m and L[i, m >= i] = 0
            row = jax.lax.dynamic_index_in_dim(Ld, i, axis=-2, keepdims=False)
            return X.at[..., i, :].add(-mm_hi("...m,...mj->...j", row, X))

        X = jax.lax.fori_loop(1, TILE, substitute, eye)
    Ai = X[..., :1, :, :].reshape(*lead, TILE, TILE)
    for i in range(1, nt):
        n = i * TILE
        Xi = X[..., i, :, :]
        blk = -mm("...rs,...sc->...rc", Xi, mm("...sm,...mc->...sc", L[..., n : n + TILE, :n], Ai))
        top = jnp.concatenate([Ai, jnp.zeros((*lead, n, TILE), L.dtype)], axis=-1)
        Ai = jnp.concatenate([top, jnp.concatenate([blk, Xi], axis=-1)], axis=-2)
    return Ai

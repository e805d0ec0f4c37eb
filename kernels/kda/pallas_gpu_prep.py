"""Chunk-parallel intra-chunk stage of chunked KDA in plain JAX, plus the inter-chunk scan.

`prepare` turns canonical inputs into the per-chunk tensors that the Mosaic GPU state kernel
(`mosaic_state.state_output`) consumes; `scan_state_output` is the same inter-chunk stage as
a `lax.scan` (the differentiable path and the kernel's reference). Layout: [B, H, NT, C, *].

Exactness: every exponent is <= 0 for any gate g <= 0 (no bounded-gate assumption). The
intra-chunk decay is split around a per-16-row anchor (first row of the row's sub-chunk):
off-diagonal 16x16 blocks are plain matmuls of q*exp(G_r - G_a) and k*exp(G_a - G_c), and the
diagonal blocks use exp(G_r - G_c) per channel. Segment resets are exact: pairs across a
segment boundary are masked, and the incoming state reaches only the chunk's first segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.kda.validate import segment_starts

_HI = jax.lax.Precision.HIGHEST
SUB = 16  # sub-chunk rows sharing one decay anchor


def _chunk(x, NT, C):
    """[B, Tp, H, ...] -> [B, H, NT, C, ...] float32."""
    B, Tp, H = x.shape[:3]
    x = x.reshape(B, NT, C, H, *x.shape[3:]).astype(jnp.float32)
    return jnp.moveaxis(x, 3, 1)


def _pad_time(x, Tp, mode="constant"):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, Tp - x.shape[1])
    return jnp.pad(x, pad, mode=mode)


def _segment_masks(segment_ids, B, T, Tp, NT, C):
    """(same [B,1,NT,C,C], start [B,1,NT,C], end [B,1,NT,C], carry [B,1,NT]) as bool, or Nones.

    same: rows r, c in one segment; start: row r continues the segment that entered the chunk
    (so the incoming state reaches it); end: row c is in the chunk's last segment; carry: the
    incoming segment is still open at the chunk's end (the state decays instead of resetting).
    """
    if segment_ids is None:
        return None, None, None, None
    # A new sequence starting exactly at a chunk boundary must also cut the carried state.
    seg = jnp.cumsum(segment_starts(segment_ids, T).astype(jnp.int32), axis=1)
    seg = _pad_time(seg, Tp, mode="edge").reshape(B, NT, C)
    prev = jnp.concatenate([seg[:, :1, 0], seg[:, :-1, -1]], axis=1)  # [B, NT]
    same = seg[..., :, None] == seg[..., None, :]
    start = seg == prev[..., None]
    end = seg == seg[..., -1:]
    carry = seg[..., -1] == prev
    return same[:, None], start[:, None], end[:, None], carry[:, None]


def _decayed_products(x, k, G):
    """sum_d x_r[d] k_c[d] exp(G_r[d] - G_c[d]) for r >= c within a chunk: [..., C, C].

    x, k, G [..., C, K]. Entries with r < c are zero.
    """
    C, K = x.shape[-2:]
    NS = C // SUB
    sub = lambda t: t.reshape(*t.shape[:-2], NS, SUB, K)
    xs, ks, Gs = sub(x), sub(k), sub(G)
    anchor = Gs[..., :, :1, :]  # [..., NS, 1, K]: first row of each sub-chunk
    x_hat = xs * jnp.exp(Gs - anchor)  # exponent <= 0
    # Column side for row-block I: k_c * exp(G_a(I) - G_c) for columns before block I.
    col_block = jnp.arange(C) // SUB
    before = col_block[None, :] < jnp.arange(NS)[:, None]  # [NS, C]
    expo = anchor - G[..., None, :, :]  # [..., NS, C, K]
    expo = jnp.where(before[:, :, None], expo, 0.0)
    k_hat = jnp.where(before[:, :, None], k[..., None, :, :] * jnp.exp(expo), 0.0)
    off = jnp.einsum("...irk,...ick->...irc", x_hat, k_hat, precision=_HI)  # [..., NS, SUB, C]
    # Diagonal blocks: per-channel decay, exact.
    causal = jnp.tril(jnp.ones((SUB, SUB), bool))
    dexp = Gs[..., :, None, :] - Gs[..., None, :, :]  # [..., NS, SUB, SUB, K]
    dexp = jnp.where(causal[:, :, None], dexp, 0.0)
    diag = jnp.sum(xs[..., :, None, :] * ks[..., None, :, :] * jnp.exp(dexp), axis=-1)  # one fused reduction
    diag = jnp.where(causal, diag, 0.0)
    eye = jnp.eye(NS, dtype=diag.dtype)
    blocks = jnp.einsum("...irc,ij->...irjc", diag, eye).reshape(*diag.shape[:-3], NS, SUB, C)
    return (off + blocks).reshape(*x.shape[:-2], C, C)


def prepare(q, k, v, g, beta, *, scale, segment_ids, C=64):
    """Per-chunk tensors of the chunked delta rule (canonical inputs, any T).

    Returns dict with float32 qg, w, kg [B,H,NT,C,K]; u [B,H,NT,C,V]; a [B,H,NT,C,C]
    (scaled, causal, segment-masked); d [B,H,NT,K] (state decay over the chunk, 0 on reset).
    """
    B, T, H, K = q.shape
    NT = -(-T // C)
    Tp = NT * C
    q, k, v, g, beta = (_pad_time(x, Tp) for x in (q, k, v, g, beta))
    q, k, v, g = (_chunk(x, NT, C) for x in (q, k, v, g))
    beta = _chunk(beta, NT, C)  # [B, H, NT, C]
    same, start, end, carry = _segment_masks(segment_ids, B, T, Tp, NT, C)

    G = jnp.cumsum(g, axis=-2)
    G_last = G[..., -1, :]
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    causal = jnp.tril(jnp.ones((C, C), bool))
    a = _decayed_products(q, k, G)
    L = _decayed_products(k, k, G) * beta[..., None]
    if same is not None:
        strict, causal = strict & same, causal & same
    a = jnp.where(causal, a, 0.0) * scale
    L = jnp.where(strict, L, 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    Ai = jax.scipy.linalg.solve_triangular(eye + L, jnp.broadcast_to(eye, L.shape), lower=True, unit_diagonal=True)

    gam = jnp.exp(G)
    kg = k * jnp.exp(G_last[..., None, :] - G)
    d = jnp.exp(G_last)
    if start is not None:
        gam = jnp.where(start[..., None], gam, 0.0)
        kg = jnp.where(end[..., None], kg, 0.0)
        d = jnp.where(carry[..., None], d, 0.0)
    bk = beta[..., None] * k * gam
    w = jnp.einsum("...rc,...ck->...rk", Ai, bk, precision=_HI)
    u = jnp.einsum("...rc,...cv->...rv", Ai, beta[..., None] * v, precision=_HI)
    return dict(qg=q * gam * scale, w=w, kg=kg, u=u, a=a, d=d)


def scan_state_output(qg, w, kg, u, a, d, h0):
    """Inter-chunk stage as a scan (float32): the math of `mosaic_state.state_output`.

    Chunk tensors [B, H, NT, ...] as from `prepare`; h0 [B, H, K, V]. Returns
    (o [B, H, NT, C, V], final state [B, H, K, V]).
    """
    mv = lambda x: jnp.moveaxis(x, 2, 0)

    def body(S, x):
        qg_n, w_n, kg_n, u_n, a_n, d_n = x
        vn = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, S, precision=_HI)
        o = jnp.einsum("bhck,bhkv->bhcv", qg_n, S, precision=_HI)
        o = o + jnp.einsum("bhrc,bhcv->bhrv", a_n, vn, precision=_HI)
        S = d_n[..., None] * S + jnp.einsum("bhck,bhcv->bhkv", kg_n, vn, precision=_HI)
        return S, o

    S, o = jax.lax.scan(body, h0, tuple(mv(x) for x in (qg, w, kg, u, a, d)))
    return jnp.moveaxis(o, 0, 2), S


def unchunk(o, T):
    """[B, H, NT, C, V] -> [B, T, H, V]."""
    B, H, NT, C, V = o.shape
    return jnp.moveaxis(o.reshape(B, H, NT * C, V), 1, 2)[:, :T]


def chunked_reference(q, k, v, g, beta, *, scale, initial_state, segment_ids):
    """Whole chunked forward in float32 plain JAX: (o [B,T,H,V] f32, final state [B,H,K,V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    h0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    p = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids)
    o, S = scan_state_output(p["qg"], p["w"], p["kg"], p["u"], p["a"], p["d"], h0)
    return unchunk(o, T), S

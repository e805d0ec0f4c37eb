"""Chunked delta rule (KDA / Gated DeltaNet / DeltaNet) in pure JAX, with a hand-written backward.

Per chunk of C = 64 tokens with incoming state S_n [K, V] (see `chunk_intra.prep` for the pieces):
    Ai = (I + L)^{-1},  w = Ai kgam,  u = Ai bv                (WY / UT form, all chunks at once)
    v'_n = u_n - w_n S_n                                        (the corrected values)
    S_{n+1} = Diag(decay_n) S_n + kg_n^T v'_n                   (`lax.scan` over chunks: the only serial part)
    o_n = qg_n S_n + Aqk_n v'_n                                 (all chunks at once)
Linear attention is the same with L = 0, w = 0, u = v (`delta=False`, used by `linear_chunk.py`).

`state_pass` picks how the two serial passes run: "xla" (`lax.scan`, any platform) or the Mosaic GPU
kernels of `mosaic_scan.py` ("mosaic" compiled for Hopper, "mosaic_interpret" in the interpreter);
everything else stays XLA.

The backward (`jax.custom_vjp`) keeps only the per-chunk states S_n ([N, B, H, K, V], O(T K V / 64)
per head) and the inputs; it recomputes the intra-chunk pieces, runs one reverse `lax.scan` for the
state gradients, inverts (I + L) by hand (dL = -Ai^T dAi Ai^T), and pulls the rest back through
`chunk_intra.prep` with `jax.vjp` (batched einsums, no scan).

Matmul operands are in the input dtype (bfloat16 for bf16 inputs) with float32 accumulation; the
cumsum, the triangular inverse and the carried states are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from kernels.kda import chunk_intra, chunk_output, chunk_prep_bwd, chunk_segments, chunk_wy
from kernels.kda.chunk_intra import (
    CHUNK,
    SAFE_LOWER_BOUND,
    SCORES,
    from_chunks,
    prep,
    segment_counts,
    to_chunks,
    unit_lower_inverse,
)
from kernels.kda.validate import segment_starts, state_dtype

# the traced module settings by name, defined beside (`chunk_settings`), used by name from here
from kernels.kda.chunk_settings import SETTINGS, setting_values, settings, traced_key  # noqa: F401

_HI = jax.lax.Precision.HIGHEST


class _Numerics:
    """Compute dtype (matmul operands), state dtype and precisions for one input dtype."""

    def __init__(self, dtype):
        self.sdt = state_dtype(dtype)
        self.cd = jnp.dtype(dtype)
        low = self.cd in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        self.prec = None if low else _HI  # full float32 matmuls for float32 inputs (no TF32)
        self.fine = None if low else _HI  # the small [C, C] products around the inverse

    def mm(self, spec, x, y, dtype=None, out=None):
        """einsum with operands in `dtype` (default: the compute dtype) accumulating in float32;
        the result in `out` (default: the state dtype)."""
        cd = self.cd if dtype is None else dtype
        out = self.sdt if out is None else out
        return jnp.einsum(spec, x.astype(cd), y.astype(cd), preferred_element_type=out, precision=self.prec)

    def mm_fine(self, spec, x, y):
        return jnp.einsum(spec, x.astype(self.sdt), y.astype(self.sdt), precision=self.fine)


def _prep(nm, q, k, v, g, beta, counts, scale, bounded, delta, scores="dense"):
    # float16 cannot hold the anchored factors of the bounded path (up to e^75): score in float32.
    f16 = nm.cd == jnp.dtype(jnp.float16)
    mm = functools.partial(nm.mm, dtype=jnp.float32) if f16 else nm.mm
    return prep(q, k, v, g, beta, counts, scale=scale, bounded=bounded, delta=delta, mm=mm, scores=scores,
                cd=jnp.float32 if f16 else nm.cd, prec=nm.prec)


def _wy(nm, P, values=True):
    """Ai = (I + L)^{-1}, w = Ai kgam [.., C, K], u = Ai bv [.., C, V] (None without `values`)."""
    Ai = unit_lower_inverse(P["L"], nm.fine)
    w = nm.mm("...rc,...ck->...rk", Ai, P["kgam"], out=nm.cd)
    u = nm.mm("...rc,...cv->...rv", Ai, P["bv"], out=nm.cd) if values else None
    return Ai, w, u


STATE_PASSES = ("xla", "mosaic", "mosaic_interpret")
# The checkpoint name of the per-chunk incoming states, the forward's residual for the backward:
# a remat policy that saves it (kimi_jax.remat's "dots16") spares the backward a rerun of the
# forward state pass.
STATES_NAME = "kda_chunk_states"
# What else the forward keeps for the backward (`chunk.settings(residuals=...)`): "states" (only
# the chunk states: the backward recomputes v' = u - w S_n, one [C, C] x [C, V] and one
# [C, K] x [K, V] product per chunk and their float32 difference) or "states_vn" (also v'
# [N, B, H, C, V] in the compute dtype, which the forward's state pass writes anyway, named
# VN_NAME for remat policies: as many bytes as v held until the backward). "states_vn" took
# 1,65536,16,128 from 21.17 to 20.75 ms forward+backward on an H200, and to 19.11 with
# cotangents="compute" (kda-levers-t65536-h200-20261205T0534.json).
# "pieces": also the intra-chunk pieces the backward reads (Aqk, qg, kg, kgam, decay, Ai = (I + L)^-1
# and w, about 4.5x the states' bytes, named PIECES_NAME), where the pieces' pull-back is the
# Mosaic GPU kernel (`chunk_prep_bwd.PREP_BWD`): the backward then runs none of the forward's XLA
# ops again (XLA shares none of them with the backward's recomputation). Elsewhere "pieces" keeps
# what "states_vn" keeps. Where `pallas_gpu.TRAIN_INTRA` has the intra kernel write them they are
# (qg, w, kg, decay, AqkT, AiT, kexp) in that kernel's orientation (`_core_bwd` takes both forms).
# The default: with the kernel's pull-back, forward+backward on an H100
# took 7.07 ms against 8.69 at 8,4096,16,128 and 15.45 against 18.47 at 1,65536,16,128
# (kda-prepbwd-pieces-fla-h100-20261206T0756.json).
RESIDUAL_CHOICES = ("states", "states_vn", "pieces")
RESIDUALS = "pieces"
PIECES_NAME = "kda_chunk_pieces"
_KEPT_PIECES = ("Aqk", "qg", "kg", "kgam", "decay")
VN_NAME = "kda_chunk_vn"


def residuals() -> str:
    if RESIDUALS not in RESIDUAL_CHOICES:
        raise ValueError(f"chunk.RESIDUALS={RESIDUALS!r}; expected one of {RESIDUAL_CHOICES}")
    return RESIDUALS


def _mosaic_scan(state_pass):
    from kernels.kda import mosaic_scan  # Mosaic GPU is only imported when a kernel pass is asked for

    return mosaic_scan, state_pass == "mosaic_interpret"


def _state_scan(nm, h0, w, u, kg, decay, state_pass="xla", final_only=False, segments=1):
    """Serial pass over chunks. Returns (incoming states [N, B, H, K, V] in the compute dtype,
    corrected values v' [N, B, H, C, V] in the compute dtype, final state in the state dtype).
    segments > 1: h0 [segments * B, H, K, V], each run of N / segments chunks from its own start
    (`chunk_segments`; the final state per run). final_only: the kernel pass may skip the per-chunk
    outputs (XLA drops unused ones itself)."""
    if state_pass != "xla":
        ms, interpret = _mosaic_scan(state_pass)
        if w is not None and chunk_segments.scan_form() == "transition":
            from kernels.kda import mosaic_scan_transition as mt

            return mt.state_scan_chunks(nm, h0, w, u, kg, decay, interpret=interpret, final_only=final_only,
                                        segments=segments)
        return ms.state_scan_chunks(h0, w, u, kg, decay, cd=nm.cd, interpret=interpret, final_only=final_only,
                                    segments=segments)
    if segments > 1:
        return chunk_segments.per_segment(lambda *a: _state_scan(nm, *a), segments, h0, w, u, kg, decay)

    def body(S, x):
        w_n, u_n, kg_n, d_n = x
        S_c = S.astype(nm.cd)
        if w_n is None:
            vn = u_n
        else:
            vn = (u_n.astype(nm.sdt) - nm.mm("bhck,bhkv->bhcv", w_n, S_c)).astype(nm.cd)
        S = d_n[..., None] * S + nm.mm("bhck,bhcv->bhkv", kg_n, vn)
        return S, (S_c, vn)

    S, (states, vn) = jax.lax.scan(body, h0, (w, u, kg, decay))
    return states, vn, S


def _forward(q, k, v, g, beta, h0, counts, scale, bounded, delta, state_pass, scores, keep=False):
    """(o, S, states, v'), and with `keep` the pieces the backward reads (`kept_pieces`)."""
    nm = _Numerics(q.dtype)
    P = _prep(nm, q, k, v, g, beta, counts, scale, bounded, delta, scores)
    if delta:
        Ai, w, u = _wy(nm, P)
    else:
        Ai, w, u = None, None, v.astype(nm.cd)
    pieces = (dict({key: P[key] for key in _KEPT_PIECES}, Ai=Ai, w=w),) if keep else ()
    if chunk_output.output_pass(state_pass, delta):
        return chunk_output.kernel_output(nm, P, w, u, h0, interpret=state_pass == "mosaic_interpret") + pieces
    scan = lambda *a, **kw: _state_scan(nm, *a, state_pass, **kw)  # noqa: E731
    states, vn, S = chunk_segments.state_scan(scan, h0, w, u, P["kg"], P["decay"], chunk_segments.SEGMENTS)
    o = nm.mm("nbhck,nbhkv->nbhcv", P["qg"], states) + nm.mm("nbhrc,nbhcv->nbhrv", P["Aqk"], vn)
    return (o, S, states, vn) + pieces


def kept_pieces(dtype, K, bounded, delta, counts, state_pass) -> bool:
    """Whether the forward keeps the intra-chunk pieces for the backward (`RESIDUALS` "pieces" on
    a call whose pull-back is the kernel's, `chunk_prep_bwd.prep_bwd_mode`)."""
    nm = _Numerics(dtype)
    return residuals() == "pieces" and _prep_bwd_mode(nm, K, bounded, delta, counts, state_pass) is not None


def _prep_bwd_mode(nm, K, bounded, delta, counts, state_pass):
    return chunk_prep_bwd.prep_bwd_mode(nm, K, bounded, delta, counts, state_pass, cotangents() == "compute")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def chunk_core(q, k, v, g, beta, h0, counts, scale, bounded, delta, state_pass="xla", scores="dense"):
    """Chunked arrays in, (o [N, B, H, C, V] float32, final state [B, H, K, V]) out.

    q, k [N, B, H, C, K] and v [N, B, H, C, V] in one dtype; g [N, B, H, C, K] and beta [N, B, H, C]
    in the state dtype; h0 [B, H, K, V] state dtype; counts [N, B, 1, C] int32 or None;
    state_pass in STATE_PASSES; scores in chunk_intra.SCORES."""
    o, S, _, _ = _forward(q, k, v, g, beta, h0, counts, scale, bounded, delta, state_pass, scores)
    return o, S


def _core_fwd(q, k, v, g, beta, h0, counts, scale, bounded, delta, state_pass="xla", scores="dense"):
    keep = kept_pieces(q.dtype, q.shape[-1], bounded, delta, counts, state_pass)
    o, S, states, vn, *pieces = _forward(q, k, v, g, beta, h0, counts, scale, bounded, delta, state_pass, scores,
                                         keep=keep)
    states, vn, pieces = named_residuals(states, vn, delta, *pieces)
    return (o, S), (q, k, v, g, beta, counts, states, vn, pieces)


def named_residuals(states, vn, delta, pieces=None):
    """The chunk states, v' if `residuals()` keeps it (else None) and the kept pieces (or None),
    named for remat policies."""
    keep = delta and residuals() in ("states_vn", "pieces")
    pieces = None if pieces is None else checkpoint_name(pieces, PIECES_NAME)
    return checkpoint_name(states, STATES_NAME), (checkpoint_name(vn, VN_NAME) if keep else None), pieces


def _core_bwd(scale, bounded, delta, state_pass, scores, res, cts):
    # A custom_vjp backward is traced without its caller's named scopes: name it for profiles.
    with jax.named_scope("kda_bwd"):
        return _core_bwd_scoped(scale, bounded, delta, state_pass, scores, res, cts)


def _core_bwd_scoped(scale, bounded, delta, state_pass, scores, res, cts):
    q, k, v, g, beta, counts, states, vn, pieces = res
    do, dS_final = cts
    nm = _Numerics(q.dtype)
    kernel = _prep_bwd_mode(nm, q.shape[-1], bounded, delta, counts, state_pass)
    if kernel is None:
        P, pull = jax.vjp(lambda *a: _prep(nm, *a, counts, scale, bounded, delta, scores), q, k, v, g, beta)
    else:  # the pieces' pull-back is the Mosaic GPU kernel's: no residuals for autodiff
        P = pieces or _prep(nm, q, k, v, g, beta, counts, scale, bounded, delta, scores)
        pull = functools.partial(chunk_prep_bwd.kernel_pull_back, q, k, v, g, beta, scale=scale,
                                 interpret=kernel == "interpret")
    # Pieces as the intra-chunk kernel writes them (`pallas_gpu.TRAIN_INTRA`): Aqk^T, Ai^T and
    # k exp(G) for Aqk, Ai and kgam = beta k exp(G); the kernels below take them so.
    intra_form = pieces is not None and "AqkT" in pieces
    if intra_form and kernel is None:  # XLA's pull-back: its P, the forward's state-pass operands
        P = dict(P, **{key: pieces[key] for key in ("qg", "kg", "decay")})
    if pieces is not None:  # the forward's (`RESIDUALS` "pieces", which keeps v' too)
        Ai, w = pieces["AiT" if intra_form else "Ai"], pieces["w"]
    elif delta:
        Ai, w, u = _wy(nm, P, values=vn is None)
        if vn is None:  # not kept by the forward (`residuals()`): v' = u - w S_n again
            vn = (u.astype(nm.sdt) - nm.mm("nbhck,nbhkv->nbhcv", w, states)).astype(nm.cd)
    else:
        w, vn = None, v.astype(nm.cd)
    do = do.astype(nm.cd)
    # cotangents "compute": the state gradients in the compute dtype too (the kg product reads them
    # so; the decay's gradient sums them against the states in float32), Aqk^T do in it (the reverse
    # pass adds it to kg dS and rounds their sum to it), and the pieces' cotangents below.
    compact = cotangents() == "compute" and nm.cd.itemsize < jnp.dtype(nm.sdt).itemsize
    # Output o = qg S + Aqk v'.
    aqk, aqk_spec = (pieces["AqkT"], "nbhcr") if intra_form else (P["Aqk"], "nbhrc")
    aqk_do = lambda: nm.mm(f"{aqk_spec},nbhrv->nbhcv", aqk, do, out=nm.cd if compact else None)  # noqa: E731
    dS_final = dS_final.astype(nm.sdt)
    if state_pass == "xla":
        dS_out = nm.mm("nbhck,nbhcv->nbhkv", P["qg"], do)
        scan = lambda dS, c, src, **kw: _grad_scan(nm, dS, c[0], c[1], c[2], *src, **kw)  # noqa: E731
        chunked, sources = (w, P["kg"], P["decay"]), (dS_out, aqk_do())
    else:  # the kernel forms dS_out = qg^T do per chunk itself
        ms, interpret = _mosaic_scan(state_pass)
        if delta and chunk_segments.scan_form() == "transition":
            from kernels.kda import mosaic_scan_transition as mt

            scan = lambda dS, c, src, **kw: mt.grad_scan_chunks(  # noqa: E731
                nm, dS, c[0], c[1], c[2], src[0], src[1], c[3], interpret=interpret, **kw)
            chunked, sources = (w, P["kg"], P["qg"], P["decay"]), (do, aqk_do())
        else:
            # grad_intra "kernel": the pass forms Aqk^T do itself from each chunk's Aqk
            own = delta and chunk_segments.grad_intra() == "kernel"
            scan = lambda dS, c, src, **kw: ms.grad_scan_chunks(  # noqa: E731
                dS, c[0], c[1], c[2], src[0], None if own else src[1], c[3], cd=nm.cd, interpret=interpret,
                dhs_dtype=nm.cd if compact else jnp.float32, aqk=c[4] if own else None,
                aqk_transposed=intra_form, do_tokens=kernel is not None, **kw)
            chunked = (w, P["kg"], P["qg"], P["decay"]) + ((aqk,) if own else ())
            sources = (do,) if own else (do, aqk_do())
    dhs, dvn, dh0 = chunk_segments.grad_scan(scan, dS_final, chunked, sources, chunk_segments.SEGMENTS)
    if compact:  # the XLA and transition passes write float32
        dhs = dhs.astype(nm.cd)
    ct = {}
    if delta:  # bv, kgam, L; with the WY kernel's state products (`chunk_wy.WY_STATE`) qg, kg, decay too,
        # and for the pieces' pull-back kernel Aqk's cotangent with its transpose
        ct.update(chunk_wy.pull_back(nm, dvn, states, Ai, v, beta, pieces["kexp"] if intra_form else P["kgam"],
                                     compact, state_pass, do=do, vn=vn, dhs=dhs, intra_form=intra_form,
                                     dl_transposed=kernel is not None, score_cotangents=kernel is not None,
                                     token_values=kernel is not None))
    if "Aqk" not in ct:
        ct["Aqk"] = nm.mm("nbhrv,nbhcv->nbhrc", do, vn)
    if "qg" not in ct:
        ct.update(state_products(nm, do, states, vn, dhs))
    if compact:
        # Each of these pieces is only ever a matmul operand in the compute dtype, so its
        # cotangent is rounded there too: the products write half the bytes and the pull-back
        # reads half (the convert fuses into both).
        ct = {key: x.astype(nm.cd).astype(x.dtype) if key in _COMPUTE_PIECES else x for key, x in ct.items()}
    dq, dk, dv, dg, dbeta = pull(ct)
    if not delta:
        dv = dv + dvn.astype(dv.dtype)
    return dq, dk, dv, dg, dbeta, dh0, None


def state_products(nm, do, states, vn, dhs):
    """The cotangents of qg, kg and decay that the chunk states carry (o = qg S_n + ..., S_{n+1} =
    decay S_n + kg^T v'), by piece name, from do, v' [N, B, H, C, V], the states S_n and their
    gradients dhs [N, B, H, K, V] (`mosaic_wy_bwd` forms them itself with `chunk_wy.WY_STATE`)."""
    return dict(qg=nm.mm("nbhcv,nbhkv->nbhck", do, states), kg=nm.mm("nbhcv,nbhkv->nbhck", vn, dhs),
                decay=jnp.sum(states.astype(nm.sdt) * dhs, axis=-1))


# The cotangents of `prep`'s pieces that reach its pull-back (`chunk.settings(cotangents=...)`):
# "state" (float32, as the products accumulate them) or "compute" (for bf16 / f16 inputs, those of
# the pieces that are only matmul operands in the compute dtype, `_COMPUTE_PIECES`, rounded to it,
# the Mosaic reverse pass's state gradients written in it). "compute" moved 61.23 GB instead
# of 65.95 in the XLA ops of a forward+backward at 1,65536,16,128 (`benchmarks/xla_bytes.py
# --deviceless`) and took it from 21.17 to 19.95 ms on an H200
# (benchmarks/results/kda-levers-t65536-h200-20261205T0534.json); the gradients' relative errors
# against the token-serial reference rise by about 10% (bf16, T=1024, K=V=128, resets: dq 0.0032
# -> 0.0036, dg 0.0027 -> 0.0030; tolerances 0.008 / 0.02). The default. Since then it also forms
# dL = -Ai^T dAi Ai^T from compute-dtype operands (dAi's two products written in it too) and
# passes Aqk^T do to the Mosaic reverse pass in the compute dtype (50.97 -> 48.77 GB; errors
# within 1% at T = 512). Timed with those on an H100 at 1,65536,16,128 (o returned): 21.77 ms
# against "state"'s 24.35 (kda-t65536-stack-h100-20261205T1010.json).
COTANGENT_CHOICES = ("state", "compute")
COTANGENTS = "compute"
_COMPUTE_PIECES = ("qg", "kg", "kgam", "bv", "Aqk", "L")


def cotangents() -> str:
    if COTANGENTS not in COTANGENT_CHOICES:
        raise ValueError(f"chunk.COTANGENTS={COTANGENTS!r}; expected one of {COTANGENT_CHOICES}")
    return COTANGENTS


def _grad_scan(nm, dS, w, kg, decay, dS_out, dvn_intra, final_only=False, segments=1):
    """Reverse pass over chunks. dS: gradient of the final state. Returns (gradients of the
    outgoing states [N, B, H, K, V], of v' [N, B, H, C, V], of the initial state); segments and
    final_only as in `_state_scan`."""
    del final_only  # XLA drops the unused per-chunk outputs itself
    if segments > 1:
        return chunk_segments.per_segment(lambda *a: _grad_scan(nm, *a), segments, dS, w, kg, decay, dS_out,
                                          dvn_intra)

    def body(dS, x):
        w_n, kg_n, d_n, dSo_n, dvi_n = x
        dvn = dvi_n + nm.mm("bhck,bhkv->bhcv", kg_n, dS.astype(nm.cd))
        dS_prev = d_n[..., None] * dS + dSo_n
        if w_n is not None:
            dS_prev = dS_prev - nm.mm("bhck,bhcv->bhkv", w_n, dvn.astype(nm.cd))
        return dS_prev, (dS, dvn)

    dh0, (dhs, dvn) = jax.lax.scan(body, dS, (w, kg, decay, dS_out, dvn_intra), reverse=True)
    return dhs, dvn, dh0


chunk_core.defvjp(_core_fwd, _core_bwd)


def run_chunked(q, k, v, g, beta, *, scale, initial_state, segment_ids, bounded, delta, state_pass="xla",
                scores="dense"):
    """Pad T to a multiple of 64 (g = 0, beta = 0, q = k = v = 0 leave the state unchanged), chunk,
    run `chunk_core`, un-chunk. Canonical-form inputs; returns (o [B, T, H, V] in v's dtype, S).
    `scores` ("tiled" or "dense") picks the intra-chunk score formulation (`chunk_intra.prep`)."""
    # Module settings read while tracing are part of the jit cache key: a program traced under one
    # set of `traced_key()` is never reused under another (an unknown chunk_intra value raises here).
    return _run_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                        bounded=bounded, delta=delta, state_pass=state_pass, scores=scores,
                        traced_settings=traced_key())


@functools.partial(jax.jit, static_argnames=("scale", "bounded", "delta", "state_pass", "scores", "traced_settings"))
def _run_chunked(q, k, v, g, beta, *, scale, initial_state, segment_ids, bounded, delta, state_pass, scores,
                 traced_settings):
    del traced_settings  # only a cache key (see run_chunked)
    if state_pass not in STATE_PASSES:
        raise ValueError(f"state_pass={state_pass!r}; expected one of {STATE_PASSES}")
    if scores not in SCORES:
        raise ValueError(f"scores={scores!r}; expected one of {SCORES}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    sdt = state_dtype(q.dtype)
    N = -(-T // CHUNK)
    pad = N * CHUNK - T

    def chunked(x, dtype):
        x = x.astype(dtype)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return to_chunks(x)

    h0 = jnp.zeros((B, H, K, V), sdt) if initial_state is None else initial_state.astype(sdt)
    starts = segment_starts(segment_ids, T)
    counts = None
    if starts is not None:
        counts = segment_counts(jnp.pad(starts, [(0, 0), (0, pad)]))
    o, S = chunk_core(
        chunked(q, q.dtype),
        chunked(k, q.dtype),
        chunked(v, q.dtype),
        chunked(g, sdt),
        chunked(beta, sdt),
        h0,
        counts,
        scale,
        bounded,
        delta,
        state_pass,
        scores,
    )
    return from_chunks(o)[:, :T].astype(v.dtype), S


def use_bounded_path(lower_bound, dtype) -> bool:
    """The all-matmul diagonal tiles are exact only when g >= -5 (and not in float16)."""
    return lower_bound is not None and float(lower_bound) >= SAFE_LOWER_BOUND and jnp.dtype(dtype) != jnp.float16


# The score formulation when a caller does not pick one. "dense" is the one the H200 benchmarks
# measured; "tiled" reads fewer bytes on CPU's cost model and awaits a GPU timing
# (`python -m kernels.kda.pallas_gpu_bench --stages`, `benchmarks/kda.py --impls chunk_mosaic:tiled`).
DEFAULT_SCORES = "dense"


def default_scores() -> str:
    if DEFAULT_SCORES not in SCORES:
        raise ValueError(f"chunk.DEFAULT_SCORES={DEFAULT_SCORES!r}; expected one of {SCORES}")
    return DEFAULT_SCORES


def kda_impl(
    q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, output_final_state=True, state_pass="xla",
    scores=None,
):
    """Canonical-form chunked KDA: see `kernels.kda.kda` for the contract. `scores`: see
    `run_chunked` (None: `default_scores()`)."""
    del output_final_state  # the final state is a by-product of the scan
    return run_chunked(
        q,
        k,
        v,
        g,
        beta,
        scale=float(scale),
        initial_state=initial_state,
        segment_ids=segment_ids,
        bounded=use_bounded_path(lower_bound, q.dtype),
        delta=True,
        state_pass=state_pass,
        scores=default_scores() if scores is None else scores,
    )

"""The pull-back of `chunk_intra.prep`'s pieces in `chunk`'s backward: XLA's autodiff or the Mosaic
GPU kernel of `mosaic_prep_bwd` (`chunk.settings(prep_bwd=...)`)."""

from __future__ import annotations

import logging

import jax.numpy as jnp

from kernels.kda import chunk_intra

log = logging.getLogger(__name__)

# The pull-back of the intra-chunk pieces (`chunk.settings(prep_bwd=...)`): "xla" (autodiff of
# `chunk_intra.prep`), "mosaic" (`mosaic_prep_bwd`: one Mosaic GPU kernel per chunk, head and 64
# key channels), "interpret" (that kernel under the Mosaic GPU interpreter, for CPU tests) or
# "auto" (the kernel where the serial passes are Mosaic GPU kernels too, `state_pass="mosaic"`).
# The kernel takes the bounded delta-rule path (lower_bound >= -5) without segment resets, bf16
# inputs with the "compute" cotangents and K a multiple of 64; other calls take XLA's, with a
# logged reason when the kernel was asked for by name. "auto" is the default; with the kept pieces
# (`chunk.RESIDUALS`) it took the backward's XLA ops from 20.26 to 13.89 GB at 8,4096,16,128.
PREP_BWD_CHOICES = ("auto", "xla", "mosaic", "interpret")
PREP_BWD = "auto"
# Where the kernel's G (the chunk-local cumsum of g) comes from (`chunk.settings(prep_bwd_cumsum=...)`):
# "xla" (`chunk_intra.chunk_cumsum`, a GEMM reading g and writing G: 0.54 GB and 0.21 ms of a
# forward+backward at 8,4096,16,128 on an H100, `kda-profile-8x4096-h100-20261206T1011.json`) or
# "kernel" (the kernel reads g and forms G and its anchors on the tensor cores, g in three bf16
# parts; ptxas reports 100 bytes of spills for that kernel, none for the other). Timed beside "xla"
# on an H100 (kda-cumsum-fla-h100-20261206T1150.json), forward+backward 4.86 / 4.57 ms at
# 8,4096,16,128 and 9.89 / 10.15 at 1,65536,16,128 (level at the other two shapes): "xla" stays.
PREP_BWD_CUMSUM_CHOICES = ("xla", "kernel")
PREP_BWD_CUMSUM = "xla"
_prep_warned: set = set()


def prep_bwd_setting() -> tuple[str, str]:
    """(PREP_BWD, PREP_BWD_CUMSUM), checked: part of `chunk.traced_key`."""
    if PREP_BWD not in PREP_BWD_CHOICES:
        raise ValueError(f"chunk_prep_bwd.PREP_BWD={PREP_BWD!r}; expected one of {PREP_BWD_CHOICES}")
    if PREP_BWD_CUMSUM not in PREP_BWD_CUMSUM_CHOICES:
        raise ValueError(f"chunk_prep_bwd.PREP_BWD_CUMSUM={PREP_BWD_CUMSUM!r}; expected one of "
                         f"{PREP_BWD_CUMSUM_CHOICES}")
    return PREP_BWD, PREP_BWD_CUMSUM


def prep_bwd_mode(nm, K, bounded, delta, counts, state_pass, compute_cotangents) -> str | None:
    """The kernel mode ("mosaic" or "interpret") that pulls the pieces back, or None for XLA
    (`nm` the call's `chunk._Numerics`; `compute_cotangents`: `chunk.COTANGENTS` is "compute")."""
    mode = prep_bwd_setting()[0]
    if mode == "auto":
        mode = "mosaic" if state_pass == "mosaic" else "xla"
    elif mode != "xla":
        from kernels.kda.hopper import check_kernel_setting

        check_kernel_setting("chunk_prep_bwd.PREP_BWD", mode)
    if mode == "xla":
        return None
    from kernels.kda import mosaic_prep_bwd

    reason = (None if bounded and delta else "it takes the bounded delta-rule path (lower_bound >= -5) only")
    reason = reason or (None if counts is None else "segment resets are not supported")
    reason = reason or (None if compute_cotangents else "it takes the 'compute' cotangents only")
    reason = reason or mosaic_prep_bwd.supported(K, nm.cd)
    if reason is None:
        return mode
    if PREP_BWD != "auto" and reason not in _prep_warned:
        _prep_warned.add(reason)
        log.warning("chunk_prep_bwd.PREP_BWD=%r runs XLA's pull-back: %s", PREP_BWD, reason)
    return None


def kernel_pull_back(q, k, v, g, beta, ct, *, scale, interpret):
    """`prep`'s VJP on the bounded delta-rule path by `mosaic_prep_bwd.prep_bwd` (bv's term in
    XLA, or as the WY kernel gives it in `ct`: "dv", "dbeta_v"): the cotangents (dq, dk, dv, dg,
    dbeta) of the chunked inputs from the pieces' `ct`."""
    from kernels.kda import mosaic_prep_bwd

    N, B, H = q.shape[:3]
    flat = lambda x: x.reshape(N, B * H, *x.shape[3:])  # noqa: E731
    back = lambda x: x.reshape(N, B, H, *x.shape[2:])  # noqa: E731
    # q, k, G in and dq, dk, dg out in the token-major layout [B, T, H, K]: the callers chunk the
    # inputs and un-chunk the gradients, and XLA cancels those transposes against these (at
    # 8,4096,16,128 six of them, 2.15 GB of a forward+backward's XLA ops by the deviceless count).
    tok = chunk_intra.from_chunks
    in_kernel = prep_bwd_setting()[1] == "kernel"
    G = tok(g if in_kernel else chunk_intra.chunk_cumsum(g))
    dq, dk, dg, db = mosaic_prep_bwd.prep_bwd(
        tok(q), tok(k), G, flat(beta), flat(ct["decay"]), flat(ct["Aqk"]), flat(ct["L"]), flat(ct["qg"]),
        flat(ct["kg"]), flat(ct["kgam"]), scale=scale, interpret=interpret, heads=H,
        dLT=flat(ct["LT"]) if "LT" in ct else None, dAT=flat(ct["AqkT"]) if "AqkT" in ct else None,
        cumsum=in_kernel)
    chunks = chunk_intra.to_chunks
    if "dv" in ct:  # v's cotangent and beta's v term from the WY kernel (`chunk_wy.pull_back(token_values=True)`)
        dv, dbeta = chunks(ct["dv"]).astype(v.dtype), back(db) + ct["dbeta_v"]
    else:
        dbv = ct["bv"]
        dv = (beta[..., None] * dbv).astype(v.dtype)
        dbeta = back(db) + jnp.sum(dbv * v.astype(dbv.dtype), axis=-1)
    return (chunks(dq).astype(q.dtype), chunks(dk).astype(k.dtype), dv, chunks(dg).astype(g.dtype),
            dbeta.astype(beta.dtype))

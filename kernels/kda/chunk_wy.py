"""The pull-back of the chunked delta rule's WY form (`chunk.py`'s backward), as XLA ops or as the
Mosaic GPU kernel of `mosaic_wy_bwd.py`.

Per chunk, v' = u - w S_n with u = Ai bv, w = Ai kgam and Ai = (I + L)^{-1}; given dv' (from the
reverse state pass) and the incoming state S_n, the cotangents of bv, kgam and L are
    dw = -dv' S_n^T,  dAi = dv' bv^T + dw kgam^T,
    d bv = Ai^T dv',  d kgam = Ai^T dw,  d L = -Ai^T dAi Ai^T.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from kernels.kda.hopper import check_kernel_setting

log = logging.getLogger(__name__)


def wy_bwd_reference(nm, dvn, states, Ai, v, beta, kgam, compact):
    """The WY form's pull-back as XLA ops: v' = u - w S_n, u = Ai bv, w = Ai kgam, Ai = (I + L)^{-1}.
    dvn [.., C, V], states [.., K, V], Ai [.., C, C], v [.., C, V], beta [.., C], kgam [.., C, K] ->
    the cotangents of bv = beta v, kgam and L (state dtype). `compact`: dAi and the product inside
    dL in the compute dtype (see `chunk.cotangents()`), else dL's two products at full precision."""
    dw = -nm.mm("...cv,...kv->...ck", dvn, states)
    bv = beta[..., None] * v.astype(nm.sdt)  # as `prep` forms it
    dai_dt = nm.cd if compact else None  # compact: dAi is only an operand of dL's compute-dtype products
    dAi = (nm.mm("...rv,...cv->...rc", dvn, bv, out=dai_dt) + nm.mm("...rk,...ck->...rc", dw, kgam, out=dai_dt))
    d_bv = nm.mm("...rc,...rv->...cv", Ai, dvn)
    d_kgam = nm.mm("...rc,...rk->...ck", Ai, dw)
    if compact:  # L's cotangent is rounded to the compute dtype later: its products take it too
        dL = -nm.mm("...sr,...sc->...rc", Ai, nm.mm("...sm,...cm->...sc", dAi, Ai, out=nm.cd))
    else:
        dL = -nm.mm_fine("...sr,...sc->...rc", Ai, nm.mm_fine("...sm,...cm->...sc", dAi, Ai))
    return d_bv, d_kgam, dL


# How the pull-back runs (`chunk.settings(wy_bwd=...)`): "xla" (`wy_bwd_reference`, seven
# batched GEMMs through HBM), "mosaic" (`mosaic_wy_bwd`, one Mosaic GPU program per chunk holding
# the intermediates in SMEM; "interpret" runs it under the Mosaic GPU interpreter, for CPU tests)
# or "auto" (the kernel when the backward's serial passes run compiled on Mosaic GPU, i.e.
# impl="chunk_mosaic" / "pallas_gpu" on Hopper; the XLA ops otherwise, impl="chunk" included).
# The kernel takes the "compute" cotangents of bf16 / f16 inputs with K, V in {64, 128}; other
# calls run the XLA ops (logged once per reason). On an H100, forward+backward with the kernel
# against the XLA ops: 9.53 / 9.86 ms at 8,4096,16,128, 9.52 / 9.89 at 2,16384,16,128,
# 18.71 / 19.26 at 4,8192,32,128, 20.71 / 21.35 at 1,65536,16,128; the pull-back alone 0.59 /
# 1.19 ms at 8,4096,16,128 (kda-fla-wybwd-h100-20261205T21{30,32}.json,
# stages-wy-bwd-h100-20261205T2130.json). "auto" is the default.
WY_BWD_CHOICES = ("auto", "xla", "mosaic", "interpret")
WY_BWD = "auto"
_wy_warned: set = set()
# How the kernel walks the chunks (`chunk.settings(wy_form=...)`): "per_chunk" (one program per
# chunk, every input loaded at once: 104 KiB of SMEM at K = V = 128, two programs per SM) or
# "persistent" (one program per SM walking chunks p, p + SMs, ... through two SMEM slots, the next
# chunk's inputs loading while one computes: 217 KiB). On an H100 the per-chunk form was the faster:
# 0.606 against 0.647 ms alone at 8,4096,16,128, 9.71 against 9.75 ms forward+backward
# (stages-wy-forms-h100-20261205T2150.json, kda-wyform-h100-20261205T2151.json).
WY_FORMS = ("per_chunk", "persistent")
WY_FORM = "per_chunk"
# Where the state products' cotangents dqg = do S_n^T, dkg = v' dhs^T and d decay = sum_v S_n dhs
# are formed when the kernel runs (`chunk.settings(wy_state=...)`): "xla" (two GEMMs and a
# reduction, each reading S_n or dhs again) or "kernel" (the per-chunk kernel forms them beside
# dw from the S_n it reads anyway and dhs, do, v'; 112 KiB of SMEM at K = V = 128 by its
# scratch's sum, under the two-per-SM limit; 243 registers, no spills). XLA ops of a
# forward+backward at 8,4096,16,128 24.02 -> 22.41 GB, kernel operands 2.86 -> 3.67
# (xla-bytes-deviceless-wy-state-8x4096-20261205.json). Timed together with the other two
# kernel-side levers (`chunk_segments.GRAD_INTRA` says how): 4.5%-8.9% faster forward+backward at
# the four benchmark shapes on an H100. "kernel" is the default.
WY_STATES = ("xla", "kernel")
WY_STATE = "kernel"


def wy_bwd_setting() -> tuple[str, str, str]:
    """(WY_BWD, WY_FORM, WY_STATE), checked: part of `chunk.traced_key`."""
    for name, value, choices in (("WY_BWD", WY_BWD, WY_BWD_CHOICES), ("WY_FORM", WY_FORM, WY_FORMS),
                                 ("WY_STATE", WY_STATE, WY_STATES)):
        if value not in choices:
            raise ValueError(f"chunk_wy.{name}={value!r}; expected one of {choices}")
    if WY_STATE == "kernel" and WY_FORM != "per_chunk":
        raise ValueError("chunk_wy.WY_STATE='kernel' runs in the per_chunk form, not WY_FORM='persistent'")
    return WY_BWD, WY_FORM, WY_STATE


def wy_bwd_mode(state_pass: str | None = None) -> str:
    """The resolved setting ("xla", "mosaic" or "interpret"); "auto" follows the backward's serial
    pass `state_pass` (one of `chunk.STATE_PASSES`; None: not known, the XLA ops)."""
    if wy_bwd_setting()[0] == "auto":
        return "mosaic" if state_pass == "mosaic" else "xla"
    return WY_BWD


def pull_back(nm, dvn, states, Ai, v, beta, kgam, compact, state_pass: str | None = None, *, do=None, vn=None,
              dhs=None, intra_form=False, dl_transposed=False, score_cotangents=False, token_values=False) -> dict:
    """The cotangents of the pieces bv, kgam and L (state dtype) as `WY_BWD` says, by piece name;
    arguments as `wy_bwd_reference`'s, and the backward's serial pass for "auto". With do, vn (v')
    and dhs in the compute dtype, where the kernel runs with WY_STATE "kernel", also those of qg,
    kg and decay (the caller forms any it does not get). `intra_form`: Ai holds Ai^T and kgam
    holds k exp(G), as the intra-chunk kernel writes them (`mosaic_wy_bwd.wy_bwd`'s intra_form).
    `dl_transposed`: where the kernel runs, L's cotangent comes masked to its strictly lower part
    and its transpose as "LT" too (for `mosaic_prep_bwd`; the XLA ops give "L" alone).
    `score_cotangents`: where the kernel forms the state products, also Aqk's cotangent do v'^T
    masked to r >= c and its transpose, as "Aqk" and "AqkT" (the caller forms them otherwise).
    `token_values`: where the kernel runs, it reads v (and do) in the inputs' [B, T, H, V] layout and gives
    v's cotangent there ("dv", = beta d bv, in the compute dtype) and beta's term sum_v d bv v
    ("dbeta_v", [N, B, H, C]) instead of "bv"."""
    names = ("bv", "kgam", "L")
    mode = wy_bwd_mode(state_pass)

    def reference():
        ai, kg = Ai, kgam
        if intra_form:
            ai, kg = jnp.swapaxes(Ai, -1, -2), beta[..., None] * kgam.astype(beta.dtype)
        return dict(zip(names, wy_bwd_reference(nm, dvn, states, ai, v, beta, kg, compact)))

    if mode == "xla":
        return reference()
    from kernels.kda import mosaic_wy_bwd

    if WY_BWD != "auto":  # "auto" follows a serial pass the caller already compiles as a kernel
        check_kernel_setting("chunk_wy.WY_BWD", mode)
    reason = None if compact else "the kernel forms the 'compute' cotangents of bf16 / f16 inputs only"
    reason = reason or mosaic_wy_bwd.unsupported_reason(states.shape[-2], states.shape[-1], nm.cd)
    if reason:
        if reason not in _wy_warned:
            _wy_warned.add(reason)
            log.warning("chunk_wy.WY_BWD=%r runs the XLA ops: %s", WY_BWD, reason)
        return reference()
    state = wy_bwd_setting()[2] == "kernel" and do is not None
    more = dict(do=do.astype(nm.cd), vn=vn.astype(nm.cd), dhs=dhs.astype(nm.cd)) if state else {}
    scores = score_cotangents and state
    if token_values:  # the chunking transposes the caller applied to v and do cancel against these
        from kernels.kda.chunk_intra import from_chunks

        v = from_chunks(v)
        if state:
            more["do"] = from_chunks(more["do"])
    outs = mosaic_wy_bwd.wy_bwd(dvn.astype(nm.cd), states.astype(nm.cd), Ai, v, beta, kgam,
                                interpret=mode == "interpret", form=WY_FORM, intra_form=intra_form,
                                dl_transposed=dl_transposed, score_cotangents=scores, token_values=token_values,
                                **more)
    names = ("dv" if token_values else "bv",) + names[1:] + (("qg", "kg", "decay") if state else ())
    names += (("LT",) if dl_transposed else ()) + (("Aqk", "AqkT") if scores else ())
    names += ("dbeta_v",) if token_values else ()
    assert len(names) == len(outs), (names, len(outs))
    return {name: o if name == "dv" else o.astype(nm.sdt) for name, o in zip(names, outs)}

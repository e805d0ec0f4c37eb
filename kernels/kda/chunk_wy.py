"""The pull-back of the chunked delta rule's WY form (`chunk.py`'s backward), as XLA ops or as the
Mosaic GPU kernel of `mosaic_wy_bwd.py`.

Per chunk, v' = u - w S_n with u = Ai bv, w = Ai kgam and Ai = (I + L)^{-1}; given dv' (from the
reverse state pass) and the incoming state S_n, the cotangents of bv, kgam and L are
    dw = -dv' S_n^T,  dAi = dv' bv^T + dw kgam^T,
    d bv = Ai^T dv',  d kgam = Ai^T dw,  d L = -Ai^T dAi Ai^T.
"""

from __future__ import annotations

import logging

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


# How the pull-back runs (`chunk.settings(wy_bwd=...)`): "xla" (`wy_bwd_reference`,
# seven batched GEMMs through HBM) or "mosaic" (`mosaic_wy_bwd`, one Mosaic GPU program per chunk
# holding the intermediates in SMEM; "interpret" runs it under the Mosaic GPU interpreter, for CPU
# tests). The kernel takes the "compute" cotangents of bf16 / f16 inputs with K, V in {64, 128};
# other calls run the XLA ops (logged once per reason). Not yet timed on a GPU: off by default.
WY_BWD_CHOICES = ("xla", "mosaic", "interpret")
WY_BWD = "xla"
_wy_warned: set = set()


def wy_bwd_mode() -> str:
    if WY_BWD not in WY_BWD_CHOICES:
        raise ValueError(f"chunk_wy.WY_BWD={WY_BWD!r}; expected one of {WY_BWD_CHOICES}")
    return WY_BWD


def pull_back(nm, dvn, states, Ai, v, beta, kgam, compact):
    """The cotangents of bv, kgam and L (state dtype), as `WY_BWD` says; arguments as
    `wy_bwd_reference`'s."""
    mode = wy_bwd_mode()
    if mode == "xla":
        return wy_bwd_reference(nm, dvn, states, Ai, v, beta, kgam, compact)
    from kernels.kda import mosaic_wy_bwd

    check_kernel_setting("chunk_wy.WY_BWD", mode)
    reason = None if compact else "the kernel forms the 'compute' cotangents of bf16 / f16 inputs only"
    reason = reason or mosaic_wy_bwd.unsupported_reason(states.shape[-2], states.shape[-1], nm.cd)
    if reason:
        if reason not in _wy_warned:
            _wy_warned.add(reason)
            log.warning("chunk_wy.WY_BWD=%r runs the XLA ops: %s", mode, reason)
        return wy_bwd_reference(nm, dvn, states, Ai, v, beta, kgam, compact)
    outs = mosaic_wy_bwd.wy_bwd(dvn.astype(nm.cd), states.astype(nm.cd), Ai, v, beta, kgam,
                                interpret=mode == "interpret")
    return tuple(o.astype(nm.sdt) for o in outs)

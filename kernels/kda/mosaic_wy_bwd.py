"""Mosaic GPU kernel for the backward of the chunked delta rule's WY form, one program per chunk.

`chunk.py`'s backward pulls the gradient of the corrected values v' = u - w S_n (u = Ai bv,
w = Ai kgam, Ai = (I + L)^{-1}) back to the pieces bv, kgam and L. As XLA ops that is seven
batched [C, C] / [C, D] GEMMs per chunk, each reading its operands from HBM and writing its
result there. Here one program per (chunk, batch, head) loads dv' [C, V], S_n [K, V], Ai, v,
beta and kgam once (bv = beta v formed in place) and keeps every intermediate in SMEM (C = 64
rows; compute dtype operands, float32 accumulation on the tensor cores):

    dw     = -dv' S_n^T                      [C, K]
    dAi    = dv' bv^T + dw kgam^T            [C, C]
    d bv   = Ai^T dv'                        [C, V]
    d kgam = Ai^T dw                         [C, K]
    d L    = -Ai^T (dAi Ai^T)                [C, C]

the values of `chunk_wy.wy_bwd_reference` (its "compute" cotangents: operands and the three results
in the compute dtype; dAi is rounded once, after both of its products, where XLA rounds each).
K, V in {64, 128}; bf16 or f16 operands.

For the pieces' pull-back kernel (`mosaic_prep_bwd`) the per-chunk form with the state products
also writes Aqk's cotangent do v'^T masked, with its transpose (`score_cotangents`), and takes v
and do in the inputs' [B, T, H, V] layout, writing v's cotangent dv = beta d bv there with beta's
v term (`token_values`): with those the backward's only XLA op is the gate cumsum.

Two forms (`chunk_wy.WY_FORM`): one program per chunk with every input loaded at once (the
default: faster on an H100), or one persistent program per SM walking its chunks through two SMEM
slots, so that the next chunk's copies overlap this chunk's products (the per-chunk form leaves
that overlap to its two programs per SM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.chunk_wy import WY_FORMS
from kernels.kda.hopper import num_sms
from kernels.kda.mosaic_state import C, _mm, _smem, flat_grid, grid_indices
from kernels.lowering import lowered_once

_W = plgpu.Layout.WGMMA
DIMS = (64, 128)


def unsupported_reason(K: int, V: int, dtype) -> str | None:
    """Why the kernel cannot take these shapes / dtype (None: it can)."""
    if K not in DIMS or V not in DIMS:
        return f"K={K}, V={V}: the WY backward kernel takes K, V in {DIMS}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)}: the WY backward kernel takes bfloat16 or float16 operands"
    return None


# Input order of the copies (and of their barriers within a slot).
_INPUTS = ("dvn", "S", "Ai", "v", "beta", "kgam")  # the kernel's argument order


def _two(x, y):
    """Two products issued together (their latencies overlap), then both read: x, y = (result
    shape, a, b) -> (a_x b_x, a_y b_y) in float32."""
    def fn(acc_x, acc_y):
        plgpu.wgmma(acc_x, *x[1:])
        plgpu.wgmma(acc_y, *y[1:])
        return acc_x[...], acc_y[...]

    return pl.run_scoped(fn, plgpu.ACC(x[0], jnp.float32), plgpu.ACC(y[0], jnp.float32))


def _store(x, ref):
    """A value into SMEM in the ref's dtype, committed for the async proxy (wgmma, TMA)."""
    ref[...] = x.astype(ref.dtype)
    plgpu.commit_smem()


def _token_rows(ref, t, tok):
    """Chunk t's [C, D] block of a token-major [B, T, H, D] array (`tok` = (B H, H); t runs over the
    chunk-major [N, B, H] lead), or row t of a chunk-major one (`tok` None)."""
    if tok is None:
        return ref.at[t]
    bh_count, heads = tok
    n, bh = lax.div(t, bh_count), lax.rem(t, bh_count)
    return ref.at[lax.div(bh, heads), pl.ds(n * C, C), lax.rem(bh, heads)]


def _compute(t, bufs, wait, outs, *, dw_ready=False, intra_form=False, dlt_ref=None, tok=None, db_ref=None):
    """One chunk's pull-back from its inputs in SMEM into row t of the HBM outputs.

    bufs: dict of SMEM refs: the inputs by `_INPUTS` name, "mats" (dAi, X, dL; the per-chunk form
    keeps them in S's memory, written only after dw is formed) and "dw"; `dw_ready`: dw is in
    bufs["dw"] already (S is not read). wait(name) blocks until that input's copy landed; outs:
    (d bv, d kgam, d L) in HBM. Leaves the three stores in flight (one commit group each).
    `intra_form`: the inputs as the intra-chunk kernel writes them (`mosaic_intra_bf16`'s pieces):
    Ai^T in place of Ai and k exp(G) in place of kgam = beta k exp(G). `dlt_ref`: d L masked to
    its strictly lower part goes to outs[2] and its transpose, formed as -X^T Ai in dAi's memory,
    to dlt_ref (the operands the pieces' pull-back takes, `mosaic_prep_bwd`). `tok`: v and outs[0]
    are token-major (`_token_rows`), outs[0] takes dv = beta d bv and db_ref [P, C] beta's term
    sum_v d bv v (through bufs["db"]); v stays as loaded (dAi's bv^T product is v^T's, its columns
    scaled by beta after the product), so both are formed from it."""
    dvn_s, ai_s, bv_s, kg_s, beta_s, dw_s = (bufs[n] for n in ("dvn", "Ai", "v", "kgam", "beta", "dw"))
    dai_s, x_s, dl_s = bufs["mats"]
    dbv_ref, dkg_ref, dl_ref = outs
    V, K = bv_s.shape[-1], kg_s.shape[-1]
    if not dw_ready:  # dw = -dv' S^T: S [K, V] is the transposed operand (its rows are dw's columns)
        wait("dvn")
        wait("S")

        def dw_fn(acc):
            plgpu.wgmma(acc, dvn_s, bufs["S"].transpose((1, 0)))
            return acc[...]

    # bv = beta v in place of v, formed here: XLA would write it to HBM for this kernel to read.
    wait("v")
    wait("beta")
    beta = lax.broadcast_in_dim(plgpu.load(beta_s, layout=_W.reduce(1)), (C, V), [0])
    if tok is None:
        bv = plgpu.load(bv_s, layout=_W).astype(jnp.float32) * beta
    if not dw_ready:
        _store(-_mm(dw_fn, (C, K)), dw_s)
    if tok is None:
        _store(bv, bv_s)
    # dAi = dv' bv^T + dw kgam^T, one float32 accumulator, or with `tok` two (dv' v^T scaled by beta
    # after its product); S's memory now takes dAi.
    wait("kgam")
    if intra_form:  # kgam = beta k exp(G) in place, as bv
        beta_k = lax.broadcast_in_dim(plgpu.load(beta_s, layout=_W.reduce(1)), (C, K), [0])
        _store(plgpu.load(kg_s, layout=_W).astype(jnp.float32) * beta_k, kg_s)

    def dai_fn(acc):
        plgpu.wgmma(acc, dvn_s, bv_s.transpose((1, 0)))
        plgpu.wgmma(acc, dw_s, kg_s.transpose((1, 0)))
        return acc[...]

    if tok is None:
        _store(_mm(dai_fn, (C, C)), dai_s)
    else:  # dv' bv^T = (dv' v^T) diag(beta)
        p_v, p_k = _two(((C, C), dvn_s, bv_s.transpose((1, 0))), ((C, C), dw_s, kg_s.transpose((1, 0))))
        beta_c = lax.broadcast_in_dim(plgpu.load(beta_s, layout=_W.reduce(0)), (C, C), [1])
        _store(p_v * beta_c + p_k, dai_s)
    wait("Ai")
    ai_t = ai_s if intra_form else ai_s.transpose((1, 0))  # Ai^T: Ai as stored, the transposed operand
    # d bv = Ai^T dv' beside X = dAi Ai^T, then d kgam = Ai^T dw beside d L = -Ai^T X; d bv and
    # d kgam are written over bv and kgam (their last reads were dAi's).
    d_bv, X = _two(((C, V), ai_t, dvn_s), ((C, C), dai_s, ai_t))
    if tok is not None:  # beta's term from v as loaded, then dv = beta d bv over v
        bufs["db"][...] = jnp.sum(d_bv * plgpu.load(bv_s, layout=_W).astype(jnp.float32), axis=1)
        d_bv = d_bv * beta
    _store(d_bv, bv_s)
    plgpu.copy_smem_to_gmem(bv_s, _token_rows(dbv_ref, t, tok))
    if tok is not None:
        plgpu.copy_smem_to_gmem(bufs["db"], db_ref.at[t])
    _store(X, x_s)
    d_kgam, d_L = _two(((C, K), ai_t, dw_s), ((C, C), ai_t, x_s))
    _store(d_kgam, kg_s)
    plgpu.copy_smem_to_gmem(kg_s, dkg_ref.at[t])
    if dlt_ref is None:
        _store(-d_L, dl_s)
        plgpu.copy_smem_to_gmem(dl_s, dl_ref.at[t])
        return
    rows = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=_W)
    cols = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=_W)
    _store(jnp.where(rows > cols, -d_L, 0.0), dl_s)
    plgpu.copy_smem_to_gmem(dl_s, dl_ref.at[t])

    def dlt_fn(acc):  # d L^T = -X^T Ai (X, Ai as stored: their transposed views)
        plgpu.wgmma(acc, x_s.transpose((1, 0)), ai_s.transpose((1, 0)) if intra_form else ai_s)
        return acc[...]

    _store(jnp.where(cols > rows, -_mm(dlt_fn, (C, C)), 0.0), dai_s)  # dAi's last read was X's product
    plgpu.copy_smem_to_gmem(dai_s, dlt_ref.at[t])


def _body_state(*refs, P, intra_form=False, dl_t=False, d_aqk=False, tok=None):
    """One program per chunk that also forms the state products' cotangents before the WY
    pull-back: dqg = do S_n^T, dkg = v' dhs^T and d decay = sum_v S_n * dhs (float32), S_n and
    dhs [K, V] read once for all three and dw. Each input's memory passes to a later one once
    read (dhs's to the score cotangents and kgam, then v; S's to Ai and the [C, C] intermediates;
    v''s to dkg then dw; do's to dqg), so the program holds 112 KiB at K = V = 128: two per SM.
    `d_aqk`: also Aqk's cotangent do v'^T masked to r >= c and its transpose v' do^T (c >= r),
    issued beside dkg while do and v' are in SMEM (what `mosaic_prep_bwd.prep_bwd` takes)."""
    n_out = 6 + dl_t + 2 * d_aqk + (tok is not None)
    n_score = n_out - 2 - (tok is not None)  # the score cotangents' first output
    ins, outs, rest = refs[:9], refs[9:9 + n_out], refs[9 + n_out:]
    dvn_ref, s_ref, ai_ref, v_ref, beta_ref, kg_ref, do_ref, vn_ref, dhs_ref = ins
    dqg_ref, dkg_ref, dd_ref = outs[3:6]
    dvn_s, (mats, s_s), (v_kg, (da_s, dat_s), dhs_s), (do_s, dqg_s), (vn_s, dkw_s), beta_s, dd_s, db_s, bars = rest
    bv_s, kg_s = v_kg[0], v_kg[-1]
    ai_s, *mats = mats
    (t,) = grid_indices((P,))
    K, V = s_s.shape
    f32 = jnp.float32
    first = ((dvn_ref, dvn_s), (s_ref, s_s), (dhs_ref, dhs_s), (do_ref, do_s), (vn_ref, vn_s), (beta_ref, beta_s))
    for i, (src, dst) in enumerate(first):
        plgpu.copy_gmem_to_smem(_token_rows(src, t, tok) if src is do_ref else src.at[t], dst, bars.at[i])
    late = {"v": 6, "kgam": 7, "Ai": 8}
    index = {"dvn": 0, "beta": 5, **late}
    wait = lambda name: plgpu.barrier_wait(bars.at[index[name]])  # noqa: E731
    # d decay = sum_v S_n * dhs, 64 columns at a time (a whole [K, V] float32 pair would take 256
    # registers per thread).
    plgpu.barrier_wait(bars.at[1])
    plgpu.barrier_wait(bars.at[2])
    dd = None
    for j in range(V // 64):
        cols = pl.ds(j * 64, 64)
        prod = plgpu.load(s_s.at[:, cols], layout=_W).astype(f32) * plgpu.load(dhs_s.at[:, cols], layout=_W).astype(f32)
        dd = prod.sum(axis=1) if dd is None else dd + prod.sum(axis=1)
    _store(dd, dd_s)
    plgpu.copy_smem_to_gmem(dd_s, dd_ref.at[t])
    # dkg = v' dhs^T (with d_aqk beside it do v'^T and v' do^T); then dhs's memory takes kgam (and
    # the score cotangents, v after them), v''s the result.
    plgpu.barrier_wait(bars.at[4])

    def dkg_fn(acc):
        plgpu.wgmma(acc, vn_s, dhs_s.transpose((1, 0)))
        return acc[...]

    if d_aqk:
        plgpu.barrier_wait(bars.at[3])

        def three(acc_k, acc_a, acc_t):
            plgpu.wgmma(acc_k, vn_s, dhs_s.transpose((1, 0)))
            plgpu.wgmma(acc_a, do_s, vn_s.transpose((1, 0)))
            plgpu.wgmma(acc_t, vn_s, do_s.transpose((1, 0)))
            return acc_k[...], acc_a[...], acc_t[...]

        dkg, da, dat = pl.run_scoped(three, plgpu.ACC((C, K), f32), plgpu.ACC((C, C), f32), plgpu.ACC((C, C), f32))
        rows = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=_W)
        cols = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=_W)
        da_s[...] = jnp.where(rows >= cols, da, 0.0).astype(da_s.dtype)
        _store(jnp.where(cols >= rows, dat, 0.0), dat_s)
        plgpu.copy_smem_to_gmem(da_s, outs[n_score].at[t])
        plgpu.copy_smem_to_gmem(dat_s, outs[n_score + 1].at[t])
    else:
        dkg = _mm(dkg_fn, (C, K))
        plgpu.copy_gmem_to_smem(_token_rows(v_ref, t, tok), bv_s, bars.at[late["v"]])
    plgpu.copy_gmem_to_smem(kg_ref.at[t], kg_s, bars.at[late["kgam"]])
    _store(dkg, dkw_s)
    plgpu.copy_smem_to_gmem(dkw_s, dkg_ref.at[t])
    # dqg = do S^T beside dw = -dv' S^T; then S's memory takes Ai, do's the result.
    wait("dvn")
    if not d_aqk:  # (a barrier is waited on once: a second wait would wait for a next phase)
        plgpu.barrier_wait(bars.at[3])
    s_t = s_s.transpose((1, 0))
    dqg, dw = _two(((C, K), do_s, s_t), ((C, K), dvn_s, s_t))
    plgpu.copy_gmem_to_smem(ai_ref.at[t], ai_s, bars.at[late["Ai"]])
    _store(dqg, dqg_s)
    plgpu.copy_smem_to_gmem(dqg_s, dqg_ref.at[t])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # every earlier copy (d decay, dkg, the scores') has read its SMEM
    if d_aqk:  # v in the score cotangents' place
        plgpu.copy_gmem_to_smem(_token_rows(v_ref, t, tok), bv_s, bars.at[late["v"]])
    _store(-dw, dkw_s)
    bufs = dict(dvn=dvn_s, Ai=ai_s, v=bv_s, kgam=kg_s, beta=beta_s, dw=dkw_s, mats=tuple(mats), db=db_s)
    _compute(t, bufs, wait, outs[:3], dw_ready=True, intra_form=intra_form, dlt_ref=outs[6] if dl_t else None,
             tok=tok, db_ref=outs[-1])
    plgpu.wait_smem_to_gmem(0)


def _inputs_scratch(K, V, dt, lead=()):
    """The SMEM of one chunk's inputs (`lead` (2,): two slots of them), in `_INPUTS` order."""
    return [
        _smem((*lead, C, V), dt),  # dv'
        _smem((*lead, K, V), dt),  # S_n
        _smem((*lead, C, C), dt),  # Ai
        _smem((*lead, C, V), dt),  # v, then bv, then d bv
        plgpu.SMEM((*lead, C), jnp.float32),  # beta
        _smem((*lead, C, K), dt),  # kgam, then d kgam
    ]


def _body(*refs, P, intra_form=False, dl_t=False, tok=None):
    """One program per chunk: every input copied at once, then `_compute`."""
    n_out = 3 + dl_t + (tok is not None)
    ins, outs, rest = refs[:6], refs[6:6 + n_out], refs[6 + n_out:]
    dvn_s, (mats, s_s), ai_s, v_s, beta_s, kg_s, dw_s, db_s, bars = rest
    (t,) = grid_indices((P,))
    bufs = dict(dvn=dvn_s, S=s_s, Ai=ai_s, v=v_s, beta=beta_s, kgam=kg_s, mats=tuple(mats), dw=dw_s, db=db_s)
    for i, name in enumerate(_INPUTS):
        src = _token_rows(ins[i], t, tok) if name == "v" else ins[i].at[t]
        plgpu.copy_gmem_to_smem(src, bufs[name], bars.at[i])
    _compute(t, bufs, lambda name: plgpu.barrier_wait(bars.at[_INPUTS.index(name)]), outs[:3], intra_form=intra_form,
             dlt_ref=outs[3] if dl_t else None, tok=tok, db_ref=outs[-1])
    plgpu.wait_smem_to_gmem(0)


def _body_persistent(*refs, P, programs, intra_form=False, dl_t=False, tok=None):
    """`programs` persistent programs; program p takes chunks p, p + programs, ... through two
    SMEM slots: chunk j + 1's inputs load while chunk j computes."""
    n_out = 3 + dl_t + (tok is not None)
    ins, outs, rest = refs[:6], refs[6:6 + n_out], refs[6 + n_out:]
    slotted, mats, dw_s, db_s, bars = rest[:6], rest[6:9], rest[9], rest[10], rest[11]
    pid = lax.axis_index("t")
    J = -(-P // programs)  # chunks of program 0; the others may have one fewer
    n = len(_INPUTS)

    def issue(j, slot):
        t = pid + j * programs
        for i, name in enumerate(_INPUTS):
            src = _token_rows(ins[i], t, tok) if name == "v" else ins[i].at[t]
            plgpu.copy_gmem_to_smem(src, slotted[i].at[slot], bars.at[n * slot + i])

    def step(j, carry):
        @pl.when(pid + j * programs < P)
        def _():
            slot = lax.rem(j, 2)
            # The other slot, and the [C, C] intermediates, held chunk j - 1, whose three stores
            # were just issued: wait until they have read the SMEM, then fill the slot with j + 1.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(pid + (j + 1) * programs < P)
            def _():
                issue(j + 1, 1 - slot)

            bufs = dict(zip(_INPUTS, (r.at[slot] for r in slotted)), mats=tuple(mats), dw=dw_s, db=db_s)
            wait = lambda name: plgpu.barrier_wait(bars.at[n * slot + _INPUTS.index(name)])  # noqa: E731
            _compute(pid + j * programs, bufs, wait, outs[:3], intra_form=intra_form,
                     dlt_ref=outs[3] if dl_t else None, tok=tok, db_ref=outs[-1])

        return carry

    issue(0, 0)  # programs <= P: every program has chunk 0
    lax.fori_loop(0, J, step, 0)
    plgpu.wait_smem_to_gmem(0)


@lowered_once("form", "programs", "interpret", "intra_form", "dl_t", "d_aqk", "heads")
def _wy_bwd(dvn, states, Ai, v, beta, kgam, *extra, form, programs, interpret, intra_form=False, dl_t=False,
            d_aqk=False, heads=None):
    """extra: () or (do, vn, dhs), the per-chunk form with the state products (`_body_state`).
    `heads`: v [B, T, H, V] token-major (chunks in [N, B, H] order), dv out in its layout."""
    P, _, V = dvn.shape
    K = states.shape[-2]
    dt = dvn.dtype
    sds = lambda *s, dtype=dt: jax.ShapeDtypeStruct((P, *s), dtype)  # noqa: E731
    tok = None if heads is None else (v.shape[0] * heads, heads)
    out_type = (sds(C, V) if tok is None else jax.ShapeDtypeStruct(v.shape, dt), sds(C, K), sds(C, C))
    mats = lambda n: tuple(_smem((C, C), dt) for _ in range(n))  # noqa: E731
    if extra:
        pad = (_smem((C, 2 * C - V), dt),) if V < 2 * C else ()  # kgam after both score cotangents
        scratch = [
            _smem((C, V), dt),  # dv'
            plgpu.RefUnion(mats(4), _smem((K, V), dt)),  # S_n, then Ai, dAi, X, dL
            # dhs, then kgam and the score cotangents (two [C, C]), then v in their place
            plgpu.RefUnion((_smem((C, V), dt), *pad, _smem((C, K), dt)), (_smem((C, C), dt), _smem((C, C), dt)),
                           _smem((K, V), dt)),
            plgpu.RefUnion(_smem((C, V), dt), _smem((C, K), dt)),  # do, then dqg
            plgpu.RefUnion(_smem((C, V), dt), _smem((C, K), dt)),  # v', then dkg, then dw
            plgpu.SMEM((C,), jnp.float32),  # beta
            plgpu.SMEM((K,), jnp.float32),  # d decay
            plgpu.SMEM((C,), jnp.float32),  # beta's v term
            plgpu.Barrier(num_barriers=9),
        ]
        out_type += (sds(C, K), sds(C, K), sds(K, dtype=jnp.float32))
        body = functools.partial(_body_state, P=P, intra_form=intra_form, dl_t=dl_t, d_aqk=d_aqk, tok=tok)
        grid = flat_grid((P,))
    elif form == "persistent":
        programs = min(programs or num_sms(), P)
        # two slots of inputs; one set of the [C, C] intermediates (dAi, X, dL) and of dw
        scratch = _inputs_scratch(K, V, dt, (2,)) + list(mats(3)) + [
            _smem((C, K), dt), plgpu.SMEM((C,), jnp.float32), plgpu.Barrier(num_barriers=2 * len(_INPUTS))]
        body = functools.partial(_body_persistent, P=P, programs=programs, intra_form=intra_form, dl_t=dl_t,
                                 tok=tok)
        grid = dict(grid=(programs,), grid_names=("t",))
    else:
        scratch = _inputs_scratch(K, V, dt)  # S's memory in a union with dAi, X, dL (made after dw)
        scratch[1] = plgpu.RefUnion(mats(3), scratch[1])
        scratch += [_smem((C, K), dt), plgpu.SMEM((C,), jnp.float32), plgpu.Barrier(num_barriers=len(_INPUTS))]
        body = functools.partial(_body, P=P, intra_form=intra_form, dl_t=dl_t, tok=tok)
        grid = flat_grid((P,))
    out_type += (sds(C, C),) if dl_t else ()
    out_type += (sds(C, C), sds(C, C)) if d_aqk else ()
    out_type += (sds(C, dtype=jnp.float32),) if tok else ()
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        **grid,
        kernel_name="kda_wy_bwd",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(dvn, states, Ai, v, beta, kgam, *extra)


def wy_bwd(dvn, states, Ai, v, beta, kgam, *, interpret=False, form=None, programs=None, do=None, vn=None,
           dhs=None, intra_form=False, dl_transposed=False, score_cotangents=False, token_values=False):
    """dvn [.., C, V], states [.., K, V], Ai [.., C, C], v [.., C, V], beta [.., C], kgam [.., C, K]
    (any leading dims, the same for all; matrices cast to dvn's dtype, beta to float32) -> (d bv
    [.., C, V], d kgam [.., C, K], d L [.., C, C]) in dvn's dtype, bv = beta v (rounded to dvn's
    dtype as a product operand). `interpret`: the Mosaic GPU interpreter (CPU tests); `form`: one
    of `chunk_wy.WY_FORMS` (default "per_chunk"); `programs`: the persistent form's program count
    (default the GPU's SM count). With do [.., C, V], vn (v') [.., C, V] and dhs [.., K, V] (the
    gradient of the outgoing state) too, per-chunk form only: also (dqg = do S^T [.., C, K],
    dkg = v' dhs^T [.., C, K] in dvn's dtype, d decay = sum_v S * dhs [.., K] float32).
    `intra_form`: Ai holds Ai^T and kgam holds k exp(G) (the kernel scales it by beta), as
    `mosaic_intra_bf16.intra_bf16(..., pieces=True)` writes them; the outputs are the same.
    `dl_transposed`: d L comes masked to its strictly lower part (r > c), and its transpose
    [.., C, C] after the other outputs (what `mosaic_prep_bwd.prep_bwd` takes). `score_cotangents`
    (with do, vn, dhs): last, the cotangent of the scores Aqk, do v'^T masked to r >= c, and its
    transpose [.., C, C] (XLA would write the product and two masked transposes of it).
    `token_values`: the leading dims are chunk-major [N, B, H] and v (and do, if given) come
    token-major [B, N C, H, V] (the inputs' layout, no chunking transpose); the first output is then
    dv = beta d bv [B, N C, H, V] (v's cotangent, in its layout) instead of d bv, and beta's term
    sum_v d bv v [N, B, H, C] float32 comes last."""
    form = "per_chunk" if form is None else form
    if form not in WY_FORMS:
        raise ValueError(f"form={form!r}; expected one of {WY_FORMS}")
    if programs is not None and programs < 1:
        raise ValueError(f"programs={programs}: the persistent form needs at least one program")
    extra = (do, vn, dhs)
    if any(x is not None for x in extra) and (any(x is None for x in extra) or form != "per_chunk"):
        raise ValueError("wy_bwd: the state products take do, vn and dhs together, in the per_chunk form")
    if score_cotangents and do is None:
        raise ValueError("wy_bwd: score_cotangents needs do, vn and dhs (the per-chunk form with the state products)")
    lead, V = dvn.shape[:-2], dvn.shape[-1]
    K = states.shape[-2]
    reason = unsupported_reason(K, V, dvn.dtype)
    if reason is not None:
        raise ValueError(reason)
    want = {"dvn": (C, V), "states": (K, V), "Ai": (C, C), "v": (C, V), "beta": (C,), "kgam": (C, K)}
    given = dict(zip(want, (dvn, states, Ai, v, beta, kgam)))
    heads = None
    if token_values:
        if len(lead) != 3 or v.shape != (lead[1], lead[0] * C, lead[2], V):
            raise ValueError(f"wy_bwd(token_values=True): v has shape {v.shape}; expected [B, N * {C}, H, V] "
                             f"for the chunk-major lead [N, B, H] = {list(lead)}")
        heads, v = lead[2], v.astype(dvn.dtype)
        given.pop("v")
        if do is not None and do.shape != v.shape:
            raise ValueError(f"wy_bwd(token_values=True): do has shape {do.shape}; expected v's {v.shape}")
    if do is not None:
        want.update(vn=(C, V), dhs=(K, V))
        given.update(vn=vn, dhs=dhs)
        if not heads:
            want["do"], given["do"] = (C, V), do
    for name, x in given.items():
        if x.shape != (*lead, *want[name]):
            raise ValueError(f"wy_bwd: {name} has shape {x.shape}; expected {(*lead, *want[name])}")
    dt = dvn.dtype
    flat = lambda x: x.astype(dt).reshape(-1, *x.shape[-2:])  # noqa: E731
    more = () if do is None else (do.astype(dt) if heads else flat(do), flat(vn), flat(dhs))
    outs = _wy_bwd(flat(dvn), flat(states), flat(Ai), v if heads else flat(v), beta.astype(jnp.float32).reshape(-1, C),
                   flat(kgam), *more, form=form, programs=programs, interpret=interpret, intra_form=bool(intra_form),
                   dl_t=bool(dl_transposed), d_aqk=bool(score_cotangents), heads=heads)
    return tuple(o if heads and i == 0 else o.reshape(*lead, *o.shape[1:]) for i, o in enumerate(outs))

"""Mosaic GPU kernels for the two serial passes of the chunked delta rule (`chunk.py`).

Both walk the chunks of one (batch*head, V-block) program in order, the carried [K, BV] matrix in
float32 registers (a wgmma accumulator), the chunk tensors streaming in by TMA, double-buffered.
BV (`chunk_segments.BLOCK_V`: 64, 32, 16 or "auto", read while tracing) sets the programs per (batch *
head): V / BV chains walk the chunks side by side, each with an N = BV product. On chunk arrays
[N, BH, ...] (chunk index first, as `chunk.py` keeps them; C = 64):

forward (`state_scan`), S_0 = h0:
    write S_n (compute dtype);  v'_n = u_n - w_n S_n (write, compute dtype)
    S_{n+1} = Diag(decay_n) S_n + kg_n^T v'_n
reverse (`grad_scan`), dS = dS_final, n = N-1 .. 0:
    write dS (the gradient of S_{n+1}, float32);  dv'_n = dvi_n + kg_n dS (write, compute dtype)
    dS <- Diag(decay_n) dS + qg_n^T do_n - w_n^T dv'_n
The reverse pass forms dS_out = qg^T do itself, so the [N, B, H, K, V] float32 tensor of the
pure-JAX backward never reaches HBM. Linear attention (w None) skips the w products.
Products are wgmma with operands in SMEM in the compute dtype and float32 accumulation, the
roundings of `chunk.py`'s XLA passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda import chunk_segments
from kernels.kda.hopper import SUPPORTED_DIMS
from kernels.kda.mosaic_state import _smem, check_segments, launch_bh_v, load_carried
from kernels.lowering import lowered_once

C = 64  # chunk length



def _store_last(x, smem, dst):
    """Write the carried [K, BV] float32 tile after the chunk loop: wait until the last chunk's
    stores have read `smem`, then `smem` -> `dst` in HBM."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0)



def _mm(fn, shape):
    return pl.run_scoped(fn, plgpu.ACC(shape, jnp.float32))


def _program(BH, NT):
    """(p, bh, first) of this program: p its (segment, batch * head) index, the carried tiles' row;
    bh the batch * head of its chunk tensors; first its segment's first chunk (NT chunks each)."""
    p = lax.axis_index("bh")
    return p, lax.rem(p, BH), lax.div(p, BH) * NT


def _loader(ins, bars, bh, vs, first, chunk_major=True):
    """issue(n, slot): TMA every input's chunk first + n into its buffer `slot` (barrier 2 i + slot);
    inputs [N, BH, ...], or [BH, N, ...] without `chunk_major`. An input's `by_v`: False (all of
    it), True (the program's V columns `vs`) or its own column slice. An input given with a fourth
    entry H is token-major instead, [B, N C, H, D] (BH = B H)."""

    def issue(n, slot):
        n = first + n
        for i, (src, dst, by_v, *tok) in enumerate(ins):
            if tok:
                src = src.at[lax.div(bh, tok[0]), pl.ds(n * C, C), lax.rem(bh, tok[0])]
            else:
                src = src.at[n, bh] if chunk_major else src.at[bh, n]
            src = src.at[:, by_v if isinstance(by_v, pl.Slice) else vs] if by_v is not False else src
            plgpu.copy_gmem_to_smem(src, dst.at[slot], bars.at[2 * i + slot])

    def wait(slot):
        for i in range(len(ins)):
            plgpu.barrier_wait(bars.at[2 * i + slot])

    return issue, wait


def walk_chunks(ins, bars, h_bar, carried, smem, *, BH, NT, BV, reverse, step, chunk_major=True, carried_first=False):
    """The chunk loop of one (segment, batch * head, V block) program: `ins` (src, SMEM buffer, by V)
    double-buffered by TMA, the carried [K, BV] float32 tile `carried(p, vs)` (HBM) loaded through
    `smem`, then x <- step(n, slot, x, at) for the NT chunks in order (`reverse`: last first), where
    `at` = (p, bh, first, vs) locates this program's tiles (`chunk_major`: see `_loader`).
    `carried_first`: the carried tile is read before the first chunk's loads are issued (`smem`
    may then share memory with an input's buffers). Returns (final x, at)."""
    p, bh, first = _program(BH, NT)
    vs = pl.ds(pl.multiple_of(lax.axis_index("v") * BV, BV), BV)
    issue, wait = _loader(ins, bars, bh, vs, first, chunk_major)
    x = load_carried(NT - 1 if reverse else 0, issue, carried(p, vs), smem, h_bar.at[0], carried_first=carried_first)
    at = (p, bh, first, vs)

    def body(i, x):
        n = NT - 1 - i if reverse else i
        slot = lax.rem(i, 2)

        @pl.when(n > 0 if reverse else n + 1 < NT)
        def _prefetch():
            issue(n - 1 if reverse else n + 1, 1 - slot)

        wait(slot)
        return step(n, slot, x, at)

    return lax.fori_loop(0, NT, body, x), at


def _outputs(refs, n_in, final_only):
    """(inputs, (per-chunk outputs or Nones, final), scratch) of a pass's refs; `final_only`: the
    kernel was launched with its final carried tile as the one output."""
    n_out = 1 if final_only else 3
    ins, outs, scratch = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
    return ins, ((None, None, outs[0]) if final_only else outs), scratch


def _fwd_body(*refs, NT, BH, K, BV, dt, delta, final_only, chunk_major=True, w_negated=False, u_shift=0):
    ins_refs, (st_ref, vn_ref, ht_ref), scratch = _outputs(refs, 5 if delta else 4, final_only)
    col0 = lax.axis_index("v") * BV
    # u_shift: the pass runs u_shift zero columns before u's (a segmented pass 1 without a widened
    # copy of u); those programs load u's first block, a valid address, and use zeros
    u_cols = pl.ds(pl.multiple_of(lax.max(col0 - u_shift, 0), BV), BV) if u_shift else True
    if delta:
        w_ref, u_ref, kg_ref, d_ref, h0_ref = ins_refs
        w_s, u_s, (kg_s, h_s), d_s, s_s, vn_s, bars, h_bar = scratch
        ins = ((w_ref, w_s, False), (u_ref, u_s, u_cols), (kg_ref, kg_s, False), (d_ref, d_s, False))
    else:
        u_ref, kg_ref, d_ref, h0_ref = ins_refs
        u_s, (kg_s, h_s), d_s, s_s, vn_s, bars, h_bar = scratch
        ins = ((u_ref, u_s, u_cols), (kg_ref, kg_s, False), (d_ref, d_s, False))

    def step(n, slot, S, at):
        _, bh, first, vs = at
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last chunk's stores have read s_s, vn_s
        s_s[...] = S.astype(dt)
        plgpu.commit_smem()
        if st_ref is not None:
            plgpu.copy_smem_to_gmem(s_s, st_ref.at[first + n, bh, :, vs])
        u = plgpu.load(u_s.at[slot], layout=plgpu.Layout.WGMMA)
        if u_shift:  # zeros in the shifted-in columns (a 0/1 factor: a select takes no scalar predicate here)
            u = (u.astype(jnp.float32) * (col0 >= u_shift).astype(jnp.float32)).astype(u.dtype)
        if delta:

            def wS(acc):
                plgpu.wgmma(acc, w_s.at[slot], s_s)
                return acc[...]

            prod = _mm(wS, (C, BV))
            vn = (u.astype(jnp.float32) + prod if w_negated else u.astype(jnp.float32) - prod).astype(dt)
        else:
            vn = u
        vn_s[...] = vn
        plgpu.commit_smem()
        if vn_ref is not None:
            plgpu.copy_smem_to_gmem(vn_s, vn_ref.at[first + n, bh, :, vs])
        d = plgpu.load(d_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))

        def kv(acc):
            plgpu.wgmma(acc, kg_s.at[slot].transpose((1, 0)), vn_s)
            return acc[...]

        return S * lax.broadcast_in_dim(d, S.shape, [0]) + _mm(kv, (K, BV))

    S, (p, _, _, vs) = walk_chunks(ins, bars, h_bar, lambda p, vs: h0_ref.at[p, :, vs], h_s, BH=BH, NT=NT, BV=BV,
                                   reverse=False, step=step, chunk_major=chunk_major, carried_first=True)
    _store_last(S, h_s, ht_ref.at[p, :, vs])  # the last step loaded nothing into kg's buffers


def _check_dims(name, Cc, K, V, BV):
    """K: a wgmma operand width; V: any multiple of the programs' BV columns (the segmented passes'
    width-(K + V) pass runs V = 256)."""
    if Cc != C or K not in SUPPORTED_DIMS or V % BV or V < BV:
        raise ValueError(f"{name} needs C={C}, K in {SUPPORTED_DIMS} and V a positive multiple of {BV}; "
                         f"got C={Cc}, K={K}, V={V}")


def state_scan(w, u, kg, decay, h0, *, interpret=False, final_only=False, segments=1, chunk_major=True,
               w_negated=False, u_shift=0):
    """Forward pass. w, kg [N, BH, C, K] (w None: linear attention, v' = u); u [N, BH, C, V]
    (one compute dtype); decay [N, BH, K] f32; h0 [segments * BH, K, V] f32: with segments > 1 every
    run of N / segments chunks starts from its own h0 (segment-major rows; `chunk_segments`).
    Returns (states [N, BH, K, V] compute dtype, v' [N, BH, C, V] compute dtype, final
    [segments * BH, K, V] f32); `final_only`: (None, None, final), the per-chunk outputs never written.
    Without `chunk_major` the inputs are [BH, N, ...] (the per-chunk outputs keep [N, BH, ...]);
    `w_negated`: w holds -w (as `pallas_gpu`'s intra kernels write it). `u_shift`: the pass runs
    as if u had that many zero columns first (a multiple of 64: h0 and the outputs are
    u_shift + V wide), the width-(K + V) pass 1 of `chunk_segments` without a widened copy of u."""
    BH = kg.shape[1] if chunk_major else kg.shape[0]
    width = u.shape[-1] + u_shift
    BV = chunk_segments.block_v(programs64=segments * BH * max(width // 64, 1))  # read while tracing
    if u_shift % 64 or u_shift < 0:
        raise ValueError(f"u_shift={u_shift} must be a non-negative multiple of 64")
    return _state_scan(w, u, kg, decay, h0, BV=BV, interpret=interpret, final_only=final_only, segments=segments,
                       chunk_major=bool(chunk_major), w_negated=bool(w_negated), u_shift=int(u_shift))


@lowered_once("BV", "interpret", "final_only", "segments", "chunk_major", "w_negated", "u_shift")
def _state_scan(w, u, kg, decay, h0, *, BV, interpret, final_only, segments, chunk_major=True, w_negated=False,
                u_shift=0):
    N, BH, Cc, K = kg.shape if chunk_major else (kg.shape[1], kg.shape[0], *kg.shape[2:])
    check_segments(N, segments, h0, BH)
    V = u.shape[-1] + u_shift
    dt = kg.dtype
    _check_dims("state_scan", Cc, K, V, BV)
    _smem_ = functools.partial(_smem, BV=BV)
    delta = w is not None
    # The carried tile's float32 [K, BV] shares kg's two buffers (read before the first load, written
    # after the last): 105 KiB at K = 128, BV = 64 in bf16, two programs per SM (137 KiB apart).
    kg_h = plgpu.RefUnion(_smem_((2, C, K), dt), plgpu.SMEM((K, BV), jnp.float32))
    ins = [_smem_((2, C, BV), dt), kg_h, plgpu.SMEM((2, K), jnp.float32)]
    if delta:
        ins = [_smem_((2, C, K), dt)] + ins
    scratch = ins + [
        _smem_((K, BV), dt),
        _smem_((C, BV), dt),
        plgpu.Barrier(num_barriers=2 * (4 if delta else 3)),
        plgpu.Barrier(num_barriers=1),
    ]
    final = jax.ShapeDtypeStruct((segments * BH, K, V), jnp.float32)
    out_type = (final,) if final_only else (
        jax.ShapeDtypeStruct((N, BH, K, V), dt), jax.ShapeDtypeStruct((N, BH, C, V), dt), final)
    args = ((w,) if delta else ()) + (u, kg, decay, h0)
    body = functools.partial(_fwd_body, NT=N // segments, BH=BH, K=K, BV=BV, dt=dt, delta=delta,
                             final_only=final_only, chunk_major=chunk_major, w_negated=w_negated, u_shift=u_shift)
    out = launch_bh_v(body, out_type, scratch, args, BH=segments * BH, V=V, BV=BV, interpret=interpret)
    return (None, None, out[0]) if final_only else out


def segment_starts(w, u, kg, decay, h0, segments, *, interpret=False, chunk_major=True, w_negated=False):
    """Each segment's starting state for a pass in `segments` segments: pass 1 (`state_scan` from
    [I | 0], u read in place through `u_shift`) and the scan over segments
    (`chunk_segments.segment_entries`). Operands as `state_scan` takes them; h0 [BH, K, V] f32.
    Returns (starts [segments * BH, K, V], final state [BH, K, V]), both float32."""
    BH, K, V = h0.shape

    def pass1(start):
        return state_scan(w, u, kg, decay, start.reshape(segments * BH, K, K + V), interpret=interpret,
                          final_only=True, segments=segments, chunk_major=chunk_major, w_negated=w_negated,
                          u_shift=K)[2].reshape(start.shape)

    starts, final = chunk_segments.segment_entries(pass1, h0[:, None], segments)
    return starts.reshape(segments * BH, K, V), final.reshape(BH, K, V)


def _bwd_body(*refs, NT, BH, K, BV, dt, delta, final_only, early, compact, aqk_in=False, aqk_t=False, do_heads=None):
    ins_refs, (dhs_ref, dvn_ref, dh0_ref), scratch = _outputs(refs, 7 if delta else 6, final_only)
    if delta:
        w_ref, kg_ref, qg_ref, do_ref, dvi_ref, d_ref, dS_ref = ins_refs
        w_s, kg_s, qg_s, do_s, dvi_s, d_s, ds_c, dvn_s, neg_s, ds_f, bars, h_bar = scratch
        ins = ((w_ref, w_s, False),)
    else:
        kg_ref, qg_ref, do_ref, dvi_ref, d_ref, dS_ref = ins_refs
        kg_s, qg_s, do_s, dvi_s, d_s, ds_c, dvn_s, ds_f, bars, h_bar = scratch
        ins = ()
    # `aqk_in`: the fifth input is Aqk [C, C] per chunk (all of V's blocks read it; Aqk^T with
    # `aqk_t`), else Aqk^T do.
    do_in = (do_ref, do_s, True) + ((do_heads,) if do_heads else ())  # `do_heads`: do as [B, T, H, V]
    ins += ((kg_ref, kg_s, False), (qg_ref, qg_s, False), do_in, (dvi_ref, dvi_s, not aqk_in),
            (d_ref, d_s, False))

    def step(n, slot, dS, at):
        _, bh, first, vs = at
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last chunk's stores have read ds_f, dvn_s

        def write_dS_f32():  # the float32 dS for the dhs output (no product of this step reads it)
            if dhs_ref is not None and not compact:
                ds_f[...] = dS

        def send_dhs():  # `compact`: dhs in the compute dtype, sent from the operand copy ds_c
            if dhs_ref is not None:
                plgpu.copy_smem_to_gmem(ds_c if compact else ds_f, dhs_ref.at[first + n, bh, :, vs])

        def kdS(acc):  # kg dS; `early`: dS's float32 copy is written and sent while it runs
            plgpu.wgmma(acc, kg_s.at[slot], ds_c)
            if early and dhs_ref is not None:
                write_dS_f32()
                plgpu.commit_smem()
                send_dhs()
            return acc[...]

        def write_dvn(dvn):
            if dvn_ref is not None:
                dvn_s[...] = dvn.astype(dt)
            if delta:
                neg_s[...] = (-dvn).astype(dt)  # rounding is symmetric: exactly -round(dv')

        def send_dvn():
            if dvn_ref is not None:
                plgpu.copy_smem_to_gmem(dvn_s, dvn_ref.at[first + n, bh, :, vs])

        def qg_do(acc):
            plgpu.wgmma(acc, qg_s.at[slot].transpose((1, 0)), do_s.at[slot])

        def dvi(slot):  # Aqk^T do, float32 or (compact) the compute dtype
            return plgpu.load(dvi_s.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)

        def dvn_of_dS():  # dv' = Aqk^T do + kg dS, float32
            if not aqk_in:
                return dvi(slot) + _mm(kdS, (C, BV))

            def both(acc):  # Aqk^T do does not wait on dS: issued first, into the same accumulator
                plgpu.wgmma(acc, dvi_s.at[slot] if aqk_t else dvi_s.at[slot].transpose((1, 0)), do_s.at[slot])
                return kdS(acc)

            return _mm(both, (C, BV))

        def w_dvn(acc):
            if delta:
                plgpu.wgmma(acc, w_s.at[slot].transpose((1, 0)), neg_s)

        def decayed():
            d = plgpu.load(d_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
            return dS * lax.broadcast_in_dim(d, dS.shape, [0])

        if early:  # qg^T do (it does not wait on dS) first; output copies and the decay while products run
            def step_dS(acc):
                qg_do(acc)
                ds_c[...] = dS.astype(dt)
                plgpu.commit_smem()
                dvn = dvn_of_dS()
                write_dvn(dvn)
                plgpu.commit_smem()
                w_dvn(acc)
                send_dvn()
                dS_decayed = decayed()
                return dS_decayed + acc[...]

            return _mm(step_dS, (K, BV))
        # in order: dS written, dv' formed and written, then decay dS + qg^T do - w^T dv'
        write_dS_f32()
        ds_c[...] = dS.astype(dt)
        plgpu.commit_smem()
        send_dhs()
        dvn = dvn_of_dS()
        write_dvn(dvn)
        plgpu.commit_smem()
        send_dvn()

        def back(acc):
            qg_do(acc)
            w_dvn(acc)
            return acc[...]

        return decayed() + _mm(back, (K, BV))

    dS, (p, _, _, vs) = walk_chunks(ins, bars, h_bar, lambda p, vs: dS_ref.at[p, :, vs], ds_f, BH=BH, NT=NT, BV=BV,
                                    reverse=True, step=step)
    _store_last(dS, ds_f, dh0_ref.at[p, :, vs])


def grad_scan(w, kg, qg, do, dvn_intra, decay, dS_final, *, interpret=False, final_only=False, segments=1,
              dhs_dtype=jnp.float32, aqk=None, aqk_transposed=False, do_heads=None):
    """Reverse pass. w, kg, qg [N, BH, C, K] (w None: linear attention) and do [N, BH, C, V] in one
    compute dtype; dvn_intra [N, BH, C, V] (Aqk^T do) in float32 or the compute dtype; decay
    [N, BH, K] f32; dS_final [segments * BH, K, V] f32 (segments > 1: each run of N / segments
    chunks ends with its own).
    Returns (gradients of the outgoing states [N, BH, K, V] f32, of v' [N, BH, C, V] compute dtype,
    of each run's initial state [segments * BH, K, V] f32); `final_only`: (None, None, that last),
    the per-chunk outputs never written. `dhs_dtype` float32 or the compute dtype: the latter
    writes the rounded copy the kg dS product reads (half the bytes). `aqk` [N, BH, C, C] in the
    compute dtype (delta rule only, with dvn_intra None): the pass forms Aqk^T do itself; with
    `aqk_transposed` it holds Aqk^T (as `mosaic_intra_bf16` writes it). `do_heads` = H: do comes
    in the inputs' layout [B, N C, H, V] (BH = B H), read there (no chunking transpose)."""
    if (aqk is None) == (dvn_intra is None):
        raise ValueError("grad_scan takes exactly one of dvn_intra (Aqk^T do) and aqk")
    if aqk is not None and w is None:
        raise ValueError("grad_scan: aqk is for the delta rule's pass (w given)")
    if do_heads is not None:
        N, BH = kg.shape[:2]
        if do.ndim != 4 or do.shape[0] * do_heads != BH or do.shape[1:3] != (N * C, do_heads):
            raise ValueError(f"grad_scan(do_heads={do_heads}): do has shape {do.shape}; expected [B, {N} * {C}, "
                             f"{do_heads}, V] with B * {do_heads} = {BH}")
    BV = chunk_segments.block_v(programs64=segments * kg.shape[1] * max(do.shape[-1] // 64, 1))  # read while tracing
    return _grad_scan(w, kg, qg, do, dvn_intra if aqk is None else aqk, decay, dS_final, BV=BV,
                      early=chunk_segments.grad_issue() == "early", interpret=interpret, final_only=final_only,
                      segments=segments, dhs_dtype=jnp.dtype(dhs_dtype), aqk_in=aqk is not None,
                      aqk_t=aqk is not None and bool(aqk_transposed), do_heads=do_heads)


@lowered_once("BV", "early", "interpret", "final_only", "segments", "dhs_dtype", "aqk_in", "aqk_t", "do_heads")
def _grad_scan(w, kg, qg, do, dvn_intra, decay, dS_final, *, BV, early, interpret, final_only, segments, dhs_dtype,
               aqk_in=False, aqk_t=False, do_heads=None):
    N, BH, Cc, K = kg.shape
    check_segments(N, segments, dS_final, BH)
    V = do.shape[-1]
    dt = kg.dtype
    for name, x in (("dhs_dtype", jnp.dtype(dhs_dtype)), ("dvn_intra's dtype", dvn_intra.dtype)):
        if jnp.dtype(x) not in (jnp.dtype(jnp.float32), jnp.dtype(dt)):
            raise ValueError(f"grad_scan: {name}={jnp.dtype(x)}; expected float32 or the compute dtype {dt}")
    _check_dims("grad_scan", Cc, K, V, BV)
    _smem_ = functools.partial(_smem, BV=BV)
    delta = w is not None
    f32 = jnp.float32
    scratch = [
        _smem_((2, C, K), dt),
        _smem_((2, C, K), dt),
        _smem_((2, C, BV), dt),
        _smem_((2, C, C), dt) if aqk_in else  # Aqk (wgmma operand), or Aqk^T do as read:
        plgpu.SMEM((2, C, BV), f32) if dvn_intra.dtype == f32 else _smem_((2, C, BV), dt),
        plgpu.SMEM((2, K), f32),
        _smem_((K, BV), dt),
        _smem_((C, BV), dt),
    ]
    if delta:
        scratch = [_smem_((2, C, K), dt)] + scratch + [_smem_((C, BV), dt)]
    n_in = 6 if delta else 5
    scratch += [plgpu.SMEM((K, BV), f32), plgpu.Barrier(num_barriers=2 * n_in), plgpu.Barrier(num_barriers=1)]
    first = jax.ShapeDtypeStruct((segments * BH, K, V), f32)
    out_type = (first,) if final_only else (
        jax.ShapeDtypeStruct((N, BH, K, V), dhs_dtype), jax.ShapeDtypeStruct((N, BH, C, V), dt), first)
    args = ((w,) if delta else ()) + (kg, qg, do, dvn_intra, decay, dS_final)
    body = functools.partial(_bwd_body, NT=N // segments, BH=BH, K=K, BV=BV, dt=dt, delta=delta,
                             final_only=final_only, early=early,
                             compact=jnp.dtype(dhs_dtype) != jnp.dtype(f32), aqk_in=aqk_in, aqk_t=aqk_t,
                             do_heads=do_heads)
    out = launch_bh_v(body, out_type, scratch, args, BH=segments * BH, V=V, BV=BV, interpret=interpret)
    return (None, None, out[0]) if final_only else out


def _flat(x):
    return None if x is None else x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _unflat(out, N, B, H, carried_shape):
    """A pass's (per-chunk tile, per-chunk rows, carried) back to `chunk.py`'s shapes; Nones pass."""
    tiles, rows, carried = out
    carried = carried.reshape(carried_shape)
    if tiles is None:
        return None, None, carried
    return tiles.reshape(N, B, H, *tiles.shape[2:]), rows.reshape(N, B, H, *rows.shape[2:]), carried


def state_scan_chunks(h0, w, u, kg, decay, *, cd, interpret=False, final_only=False, segments=1):
    """`state_scan` on `chunk.py`'s arrays: w, kg [N, B, H, C, K], u [N, B, H, C, V], decay
    [N, B, H, K], h0 [segments * B, H, K, V] (reshapes are free; casts to the compute dtype `cd`)."""
    N, B, H = kg.shape[:3]
    K, V = h0.shape[-2:]
    op = lambda x: None if x is None else _flat(x).astype(cd)
    out = state_scan(op(w), op(u), op(kg), _flat(decay).astype(jnp.float32),
                     h0.reshape(-1, K, V).astype(jnp.float32), interpret=interpret,
                     final_only=final_only, segments=segments)
    return _unflat(out, N, B, H, h0.shape)


def grad_scan_chunks(dS, w, kg, qg, do, dvn_intra, decay, *, cd, interpret=False, final_only=False, segments=1,
                     dhs_dtype=jnp.float32, aqk=None, aqk_transposed=False, do_tokens=False):
    """`grad_scan` on `chunk.py`'s arrays ([N, B, H, ...]; dS [segments * B, H, K, V]); dvn_intra in
    the compute dtype `cd` stays so, any other dtype goes in as float32; `aqk` (instead of
    dvn_intra) goes in the compute dtype. `do_tokens`: do is given chunked as the others but read
    in the inputs' layout (`chunk_intra.from_chunks`, which XLA cancels against the caller's
    chunking of the cotangent)."""
    N, B, H = kg.shape[:3]
    K, V = dS.shape[-2:]
    op = lambda x: None if x is None else _flat(x).astype(cd)
    f32 = lambda x: _flat(x).astype(jnp.float32)
    dvi = None if dvn_intra is None else op(dvn_intra) if dvn_intra.dtype == jnp.dtype(cd) else f32(dvn_intra)
    if do_tokens:
        from kernels.kda.chunk_intra import from_chunks

        do_in = from_chunks(do).astype(cd)
    else:
        do_in = op(do)
    out = grad_scan(op(w), op(kg), op(qg), do_in, dvi, f32(decay),
                    dS.reshape(-1, K, V).astype(jnp.float32), interpret=interpret,
                    final_only=final_only, segments=segments, dhs_dtype=dhs_dtype, aqk=op(aqk),
                    aqk_transposed=aqk_transposed, do_heads=H if do_tokens else None)
    return _unflat(out, N, B, H, dS.shape)

"""The serial passes of the chunked delta rule in transition form: one product on each step's chain.

The WY passes (`mosaic_scan`) chain two dependent products per chunk: v'_n = u_n - w_n S_n, rounded
and staged in SMEM, then S_{n+1} = Diag(d_n) S_n + kg_n^T v'_n. Re-associated,

    S_{n+1} = Diag(d_n) S_n + M_n S_n + kg_n^T u_n                       M_n = -kg_n^T w_n  [K, K]
    dS_n    = Diag(d_n) dS_{n+1} + M_n^T dS_{n+1} + qg_n^T do_n - w_n^T dvi_n

so each step waits on one product (M_n S_n, K x K x BV), and the carried tile is the only operand
staged on the chain; kg^T u (reverse: qg^T do - w^T dvi) does not read the carry and is issued
into the same accumulator first. M_n comes from one batched matmul over all chunks (XLA, rounded
to the compute dtype), and the per-chunk outputs the WY passes write from inside the chain come
afterwards, all chunks at once: v'_n = u_n - w_n S_n from the written states (the backward
already recomputes v' that way), dv'_n = dvi_n + kg_n dS_{n+1} from the written state gradients.

Roundings: S and dS are staged in the compute dtype as in the WY passes; M once per chunk instead
of v' (dv') once per step. Against a float32 recurrence over 1024 chunks both forms' states err by
the same 2.5e-3 (relative, bf16), dominated by the staged S. Costs: M's HBM round trip
([N, BH, K, K], as large as w and kg together) and the second reading of w, u (kg, dvi) for the
outputs, so it pays only where the chain is the bound: few (batch * head) programs walking many
chunks. SMEM per program at BV = 64: 161 KiB forward, 209 KiB reverse (one program per SM).
Selected by `chunk.settings(scan_form="transition")` (`chunk_segments.SCAN_FORM`); delta rule only
(linear attention has no product on its chain), plain passes only (segments = 1). On an H200 at
1,65536,16,128 it is slower than the WY passes (24.97 against 23.32 ms forward+backward,
`benchmarks/results/kda-t65536-levers-h200-20261205T0233.json`): the passes are 3.1 ms of that
step, so the chain it shortens is not the bound there and its extra XLA work is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda import chunk_segments
from kernels.kda.mosaic_scan import _check_dims, _flat, _mm, _store_last, walk_chunks
from kernels.kda.mosaic_state import _smem, launch_bh_v

C = 64  # chunk length
_W = plgpu.Layout.WGMMA


def _fwd_body(m_ref, u_ref, kg_ref, d_ref, h0_ref, *refs, NT, BH, K, BV, dt, final_only):
    outs, scratch = (refs[:1], refs[1:]) if final_only else (refs[:2], refs[2:])
    st_ref, ht_ref = (None, outs[0]) if final_only else outs
    m_s, u_s, kg_s, d_s, s_s, h_s, bars, h_bar = scratch
    ins = ((m_ref, m_s, False), (u_ref, u_s, True), (kg_ref, kg_s, False), (d_ref, d_s, False))

    def step(n, slot, S, at):
        _, bh, first, vs = at

        def chain(acc):
            plgpu.wgmma(acc, kg_s.at[slot].transpose((1, 0)), u_s.at[slot])  # kg^T u: off the chain
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last state copy has read s_s
            s_s[...] = S.astype(dt)
            plgpu.commit_smem()
            plgpu.wgmma(acc, m_s.at[slot], s_s)
            if st_ref is not None:
                plgpu.copy_smem_to_gmem(s_s, st_ref.at[first + n, bh, :, vs])
            return acc[...]

        d = plgpu.load(d_s.at[slot], layout=_W.reduce(1))
        return S * lax.broadcast_in_dim(d, S.shape, [0]) + _mm(chain, (K, BV))

    S, (p, _, _, vs) = walk_chunks(ins, bars, h_bar, lambda p, vs: h0_ref.at[p, :, vs], h_s, BH=BH, NT=NT, BV=BV,
                                   reverse=False, step=step)
    _store_last(S, h_s, ht_ref.at[p, :, vs])


def _bwd_body(m_ref, w_ref, qg_ref, do_ref, ndvi_ref, d_ref, dS_ref, *refs, NT, BH, K, BV, dt, final_only):
    outs, scratch = (refs[:1], refs[1:]) if final_only else (refs[:2], refs[2:])
    dhs_ref, dh0_ref = (None, outs[0]) if final_only else outs
    m_s, w_s, qg_s, do_s, ndvi_s, d_s, ds_c, ds_f, bars, h_bar = scratch
    ins = ((m_ref, m_s, False), (w_ref, w_s, False), (qg_ref, qg_s, False), (do_ref, do_s, True),
           (ndvi_ref, ndvi_s, True), (d_ref, d_s, False))

    def step(n, slot, dS, at):
        _, bh, first, vs = at

        def chain(acc):
            plgpu.wgmma(acc, qg_s.at[slot].transpose((1, 0)), do_s.at[slot])  # off the chain
            plgpu.wgmma(acc, w_s.at[slot].transpose((1, 0)), ndvi_s.at[slot])
            ds_c[...] = dS.astype(dt)
            plgpu.commit_smem()
            plgpu.wgmma(acc, m_s.at[slot].transpose((1, 0)), ds_c)
            if dhs_ref is not None:  # the float32 dS for the dhs output, while the products run
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                ds_f[...] = dS
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(ds_f, dhs_ref.at[first + n, bh, :, vs])
            return acc[...]

        d = plgpu.load(d_s.at[slot], layout=_W.reduce(1))
        return dS * lax.broadcast_in_dim(d, dS.shape, [0]) + _mm(chain, (K, BV))

    dS, (p, _, _, vs) = walk_chunks(ins, bars, h_bar, lambda p, vs: dS_ref.at[p, :, vs], ds_f, BH=BH, NT=NT, BV=BV,
                                    reverse=True, step=step)
    _store_last(dS, ds_f, dh0_ref.at[p, :, vs])


def _block_v(BH, K, V):
    BV = chunk_segments.block_v(programs64=BH * max(V // 64, 1))  # read while tracing
    _check_dims("transition pass", C, K, V, BV)
    return BV


def state_scan(m, u, kg, decay, h0, *, interpret=False, final_only=False):
    """Forward pass. m [N, BH, K, K] (= -kg^T w per chunk) and kg [N, BH, C, K], u [N, BH, C, V] in
    one compute dtype; decay [N, BH, K] f32; h0 [BH, K, V] f32. Returns (states [N, BH, K, V] in
    the compute dtype, final [BH, K, V] f32); `final_only`: (None, final)."""
    N, BH, Cc, K = kg.shape
    V = u.shape[-1]
    if m.shape != (N, BH, K, K) or h0.shape != (BH, K, V) or Cc != C:
        raise ValueError(f"state_scan: m {m.shape}, kg {kg.shape}, u {u.shape}, h0 {h0.shape}; expected "
                         f"m [N, BH, K, K], kg [N, BH, {C}, K], u [N, BH, {C}, V], h0 [BH, K, V]")
    dt = kg.dtype
    BV = _block_v(BH, K, V)
    sm = functools.partial(_smem, BV=BV)
    scratch = [sm((2, K, K), dt), sm((2, C, BV), dt), sm((2, C, K), dt), plgpu.SMEM((2, K), jnp.float32),
               sm((K, BV), dt), plgpu.SMEM((K, BV), jnp.float32), plgpu.Barrier(num_barriers=8),
               plgpu.Barrier(num_barriers=1)]
    final = jax.ShapeDtypeStruct((BH, K, V), jnp.float32)
    out_type = (final,) if final_only else (jax.ShapeDtypeStruct((N, BH, K, V), dt), final)
    body = functools.partial(_fwd_body, NT=N, BH=BH, K=K, BV=BV, dt=dt, final_only=final_only)
    out = launch_bh_v(body, out_type, scratch, (m, u, kg, decay, h0), BH=BH, V=V, BV=BV, interpret=interpret)
    return (None, out[0]) if final_only else out


def grad_scan(m, w, qg, do, ndvi, decay, dS_final, *, interpret=False, final_only=False):
    """Reverse pass. m [N, BH, K, K], w, qg [N, BH, C, K], do and ndvi (= -dvi) [N, BH, C, V] in one
    compute dtype; decay [N, BH, K] f32; dS_final [BH, K, V] f32. Returns (gradients of the
    outgoing states [N, BH, K, V] f32, of the initial state [BH, K, V] f32); `final_only`: (None, that)."""
    N, BH, Cc, K = w.shape
    V = do.shape[-1]
    if m.shape != (N, BH, K, K) or dS_final.shape != (BH, K, V) or Cc != C:
        raise ValueError(f"grad_scan: m {m.shape}, w {w.shape}, do {do.shape}, dS_final {dS_final.shape}; "
                         f"expected m [N, BH, K, K], w [N, BH, {C}, K], do [N, BH, {C}, V], dS [BH, K, V]")
    dt = w.dtype
    f32 = jnp.float32
    BV = _block_v(BH, K, V)
    sm = functools.partial(_smem, BV=BV)
    scratch = [sm((2, K, K), dt), sm((2, C, K), dt), sm((2, C, K), dt), sm((2, C, BV), dt), sm((2, C, BV), dt),
               plgpu.SMEM((2, K), f32), sm((K, BV), dt), plgpu.SMEM((K, BV), f32),
               plgpu.Barrier(num_barriers=12), plgpu.Barrier(num_barriers=1)]
    first = jax.ShapeDtypeStruct((BH, K, V), f32)
    out_type = (first,) if final_only else (jax.ShapeDtypeStruct((N, BH, K, V), f32), first)
    body = functools.partial(_bwd_body, NT=N, BH=BH, K=K, BV=BV, dt=dt, final_only=final_only)
    out = launch_bh_v(body, out_type, scratch, (m, w, qg, do, ndvi, decay, dS_final), BH=BH, V=V, BV=BV,
                      interpret=interpret)
    return (None, out[0]) if final_only else out


def _check_plain(segments):
    if segments != 1:
        raise ValueError(f"scan_form='transition' runs the plain passes; segments={segments} needs scan_form='wy'")


def transition(nm, w, kg):
    """M = -kg^T w per chunk [N, B, H, K, K] in the compute dtype (chunk.py's arrays, `nm` its numerics)."""
    return (-nm.mm("nbhck,nbhcj->nbhkj", kg, w)).astype(nm.cd)


def state_scan_chunks(nm, h0, w, u, kg, decay, *, interpret=False, final_only=False, segments=1):
    """`chunk._state_scan`'s contract on chunk.py's arrays (w, kg [N, B, H, C, K], u [N, B, H, C, V],
    decay [N, B, H, K], h0 [B, H, K, V]): (states, v', final), v' formed from the states afterwards."""
    _check_plain(segments)
    N, B, H = kg.shape[:3]
    K, V = h0.shape[-2:]
    cd = lambda x: _flat(x).astype(nm.cd)  # noqa: E731
    states, final = state_scan(cd(transition(nm, w, kg)), cd(u), cd(kg), _flat(decay).astype(jnp.float32),
                               h0.reshape(-1, K, V).astype(jnp.float32), interpret=interpret, final_only=final_only)
    final = final.reshape(h0.shape)
    if final_only:
        return None, None, final
    states = states.reshape(N, B, H, K, V)
    vn = (u.astype(nm.sdt) - nm.mm("nbhck,nbhkv->nbhcv", w, states)).astype(nm.cd)
    return states, vn, final


def grad_scan_chunks(nm, dS, w, kg, qg, do, dvn_intra, decay, *, interpret=False, final_only=False, segments=1):
    """The Mosaic `grad_scan_chunks` contract (dS [B, H, K, V], the rest [N, B, H, ...]): (gradients of
    the outgoing states f32, of v' in the compute dtype, of the initial state), dv' formed afterwards."""
    _check_plain(segments)
    N, B, H = kg.shape[:3]
    K, V = dS.shape[-2:]
    cd = lambda x: _flat(x).astype(nm.cd)  # noqa: E731
    dhs, dh0 = grad_scan(cd(transition(nm, w, kg)), cd(w), cd(qg), cd(do), cd(-dvn_intra),
                         _flat(decay).astype(jnp.float32), dS.reshape(-1, K, V).astype(jnp.float32),
                         interpret=interpret, final_only=final_only)
    dh0 = dh0.reshape(dS.shape)
    if final_only:
        return None, None, dh0
    dhs = dhs.reshape(N, B, H, K, V)
    dvn = (dvn_intra.astype(nm.sdt) + nm.mm("nbhck,nbhkv->nbhcv", kg, dhs)).astype(nm.cd)
    return dhs, dvn, dh0

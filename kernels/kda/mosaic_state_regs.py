"""The forward-only state pass with the state transposed in registers (`mosaic_state.CHAIN`).

Same products as `mosaic_state._body` for a call that writes no per-chunk outputs (states, v'),
one program per (segment, batch*head, 64 V columns), but the chain from chunk to chunk keeps its
operands in registers. With S^T [BV, K] float32 held as a value (BV = 64 rows: wgmma's M):

    V'^T = S^T Wneg^T + U^T            [BV, C]   S^T (bf16) is wgmma's register A operand, U^T a
                                                 transposed load from SMEM while the product runs
    S^T <- S^T Diag(d) + V'^T KG       [BV, K]   so is V'^T
    O    = QG S + A V'                 [C, BV]   from S^T and V'^T stored to SMEM, read as the
                                                 transposed B operands: off the chain

`mosaic_state._body` stores S and V' to SMEM and fences before each chained product reads them:
two stores, two fences and two product round trips per chunk, one chunk after another. Here the
stores and the fence that O needs sit beside the products in flight. S^T Diag(d) starts the
accumulator that V'^T KG adds to, so S^T and its update never hold registers side by side: at 250
registers (S^T and dS^T apart, O carried into the next step) ptxas serialized every wgmma (its
C7511 note; `benchmarks/mosaic_ptxas.py` reports it), and this form takes 195. The initial and
final states travel transposed ([P, V, K]); `mosaic_state.state_output` transposes them in XLA
(K * V floats per sequence-head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.mosaic_state import C, _smem, launch_bh_v

assert C == 64, "the chunk length is also the only BV this form takes (the register operand's 64 rows)"
_W = plgpu.Layout.WGMMA


def _body(qg_ref, wn_ref, kg_ref, u_ref, a_ref, d_ref, *rest, NT, K, BV, dt, heads, chunk_major, a_transposed,
          w_negated, BH, zero_h0, interpret):
    h0_ref, rest = (None, rest) if zero_h0 else (rest[0], rest[1:])
    o_ref, ht_ref, qg_s, wn_s, kg_s, u_s, a_s, d_s, st_s, vt_s, o_s, h_s, bars, h_bar, *a_ops = rest
    f32 = jnp.float32
    p = lax.axis_index("bh")  # (segment, batch * head): segment p // BH runs chunks first .. first + NT - 1
    bh, first = lax.rem(p, BH), lax.div(p, BH) * NT
    vs = pl.ds(pl.multiple_of(lax.axis_index("v") * BV, BV), BV)
    ops = ((qg_ref, qg_s, None), (wn_ref, wn_s, None), (kg_ref, kg_s, None), (u_ref, u_s, vs), (a_ref, a_s, None),
           (d_ref, d_s, None))

    def issue(n, slot):  # chunk n's operands into buffer `slot`
        for i, (src, dst, cols) in enumerate(ops):
            src = src.at[first + n, bh] if chunk_major else src.at[bh, first + n]
            plgpu.copy_gmem_to_smem(src if cols is None else src.at[:, cols], dst.at[slot], bars.at[2 * i + slot])

    def send_o(n):  # o_s -> chunk n's rows of o
        if heads is None:
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[bh, first + n, :, vs])
        else:  # straight into [B, T, H, V]
            rows = pl.ds((first + n) * C, C)
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[lax.div(bh, heads), rows, lax.rem(bh, heads), vs])

    if interpret:  # the interpreter takes wgmma operands from SMEM only: S^T and V'^T go there
        sa_s, va_s = a_ops
    issue(0, 0)
    if zero_h0:  # no initial state: zeros in registers
        St = plgpu.layout_cast(jnp.zeros((BV, K), f32), _W)
    else:
        plgpu.copy_gmem_to_smem(h0_ref.at[p, vs], h_s, h_bar.at[0])
        plgpu.barrier_wait(h_bar.at[0])
        St = plgpu.load(h_s, layout=_W)

    def step(n, St):
        slot = lax.rem(n, 2)

        @pl.when(n + 1 < NT)
        def _prefetch():
            issue(n + 1, 1 - slot)

        for i in range(len(ops)):
            plgpu.barrier_wait(bars.at[2 * i + slot])
        Sb = (St if w_negated else -St).astype(dt)  # V'^T = S^T Wneg^T + U^T, or U^T - S^T W^T
        if interpret:
            sa_s[...] = Sb
            plgpu.commit_smem()

        def vt_mm(acc):
            plgpu.wgmma(acc, sa_s if interpret else Sb, wn_s.at[slot].transpose((1, 0)))
            Ut = plgpu.load(u_s.at[slot].transpose((1, 0)), layout=_W).astype(f32)  # while it runs
            st_s[...] = Sb if w_negated else St.astype(dt)  # S^T for O (O's last product is done)
            return acc[...] + Ut

        Vt = pl.run_scoped(vt_mm, plgpu.ACC((BV, C), f32)).astype(dt)
        St_d = St * lax.broadcast_in_dim(plgpu.load(d_s.at[slot], layout=_W.reduce(0)), (BV, K), [1])

        def rest_mm(accs):  # S^T Diag(d) + V'^T KG in the accumulator that holds S^T Diag(d); O beside it
            acc_s, acc_o = accs
            if interpret:
                va_s[...] = Vt
                plgpu.commit_smem()
            plgpu.wgmma(acc_s, va_s if interpret else Vt, kg_s.at[slot])
            vt_s[...] = Vt
            plgpu.commit_smem()
            a_op = a_s.at[slot].transpose((1, 0)) if a_transposed else a_s.at[slot]
            plgpu.wgmma(acc_o, qg_s.at[slot], st_s.transpose((1, 0)))
            plgpu.wgmma(acc_o, a_op, vt_s.transpose((1, 0)))

        if interpret:  # the interpreter does not take initialised accumulators: S^T Diag(d) added after
            St, O = pl.run_scoped(lambda *accs: rest_mm(accs) or tuple(acc[...] for acc in accs),
                                  plgpu.ACC((BV, K), f32), plgpu.ACC((C, BV), f32))
            St = St + St_d
        else:
            O0 = plgpu.layout_cast(jnp.zeros((C, BV), f32), _W)
            St, O = pl.run_state(rest_mm)((plgpu.ACC.init(St_d), plgpu.ACC.init(O0)))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's o_s is read
        o_s[...] = O.astype(o_s.dtype)
        plgpu.commit_smem()
        send_o(n)
        return St

    St = lax.fori_loop(0, NT, step, St)
    h_s[...] = St
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_s, ht_ref.at[p, vs])
    plgpu.wait_smem_to_gmem(0)


def state_output_regs(qg, wn, kg, u, a, d, h0t, *, out_dtype, interpret, heads, chunk_major, a_transposed,
                      w_negated, segments):
    """`mosaic_state.state_output` in this form (BV = 64): h0t [segments * BH, V, K] float32 (the
    starting states transposed) or None for zeros; returns (o, final states transposed
    [segments * BH, V, K])."""
    NT, BH, Cc, K = qg.shape if chunk_major else (qg.shape[1], qg.shape[0], *qg.shape[2:])
    V = u.shape[-1]
    BV = C
    dt = qg.dtype
    sm = functools.partial(_smem, BV=BV)
    scratch = [
        sm((2, C, K), dt),  # qg
        sm((2, C, K), dt),  # -w (or w)
        sm((2, C, K), dt),  # kg
        sm((2, C, BV), dt),  # u
        sm((2, C, C), dt),  # A (or A^T)
        plgpu.SMEM((2, K), jnp.float32),  # decays
        sm((BV, K), dt),  # S^T for O's product
        sm((BV, C), dt),  # V'^T for O's product
        sm((C, BV), out_dtype),  # o
        sm((BV, K), jnp.float32),  # the initial, then the final state (transposed)
        plgpu.Barrier(num_barriers=6 * 2, num_arrivals=1),
        plgpu.Barrier(num_barriers=1),
    ]
    if interpret:  # S^T and V'^T as the interpreter's SMEM A operands
        scratch += [sm((BV, K), dt), sm((BV, C), dt)]
    o_shape = (BH, NT, C, V) if heads is None else (BH // heads, NT * C, heads, V)
    out_type = (jax.ShapeDtypeStruct(o_shape, out_dtype), jax.ShapeDtypeStruct((segments * BH, V, K), jnp.float32))
    body = functools.partial(_body, NT=NT // segments, K=K, BV=BV, dt=dt, heads=heads, chunk_major=chunk_major,
                             a_transposed=a_transposed, w_negated=w_negated, BH=BH, zero_h0=h0t is None,
                             interpret=interpret)
    args = (qg, wn, kg, u, a, d) + (() if h0t is None else (h0t,))
    return launch_bh_v(body, out_type, scratch, args, BH=segments * BH, V=V, BV=BV, interpret=interpret)

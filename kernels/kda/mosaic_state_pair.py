"""The inter-chunk kernel of `mosaic_state` with two warpgroups per program, one per 64 V columns.

`mosaic_state.state_output` runs one program of one warpgroup per (batch * head, 64 V columns):
each loads the chunk operands QG, Wneg, KG, A and d ([C, K] tiles, the same for every V block of
a head) into its own 193 KiB of double-buffered SMEM, so one program fits an SM, and at
8,4096,16,128 its 256 programs run as two waves on 132 SMs. Here one program carries two V blocks
of a head, a warpgroup each: the K-wide operands are loaded once (by warpgroup 0) into one set of
double buffers that both read, U, S's operand copy and O are per warpgroup, so 128 programs run
as one wave with the same per-step work and the same products in the same order as
`mosaic_state._body` (bit for bit in the interpreter).

Per slot, a "full" barrier per K-wide operand (its copy landed) and an "empty" one both
warpgroups arrive at once their products have read the slot and both wait for before the next
copies into the slot are issued (by warpgroup 0; each warpgroup issues its own U). V must be a
multiple of 128 columns (two blocks of 64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import profiling
from kernels.kda.mosaic_state import C, MAX_Y, _smem, out_and_state, split_refs, v_prime, write_o

BV = 64  # V columns per warpgroup
WGS = 2  # warpgroups per program
SHARED = ("qg", "wn", "kg", "a", "d")  # the K-wide operands both warpgroups read


def _body(qg_ref, wn_ref, kg_ref, u_ref, a_ref, d_ref, *rest, NT, K, dt, with_states, heads, chunk_major,
          a_transposed, with_vn, w_negated, BH, zero_h0):
    h0_ref, o_ref, ht_ref, st_ref, vn_ref, rest = split_refs(rest, zero_h0, with_states, with_vn)
    (h_s, (qg_s, wn_s)), kg_s, a_s, d_s, u_s, s_s, *vo, full, empty, u_bars, h_bars = rest
    wg = lax.axis_index("wg")
    p = lax.axis_index("bh")  # (segment, batch * head): segment p // BH runs chunks first .. first + NT - 1
    bh, first = lax.rem(p, BH), lax.div(p, BH) * NT
    vs = pl.ds(pl.multiple_of((lax.axis_index("v") * WGS + wg) * BV, BV), BV)
    vn_s, o_s = vo[0].at[wg], vo[-1].at[wg]  # one tile (o over v') when o has the operand dtype
    ops = dict(qg=(qg_ref, qg_s), wn=(wn_ref, wn_s), kg=(kg_ref, kg_s), a=(a_ref, a_s), d=(d_ref, d_s))

    def chunk_src(src, n):
        return src.at[first + n, bh] if chunk_major else src.at[bh, first + n]

    def issue(n, slot):
        @pl.when(wg == 0)
        def _():
            for i, x in enumerate(SHARED):
                src, smem = ops[x]
                plgpu.copy_gmem_to_smem(chunk_src(src, n), smem.at[slot], full.at[2 * i + slot])

        plgpu.copy_gmem_to_smem(chunk_src(u_ref, n).at[:, vs], u_s.at[wg, slot], u_bars.at[2 * wg + slot])

    # The carried tile goes through h_s, which lies over qg's and wn's buffers: read before any
    # chunk copy is issued into them (both warpgroups: the first copies wait for it below).
    if zero_h0:
        S = plgpu.layout_cast(jnp.zeros((K, BV), jnp.float32), plgpu.Layout.WGMMA)
    else:
        plgpu.copy_gmem_to_smem(h0_ref.at[p, :, vs], h_s.at[wg], h_bars.at[wg])
        plgpu.barrier_wait(h_bars.at[wg])
        S = plgpu.load(h_s.at[wg], layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        plgpu.barrier_arrive(empty.at[0])  # this warpgroup has read h_s: slot 0 may be written
        plgpu.barrier_wait(empty.at[0])

    issue(0, 0)

    def step(n, S):
        slot = lax.rem(n, 2)

        @pl.when(n >= 1)
        def _():  # both warpgroups are done with chunk n - 1's operands in the other slot
            plgpu.barrier_wait(empty.at[1 - slot])

        @pl.when(n + 1 < NT)
        def _prefetch():
            issue(n + 1, 1 - slot)

        for i in range(len(SHARED)):
            plgpu.barrier_wait(full.at[2 * i + slot])
        plgpu.barrier_wait(u_bars.at[2 * wg + slot])
        s_s.at[wg][...] = S.astype(dt)  # its last copy (with_states) was waited for before v' below
        plgpu.commit_smem()
        if with_states:
            plgpu.copy_smem_to_gmem(s_s.at[wg], st_ref.at[first + n, bh, :, vs])
        u = plgpu.load(u_s.at[wg, slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)

        vnew = v_prime(u, wn_s.at[slot], s_s.at[wg], w_negated)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every copy issued so far has read its tile
        vn_s[...] = vnew.astype(dt)
        plgpu.commit_smem()
        if with_vn:
            plgpu.copy_smem_to_gmem(vn_s, vn_ref.at[first + n, bh, :, vs])

        o, S, dS = out_and_state(S, d_s.at[slot], qg_s.at[slot], a_s.at[slot], kg_s.at[slot], s_s.at[wg], vn_s,
                                 a_transposed)
        plgpu.barrier_arrive(empty.at[slot])  # this warpgroup's reads of the slot are done
        S = S + dS
        if with_vn and len(vo) == 1:  # o over v': v''s copy has read it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        write_o(o, o_s, o_ref, bh, first + n, vs, heads)
        return S

    S = lax.fori_loop(0, NT, step, S)
    # h_s lies over qg's and wn's buffers: both warpgroups' last reads of them are done (every
    # phase of the empty barriers is waited for by both warpgroups, which keeps them a step apart
    # at most)
    plgpu.barrier_wait(empty.at[(NT - 1) % 2])
    h_s.at[wg][...] = S
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_s.at[wg], ht_ref.at[p, :, vs])
    plgpu.wait_smem_to_gmem(0)


def state_output_pairs(qg, wn, kg, u, a, d, h0, *, out_dtype, interpret, with_states, heads, chunk_major,
                       a_transposed, with_vn, w_negated, segments):
    """`mosaic_state.state_output`'s kernel (its arguments, checked there) with two 64-column
    warpgroups per program; V a multiple of 128."""
    NT, BH, Cc, K = qg.shape if chunk_major else (qg.shape[1], qg.shape[0], *qg.shape[2:])
    V = u.shape[-1]
    if Cc != C or K % 64 or V % (WGS * BV):
        raise ValueError(f"state_output_pairs needs C={C}, K a multiple of 64 and V of {WGS * BV}; "
                         f"got C={Cc}, K={K}, V={V}")
    if segments * BH > MAX_Y:
        raise ValueError(f"{segments * BH} (segment, batch * head) programs exceed CUDA's {MAX_Y} on a grid's y axis")
    dt = qg.dtype
    f32 = jnp.float32
    scratch = [
        plgpu.RefUnion(_smem((WGS, K, BV), f32), (_smem((2, C, K), dt), _smem((2, C, K), dt))),  # h | (qg, wn)
        _smem((2, C, K), dt),  # kg
        _smem((2, C, C), dt),  # a
        plgpu.SMEM((2, K), f32),  # d
        _smem((WGS, 2, C, BV), dt),  # u, per warpgroup
        _smem((WGS, K, BV), dt),  # S's operand copy, per warpgroup
        _smem((WGS, C, BV), dt),  # v', per warpgroup (and o, when o has the operand dtype)
    ]
    if jnp.dtype(out_dtype) != jnp.dtype(dt):
        scratch.append(_smem((WGS, C, BV), out_dtype))  # o, per warpgroup
    scratch += [
        plgpu.Barrier(num_barriers=len(SHARED) * 2, num_arrivals=1),  # full, per operand and slot
        plgpu.Barrier(num_barriers=2, num_arrivals=WGS),  # empty, per slot
        plgpu.Barrier(num_barriers=WGS * 2, num_arrivals=1),  # u, per warpgroup and slot
        plgpu.Barrier(num_barriers=WGS, num_arrivals=1),  # h0, per warpgroup
    ]
    o_shape = (BH, NT, C, V) if heads is None else (BH // heads, NT * C, heads, V)
    out_type = (jax.ShapeDtypeStruct(o_shape, out_dtype), jax.ShapeDtypeStruct((segments * BH, K, V), f32))
    if with_states:
        out_type += (jax.ShapeDtypeStruct((NT, BH, K, V), dt),)
    if with_vn:
        out_type += (jax.ShapeDtypeStruct((NT, BH, C, V), dt),)
    body = functools.partial(_body, NT=NT // segments, K=K, dt=dt, with_states=with_states, heads=heads,
                             chunk_major=chunk_major, a_transposed=a_transposed, with_vn=with_vn,
                             w_negated=w_negated, BH=BH, zero_h0=h0 is None)

    def scoped(*refs):
        with jax.named_scope("mosaic_state_pair.body"):
            body(*refs)

    args = (qg, wn, kg, u, a, d) + (() if h0 is None else (h0,))
    return plgpu.kernel(
        scoped,
        out_type=out_type,
        scratch_types=scratch,
        grid=(segments * BH, V // (WGS * BV)),
        grid_names=("bh", "v"),
        num_threads=WGS,
        thread_name="wg",
        kernel_name="kda_mosaic_state_pair",
        compiler_params=profiling.compiler_params(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args)

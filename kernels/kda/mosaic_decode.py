"""Mosaic GPU kernels for one KDA decoding step over a batch: the state is read once, written once.

Decode is bound by the state's HBM traffic (2 * 4 * K * V bytes per head). A tile is one
(batch*head, V-block of 64): the f32 state tile [K, 64] and the head's vectors come in by TMA,
the update runs in registers, TMA writes the new tile back.

  * `decode_step`: one program per tile.
  * `decode_step_pipelined`: a few programs per SM walk many tiles through a ring of SMEM slots,
    so several loads are always in flight and no program pays launch, prologue and
    store-completion latency per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.hopper import num_sms
from kernels.kda.mosaic_state import _smem, launch_bh_v
from kernels.lowering import lowered_once

BV = 64


def _update(s_smem, vec_smem, v_smem, o_smem):
    """New state into s_smem (in place) and o into o_smem, from the tiles in SMEM."""
    S = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA)
    vec = lambda i: plgpu.load(vec_smem.at[i], layout=plgpu.Layout.WGMMA.reduce(1))
    rows = lambda x: lax.broadcast_in_dim(x, S.shape, [0])
    v = plgpu.load(v_smem, layout=plgpu.Layout.WGMMA.reduce(0)).astype(S.dtype)
    S = S * rows(jnp.exp(vec(0)))  # decay: K exponentials, then broadcast over the tile's columns
    pred = (S * rows(vec(1))).sum(axis=0)  # k^T S'
    S = S + rows(vec(2)) * lax.broadcast_in_dim(v - pred, S.shape, [1])  # (beta k) (v - pred)^T
    o = (S * rows(vec(3))).sum(axis=0)  # (scale q)^T S_new
    s_smem[...] = S
    o_smem[...] = o.astype(o_smem.dtype)
    plgpu.commit_smem()


def _body(s_ref, vec_ref, v_ref, o_ref, sn_ref, s_smem, vec_smem, v_smem, o_smem, bars):
    bh = lax.axis_index("bh")
    vs = pl.ds(lax.axis_index("v") * BV, BV)
    plgpu.copy_gmem_to_smem(s_ref.at[bh, :, vs], s_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(vec_ref.at[bh], vec_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(v_ref.at[bh, vs], v_smem, bars.at[2])
    for i in range(3):
        plgpu.barrier_wait(bars.at[i])
    _update(s_smem, vec_smem, v_smem, o_smem)
    plgpu.copy_smem_to_gmem(s_smem, sn_ref.at[bh, :, vs])
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bh, vs])
    plgpu.wait_smem_to_gmem(0)


def _check_dtypes(v, o_dtype):
    for name, dt in (("v", v.dtype), ("o_dtype", o_dtype)):
        if jnp.dtype(dt) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"decode kernels take {name} in float32 or bfloat16; got {jnp.dtype(dt)}")


def decode_step(state, vecs, v, *, o_dtype=jnp.float32, interpret=False):
    """state [BH, K, V] f32; vecs [BH, 4, K] f32 = (g, k, beta*k, scale*q); v [BH, V] f32 or bf16
    (converted in the kernel, so the caller needs no conversion kernel).

    Returns (o [BH, V] in `o_dtype` (f32 or bf16), new state [BH, K, V] f32).
    """
    return _decode_step(state, vecs, v, o_dtype=jnp.dtype(o_dtype), interpret=interpret)


@lowered_once("o_dtype", "interpret")
def _decode_step(state, vecs, v, *, o_dtype, interpret):
    BH, K, V = state.shape
    if K % 64 or V % BV:
        raise ValueError(f"decode_step needs K a multiple of 64 and V of {BV}; got K={K}, V={V}")
    _check_dtypes(v, o_dtype)
    f32 = jnp.float32
    scratch = [
        _smem((K, BV), f32),
        plgpu.SMEM((4, K), f32),
        plgpu.SMEM((BV,), v.dtype),
        plgpu.SMEM((BV,), o_dtype),
        plgpu.Barrier(num_barriers=3),
    ]
    out_type = (jax.ShapeDtypeStruct((BH, V), o_dtype), jax.ShapeDtypeStruct((BH, K, V), f32))
    return launch_bh_v(_body, out_type, scratch, (state, vecs, v), BH=BH, V=V, BV=BV, interpret=interpret)


def _pipelined_body(s_ref, vec_ref, v_ref, o_ref, sn_ref, s_smem, vec_smem, v_smem, o_smem, bars, *, J, P, NV, BV,
                    slots, n_tiles):
    pid = lax.axis_index("p")
    valid = lambda j: pid + j * P < n_tiles  # program pid owns tiles pid, pid + P, ...: a prefix of j

    def tile(j):
        t = pid + j * P
        return lax.div(t, NV), pl.ds(lax.rem(t, NV) * BV, BV)

    def issue(j, slot):
        bh, vs = tile(j)
        plgpu.copy_gmem_to_smem(s_ref.at[bh, :, vs], s_smem.at[slot], bars.at[3 * slot])
        plgpu.copy_gmem_to_smem(vec_ref.at[bh], vec_smem.at[slot], bars.at[3 * slot + 1])
        plgpu.copy_gmem_to_smem(v_ref.at[bh, vs], v_smem.at[slot], bars.at[3 * slot + 2])

    def step(j):
        slot = lax.rem(j, slots)
        for i in range(3):
            plgpu.barrier_wait(bars.at[3 * slot + i])
        _update(s_smem.at[slot], vec_smem.at[slot], v_smem.at[slot], o_smem.at[slot])
        bh, vs = tile(j)
        plgpu.copy_smem_to_gmem(s_smem.at[slot], sn_ref.at[bh, :, vs], commit_group=False)
        plgpu.copy_smem_to_gmem(o_smem.at[slot], o_ref.at[bh, vs])  # one group: tile j's two stores
        # The slot refilled next held tile j - 1, whose stores had all of this tile's compute to
        # read their SMEM: wait for every group but the newest.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        nxt = j + slots - 1

        @pl.when(valid(nxt))
        def _():
            issue(nxt, lax.rem(nxt, slots))

    for j in range(min(slots - 1, J)):
        pl.when(valid(j))(functools.partial(issue, j, j))

    def body(j, carry):
        pl.when(valid(j))(functools.partial(step, j))
        return carry

    lax.fori_loop(0, J, body, 0)
    plgpu.wait_smem_to_gmem(0)


# SMEM one program may use (the H200's 227 KiB per block, less room for the barriers).
SMEM_LIMIT = 224 * 1024


@lowered_once("programs", "slots", "block_v", "o_dtype", "interpret")
def decode_step_pipelined(state, vecs, v, *, programs=None, slots=4, block_v=BV, o_dtype=jnp.float32,
                          interpret=False):
    """Same contract as `decode_step`; `programs` (default: the GPU's SM count) persistent
    programs with `slots` SMEM slots each; program p takes tiles p, p + programs, ... A tile is
    [K, block_v] of the state (block_v = V reads each head's state as one contiguous block, at the
    cost of K * V / 128 registers per thread for the tile)."""
    BH, K, V = state.shape
    if block_v not in (32, 64, 128) or K % 64 or V % block_v:
        raise ValueError(f"decode_step_pipelined needs block_v in (32, 64, 128) dividing V and K a multiple "
                         f"of 64; got K={K}, V={V}, block_v={block_v}")
    if slots < 2 or (programs is not None and programs < 1):  # one slot would wait on a load never issued
        raise ValueError(f"decode_step_pipelined needs slots >= 2 and programs >= 1; got {slots}, {programs}")
    _check_dtypes(v, o_dtype)
    smem = slots * (4 * K * block_v + 4 * 4 * K + (v.dtype.itemsize + jnp.dtype(o_dtype).itemsize) * block_v)
    if smem > SMEM_LIMIT:
        raise ValueError(f"decode_step_pipelined: {slots} slots of [{K}, {block_v}] float32 need {smem // 1024} KiB "
                         f"of SMEM (limit {SMEM_LIMIT // 1024}); use fewer slots or a narrower block_v")
    NV = V // block_v
    n_tiles = BH * NV
    if programs is None:
        programs = num_sms()
    P = min(programs, n_tiles)
    f32 = jnp.float32
    scratch = [
        _smem((slots, K, block_v), f32),
        plgpu.SMEM((slots, 4, K), f32),
        plgpu.SMEM((slots, block_v), v.dtype),
        plgpu.SMEM((slots, block_v), o_dtype),
        plgpu.Barrier(num_barriers=3 * slots),
    ]
    out_type = (jax.ShapeDtypeStruct((BH, V), o_dtype), jax.ShapeDtypeStruct((BH, K, V), f32))
    body = functools.partial(_pipelined_body, J=-(-n_tiles // P), P=P, NV=NV, BV=block_v, slots=slots, n_tiles=n_tiles)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(P,),
        grid_names=("p",),
        kernel_name="kda_decode",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(state, vecs, v)

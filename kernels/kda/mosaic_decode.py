"""Mosaic GPU kernel for one KDA decoding step over a batch: the state is read once, written once.

One program per (batch*head, V-block of 64): TMA brings the f32 state tile [K, 64] and the
per-head vectors into SMEM, the update runs in registers, TMA writes the new tile back.
Decode is bound by the state's HBM traffic (2 * 4 * K * V bytes per head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.kda.mosaic_state import _smem

BV = 64


def _body(s_ref, vec_ref, v_ref, o_ref, sn_ref, s_smem, vec_smem, v_smem, o_smem, bars):
    bh = lax.axis_index("bh")
    vs = pl.ds(lax.axis_index("v") * BV, BV)
    plgpu.copy_gmem_to_smem(s_ref.at[bh, :, vs], s_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(vec_ref.at[bh], vec_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(v_ref.at[bh, vs], v_smem, bars.at[2])
    for i in range(3):
        plgpu.barrier_wait(bars.at[i])
    S = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA)
    rows = lambda i: lax.broadcast_in_dim(
        plgpu.load(vec_smem.at[i], layout=plgpu.Layout.WGMMA.reduce(1)), S.shape, [0])
    v = plgpu.load(v_smem, layout=plgpu.Layout.WGMMA.reduce(0))
    S = S * jnp.exp(rows(0))  # decay
    pred = (S * rows(1)).sum(axis=0)  # k^T S'
    S = S + rows(2) * lax.broadcast_in_dim(v - pred, S.shape, [1])  # (beta k) (v - pred)^T
    o = (S * rows(3)).sum(axis=0)  # (scale q)^T S_new
    s_smem[...] = S
    o_smem[...] = o
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_smem, sn_ref.at[bh, :, vs])
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bh, vs])
    plgpu.wait_smem_to_gmem(0)


def decode_step(state, vecs, v, *, interpret=False):
    """state [BH, K, V] f32; vecs [BH, 4, K] f32 = (g, k, beta*k, scale*q); v [BH, V] f32.

    Returns (o [BH, V] f32, new state [BH, K, V] f32).
    """
    BH, K, V = state.shape
    if K % 64 or V % BV:
        raise ValueError(f"decode_step needs K a multiple of 64 and V of {BV}; got K={K}, V={V}")
    f32 = jnp.float32
    scratch = [
        _smem((K, BV), f32),
        plgpu.SMEM((4, K), f32),
        plgpu.SMEM((BV,), f32),
        plgpu.SMEM((BV,), f32),
        plgpu.Barrier(num_barriers=3),
    ]
    out_type = (jax.ShapeDtypeStruct((BH, V), f32), jax.ShapeDtypeStruct((BH, K, V), f32))
    return plgpu.kernel(
        _body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(BH, V // BV),
        grid_names=("bh", "v"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(state, vecs, v)

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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


def _body(dvn_ref, s_ref, ai_ref, v_ref, beta_ref, kg_ref, dbv_ref, dkg_ref, dl_ref, dvn_s, s_s, ai_s, bv_s, beta_s,
          kg_s, dw_s, mats, bars, *, dt):
    dai_s, x_s, dl_s = mats  # in S_n's memory once dw is formed
    (t,) = grid_indices((dvn_ref.shape[0],))  # program t: chunk-batch-head t
    loads = ((dvn_ref, dvn_s), (s_ref, s_s), (ai_ref, ai_s), (v_ref, bv_s), (kg_ref, kg_s), (beta_ref, beta_s))
    for i, (src, dst) in enumerate(loads):
        plgpu.copy_gmem_to_smem(src.at[t], dst, bars.at[i])
    K, V = s_s.shape

    def store(x, ref):  # an accumulator's value into SMEM in the compute dtype
        ref[...] = x.astype(dt)
        plgpu.commit_smem()

    # dw = -dv' S^T: S [K, V] is the transposed operand (its rows are dw's columns).
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])

    def dw_fn(acc):
        plgpu.wgmma(acc, dvn_s, s_s.transpose((1, 0)))
        return acc[...]

    # bv = beta v in place of v, formed here: XLA would write it to HBM for this kernel to read.
    plgpu.barrier_wait(bars.at[3])
    plgpu.barrier_wait(bars.at[5])
    beta = lax.broadcast_in_dim(plgpu.load(beta_s, layout=_W.reduce(1)), (C, V), [0])
    bv = plgpu.load(bv_s, layout=_W).astype(jnp.float32) * beta
    store(-_mm(dw_fn, (C, K)), dw_s)
    store(bv, bv_s)
    # dAi = dv' bv^T + dw kgam^T, one float32 accumulator (S's memory now takes dAi).
    plgpu.barrier_wait(bars.at[4])

    def dai_fn(acc):
        plgpu.wgmma(acc, dvn_s, bv_s.transpose((1, 0)))
        plgpu.wgmma(acc, dw_s, kg_s.transpose((1, 0)))
        return acc[...]

    store(_mm(dai_fn, (C, C)), dai_s)
    plgpu.barrier_wait(bars.at[2])
    ai_t = ai_s.transpose((1, 0))  # Ai^T: Ai as stored, the transposed operand

    def two(x, y):  # two products issued together (their latencies overlap), then both read
        def fn(acc_x, acc_y):
            plgpu.wgmma(acc_x, *x[1:])
            plgpu.wgmma(acc_y, *y[1:])
            return acc_x[...], acc_y[...]

        return pl.run_scoped(fn, plgpu.ACC(x[0], jnp.float32), plgpu.ACC(y[0], jnp.float32))

    # d bv = Ai^T dv' beside X = dAi Ai^T, then d kgam = Ai^T dw beside d L = -Ai^T X; d bv and
    # d kgam are written over bv and kgam (their last reads were dAi's).
    d_bv, X = two(((C, V), ai_t, dvn_s), ((C, C), dai_s, ai_t))
    store(d_bv, bv_s)
    plgpu.copy_smem_to_gmem(bv_s, dbv_ref.at[t])
    store(X, x_s)
    d_kgam, d_L = two(((C, K), ai_t, dw_s), ((C, C), ai_t, x_s))
    store(d_kgam, kg_s)
    plgpu.copy_smem_to_gmem(kg_s, dkg_ref.at[t])
    store(-d_L, dl_s)
    plgpu.copy_smem_to_gmem(dl_s, dl_ref.at[t])
    plgpu.wait_smem_to_gmem(0)


@lowered_once("interpret")
def _wy_bwd(dvn, states, Ai, v, beta, kgam, *, interpret):
    P, _, V = dvn.shape
    K = states.shape[-2]
    dt = dvn.dtype
    union = plgpu.RefUnion((_smem((C, C), dt), _smem((C, C), dt), _smem((C, C), dt)), _smem((K, V), dt))
    scratch = [
        _smem((C, V), dt),  # dv'
        union,  # S_n, then dAi, X, dL
        _smem((C, C), dt),  # Ai
        _smem((C, V), dt),  # v, then bv, then d bv
        plgpu.SMEM((C,), jnp.float32),  # beta
        _smem((C, K), dt),  # kgam, then d kgam
        _smem((C, K), dt),  # dw
        plgpu.Barrier(num_barriers=6),
    ]
    sds = lambda *s: jax.ShapeDtypeStruct((P, *s), dt)  # noqa: E731

    def body(dvn_ref, s_ref, ai_ref, v_ref, beta_ref, kg_ref, dbv_ref, dkg_ref, dl_ref, dvn_s, un, ai_s, bv_s, beta_s,
             kg_s, dw_s, bars):
        mats, s_s = un
        _body(dvn_ref, s_ref, ai_ref, v_ref, beta_ref, kg_ref, dbv_ref, dkg_ref, dl_ref, dvn_s, s_s, ai_s, bv_s, beta_s,
              kg_s, dw_s, mats, bars, dt=dt)

    return plgpu.kernel(
        body,
        out_type=(sds(C, V), sds(C, K), sds(C, C)),
        scratch_types=scratch,
        **flat_grid((P,)),
        kernel_name="kda_wy_bwd",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(dvn, states, Ai, v, beta, kgam)


def wy_bwd(dvn, states, Ai, v, beta, kgam, *, interpret=False):
    """dvn [.., C, V], states [.., K, V], Ai [.., C, C], v [.., C, V], beta [.., C], kgam [.., C, K]
    (any leading dims, the same for all; matrices cast to dvn's dtype, beta to float32) -> (d bv
    [.., C, V], d kgam [.., C, K], d L [.., C, C]) in dvn's dtype, bv = beta v (rounded to dvn's
    dtype as a product operand). `interpret`: the Mosaic GPU interpreter (CPU tests)."""
    lead, V = dvn.shape[:-2], dvn.shape[-1]
    K = states.shape[-2]
    reason = unsupported_reason(K, V, dvn.dtype)
    if reason is not None:
        raise ValueError(reason)
    want = {"dvn": (C, V), "states": (K, V), "Ai": (C, C), "v": (C, V), "beta": (C,), "kgam": (C, K)}
    for name, x in zip(want, (dvn, states, Ai, v, beta, kgam)):
        if x.shape != (*lead, *want[name]):
            raise ValueError(f"wy_bwd: {name} has shape {x.shape}; expected {(*lead, *want[name])}")
    dt = dvn.dtype
    flat = lambda x: x.astype(dt).reshape(-1, *x.shape[-2:])  # noqa: E731
    outs = _wy_bwd(flat(dvn), flat(states), flat(Ai), flat(v), beta.astype(jnp.float32).reshape(-1, C), flat(kgam),
                   interpret=interpret)
    return tuple(o.reshape(*lead, *o.shape[-2:]) for o in outs)

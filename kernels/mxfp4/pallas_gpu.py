"""Grouped matmul with MXFP4 expert weights, dequantised on the fly (Pallas Mosaic GPU, forward).

    x [M, K] (rows sorted by group), packed u8 [G, N, K/2], scales u8 [G, N, K/32],
    group_sizes [G] -> [M, N],  out[m] = x[m] @ dequantize(W[group(m)])^T.

The weights stay packed in HBM (4.25 bits each) and travel packed through TMA. Each pipeline
step decodes a [bn, bk/2] byte tile in registers into two bf16 tiles, the even and the odd
input columns (low and high nibbles), multiplied by their E8M0 scales, and runs two wgmmas
against the matching even/odd halves of the activations (split once by XLA, a cheap pass over
activations). Splitting K this way avoids interleaving nibbles in registers; a contraction does
not care about the order of K. Group handling (row masks, one TMA store per output tile) follows
`kernels/gmm/pallas_gpu.py`. On CPU it runs in the Mosaic GPU interpreter (`interpret=True`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.gmm.pallas_gpu import Blocks, _pad_to, grouped_rows_kernel
from kernels.mxfp4.format import BLOCK, SCALE_BIAS, SCALE_NAN


# bm x bn output tile, bk input columns per step (bk/32 scale bytes per row: 16 for TMA).
DEFAULT_BLOCKS = Blocks(bm=64, bn=64, bk=512, stages=2)


def _decode(codes):
    """E2M1 codes u8 (0..15) -> f32 by arithmetic (no table lookup in registers)."""
    c = codes.astype(jnp.int32)
    e = ((c >> 1) & 3).astype(jnp.float32)
    m = (c & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.exp2(e - 1.0))
    return jnp.where((c & 8) != 0, -mag, mag)


def _scale(s):
    s = s.astype(jnp.int32)
    return jnp.where(s == SCALE_NAN, jnp.nan, jnp.exp2((s - SCALE_BIAS).astype(jnp.float32)))


def gmm(x, packed, scales, group_sizes, *, blocks=DEFAULT_BLOCKS, interpret=False):
    """Grouped x @ dequantize(W[g])^T with W packed; x bf16/f16 [M, K] -> [M, N] in x's dtype."""
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"pallas_gpu mxfp4 gmm needs bf16/f16 activations, got {x.dtype}")
    m, k = x.shape
    g_count, n, _ = packed.shape
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    kh, ks = bk // 2, bk // BLOCK
    x_p = _pad_to(_pad_to(x, 0, bm), 1, bk)
    x_lo, x_hi = x_p[:, 0::2], x_p[:, 1::2]
    packed_p = _pad_to(_pad_to(packed, 1, bn), 2, kh)
    scales_p = _pad_to(_pad_to(scales, 1, bn), 2, ks)
    mp, np_ = x_p.shape[0], packed_p.shape[1]
    num_k = x_p.shape[1] // bk
    dtype = x.dtype

    def group_acc(g, mb, nb, in_refs, scratch_refs):
        xlo_ref, xhi_ref, p_ref, s_ref = in_refs
        (w_smem,) = scratch_refs

        def acc_scope(acc_ref):
            def step(_, xlo_smem, xhi_smem, p_smem, s_smem):
                codes = p_smem[...]
                factor = jnp.repeat(_scale(s_smem[...]), BLOCK // 2, axis=1)
                for half, x_smem in ((codes & 15, xlo_smem), (codes >> 4, xhi_smem)):
                    w_smem[...] = (_decode(half) * factor).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step,
                grid=(num_k,),
                in_specs=[
                    plgpu.BlockSpec((bm, kh), lambda kk: (mb, kk)),
                    plgpu.BlockSpec((bm, kh), lambda kk: (mb, kk)),
                    plgpu.BlockSpec((bn, kh), lambda kk: (nb, kk)),
                    plgpu.BlockSpec((bn, ks), lambda kk: (nb, kk)),
                ],
                max_concurrent_steps=blocks.stages,
            )(xlo_ref, xhi_ref, p_ref.at[g], s_ref.at[g])
            return acc_ref[...]

        return pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

    out = grouped_rows_kernel(group_acc, group_sizes, (x_lo, x_hi, packed_p, scales_p),
                              shape=(mp, np_), tile=(bm, bn), out_dtype=dtype,
                              scratch=(plgpu.SMEM((bn, kh), dtype),), interpret=interpret)
    return out[:m, :n]

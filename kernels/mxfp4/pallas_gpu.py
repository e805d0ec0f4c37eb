"""Grouped matmul with MXFP4 expert weights, dequantised on the fly (Pallas Mosaic GPU, forward).

    x [M, K] (rows sorted by group), packed u8 [G, N, K/2], scales u8 [G, N, K/32],
    group_sizes [G] -> [M, N],  out[m] = x[m] @ dequantize(W[group(m)])^T.

The weights stay packed in HBM (4.25 bits each) and travel packed through TMA. A pipeline step
covers bk input columns = bk/32 scale blocks; each block arrives as its own [bn, 16] byte tile
(so no SMEM slicing and no in-register repeat of scales is needed) with its scales as a row of a
[bk/32, bn] tile (scales are transposed to [G, K/32, N] by XLA, 1/16 of the packed bytes).
Registers decode the low and high nibbles (the even and the odd input columns) to bf16, times
the block's scale broadcast along the row, into two [bn, 16] SMEM tiles; two wgmmas (K = 16)
take them against the matching even/odd halves of the activations (split once by XLA, a cheap
pass over activations): a contraction does not care about the order of K, so nibbles are never
interleaved. Integer work is in int32 (Mosaic GPU has no pointwise 8-bit math). Group handling
(row masks, one TMA store per output tile) is `kernels/gmm/pallas_gpu.grouped_rows_kernel`.
On CPU it runs in the Mosaic GPU interpreter (`interpret=True`); it also lowers for CUDA on a
CPU machine (layout inference and the shared-memory budget are checked by the tests).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import vma
from kernels.gmm.pallas_gpu import Blocks, _pad_to, grouped_rows_kernel
from kernels.mxfp4.format import BLOCK, SCALE_BIAS, SCALE_NAN

# bm x bn output tile, bk input columns (bk/32 scale blocks) per pipeline step.
DEFAULT_BLOCKS = Blocks(bm=64, bn=64, bk=256, stages=3)


def _decode(c):
    """E2M1 codes (int32, 0..15) -> f32 by arithmetic (no table lookup in registers)."""
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
    n = packed.shape[1]
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    half = BLOCK // 2  # packed bytes (and even or odd elements) per scale block
    nblk = bk // BLOCK  # scale blocks per pipeline step
    x_p = _pad_to(_pad_to(x, 0, bm), 1, bk)
    x_lo, x_hi = x_p[:, 0::2], x_p[:, 1::2]  # [M, K/2] each: even and odd input columns
    packed_p = _pad_to(_pad_to(packed, 1, bn), 2, bk // 2)
    # [G, K/32, N]: one row of scales per block, so a step reads a [nblk, bn] tile by TMA
    scales_t = jnp.swapaxes(_pad_to(_pad_to(scales, 1, bn), 2, nblk), 1, 2)
    mp, np_ = x_p.shape[0], packed_p.shape[1]
    num_k = x_p.shape[1] // bk
    dtype = x.dtype

    def group_acc(g, mb, nb, in_refs, w_refs):
        xlo_ref, xhi_ref, p_ref, s_ref = in_refs

        def acc_scope(acc_ref):
            def step(_, *smem):
                xlo, xhi, codes = (smem[i * nblk:(i + 1) * nblk] for i in range(3))
                s_smem = smem[3 * nblk]
                for j in range(nblk):  # decode block j's low and high nibbles with its scale
                    c = codes[j][...].astype(jnp.int32)  # no pointwise 8-bit math on GPU
                    factor = _scale(s_smem[j, :])[:, None]
                    w_refs[2 * j][...] = (_decode(c & 15) * factor).astype(dtype)
                    w_refs[2 * j + 1][...] = (_decode(c >> 4) * factor).astype(dtype)
                plgpu.commit_smem()
                for j in range(nblk):
                    plgpu.wgmma(acc_ref, xlo[j], w_refs[2 * j].transpose((1, 0)))
                    plgpu.wgmma(acc_ref, xhi[j], w_refs[2 * j + 1].transpose((1, 0)))
                plgpu.wgmma_wait(0)  # the w buffers are rewritten by the next step

            def col(j):
                return lambda kk: (mb, kk * nblk + j)

            specs = ([plgpu.BlockSpec((bm, half), col(j)) for j in range(nblk)] * 2
                     + [plgpu.BlockSpec((bn, half), lambda kk, j=j: (nb, kk * nblk + j))
                        for j in range(nblk)]
                     + [plgpu.BlockSpec((nblk, bn), lambda kk: (kk, nb))])
            plgpu.emit_pipeline(step, grid=(num_k,), in_specs=specs,
                                max_concurrent_steps=blocks.stages)(
                *[xlo_ref] * nblk, *[xhi_ref] * nblk, *[p_ref.at[g]] * nblk, s_ref.at[g])
            return acc_ref[...]

        return pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

    out = grouped_rows_kernel(group_acc, group_sizes, (x_lo, x_hi, packed_p, scales_t),
                              shape=(mp, np_), tile=(bm, bn), out_dtype=dtype,
                              scratch=[plgpu.SMEM((bn, half), dtype)] * (2 * nblk),
                              band=blocks.band, interpret=interpret, name="mxfp4_gmm")
    return vma.kernel_outputs(out[:m, :n], x, packed, scales, group_sizes)  # inside shard_map: kernels/vma.py

"""The gated expert FFN over rows sorted by group, with its activation fused into the matmuls.

    glu_ffn(x [M, D], w_gate [G, D, F], w_up [G, D, F], w_down [G, F, D], group_sizes [G] int32,
            kind="swiglu" | "situ") -> y [M, D] in x's dtype
    y[m] = act(x[m] @ w_gate[g], x[m] @ w_up[g]) @ w_down[g] for the group g that holds row m;
    rows past sum(group_sizes) are zero.

impls: "ragged_dot" (the reference: `jax.lax.ragged_dot` and the activation in XLA, autodiff) and
"pallas_gpu" with one of two fusions:
- "glu" (forward: `pallas_gpu_glu.glu_gmm` then the down projection; backward: `glu_gmm_bwd` (dh
  and the activation's backward in one kernel), the down weight's tgmm, dx as one grouped matmul
  of contraction 2F against [w_gate | w_up], and both gate/up weight gradients as one tgmm). Six
  grouped-matmul launches per step and no XLA pass over [M, F] activations, against nine launches
  and the activation's forward and backward fusions with separate kernels. Any width.
- "ffn" (`pallas_gpu_ffn`: the whole FFN of a block of rows in one kernel, the hidden activation
  in SMEM; the backward recomputes gate and up in one kernel that also forms dx, then two tgmm
  for the weight gradients). Four launches per step, x the only residual; widths whose hidden
  activation fits in SMEM (`pallas_gpu_ffn.check_ffn_fits`: small experts such as k3_small's).
"auto" picks "pallas_gpu" on Hopper for 16-bit operands, as `ops.gmm` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import vma
from kernels.gmm import ops, pallas_gpu, pallas_gpu_ffn, pallas_gpu_glu, reference
from kernels.gmm.glu_math import check_kind, glu_forward

# Tiles of the two fused kernels (they share them: the backward reads the forward's gate and up
# tiles). 64x64x64 with 3 stages was the fastest of 64x64x64/3, 64x128x64/3 and 64x128x64/2 at the
# k3_small expert shapes on an H200 (the whole FFN and the MoE layer step, benchmarks/moe.py);
# narrower column tiles give that short (D=256) K-loop more programs per SM.
DEFAULT_GLU_BLOCKS = pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=3)
# Tiles of fusion="ffn" (bn is both the F and the D tile): two stages keep the forward's SMEM
# (hidden activation, output rows and one pipeline) at 112 KiB at k3_small's widths, two programs
# per SM. The form itself timed slower than fusion="glu" at k3_small
# (benchmarks/results/moe-k3small-sort-ffn-h200-20261205T0318.json).
DEFAULT_FFN_BLOCKS = pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=2)
FUSIONS = ("glu", "ffn")


def glu_ffn(x, w_gate, w_up, w_down, group_sizes, *, kind="swiglu", beta=4.0, linear_beta=25.0,
            impl="auto", glu_blocks=None, blocks=None, fusion="glu"):
    """Gated expert FFN by group (module docstring). `beta`, `linear_beta`: SiTU-GLU's bounds.
    `fusion`: "glu" or "ffn" (module docstring; the reference ignores it). `glu_blocks`: the
    fused kernels' tiles (default DEFAULT_GLU_BLOCKS, or DEFAULT_FFN_BLOCKS for "ffn");
    `blocks`: the plain grouped matmuls' (forward, dlhs, drhs) tiles (default ops.DEFAULT_BLOCKS:
    the tgmm of "ffn" take the drhs tiles)."""
    check_kind(kind)
    if fusion not in FUSIONS:
        raise ValueError(f"glu_ffn fusion={fusion!r}; expected one of {FUSIONS}")
    if x.ndim != 2 or group_sizes.ndim != 1:
        raise ValueError(f"glu_ffn expects x [M, D] and group_sizes [G]; got {x.shape}, {group_sizes.shape}")
    G, D, F = w_gate.shape
    if x.shape[1] != D or w_up.shape != (G, D, F) or w_down.shape != (G, F, D) or group_sizes.shape[0] != G:
        raise ValueError(f"glu_ffn shapes: x {x.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}, "
                         f"w_down {w_down.shape}, group_sizes {group_sizes.shape}; expected w_gate, "
                         f"w_up [G, D, F], w_down [G, F, D], group_sizes [G]")
    group_sizes = group_sizes.astype(jnp.int32)
    impl = ops.resolve_impl(impl, x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype)
    if impl == "ragged_dot":
        return reference_glu_ffn(x, w_gate, w_up, w_down, group_sizes, kind=kind, beta=beta,
                                 linear_beta=linear_beta)
    if len({x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype}) != 1:
        raise ValueError(f"pallas_gpu glu_ffn needs one operand dtype, got x {x.dtype}, weights "
                         f"{w_gate.dtype}, {w_up.dtype}, {w_down.dtype}")
    act = (kind, float(beta), float(linear_beta))
    # One varying-axes type for the custom VJPs' operands inside shard_map (kernels/vma.py).
    x, w_gate, w_up, w_down, group_sizes = vma.same_varying(x, w_gate, w_up, w_down, group_sizes)
    if fusion == "ffn":
        glu_blocks = glu_blocks or DEFAULT_FFN_BLOCKS
        pallas_gpu_ffn.check_ffn_fits(D, F, glu_blocks)
        return _pallas_ffn(x, w_gate, w_up, w_down, group_sizes, act, glu_blocks,
                           blocks or ops.DEFAULT_BLOCKS, ops._interpret())
    glu_blocks = glu_blocks or DEFAULT_GLU_BLOCKS
    pallas_gpu_glu.check_glu_blocks(glu_blocks)
    return _pallas_glu_ffn(x, w_gate, w_up, w_down, group_sizes, act, glu_blocks,
                           blocks or ops.DEFAULT_BLOCKS, ops._interpret())


def reference_glu_ffn(x, w_gate, w_up, w_down, group_sizes, *, kind, beta, linear_beta):
    """Separate grouped matmuls by `ragged_dot`, gate and up rounded to x's dtype, the activation
    in float32, autodiff for the backward."""
    gate = reference.gmm(x, w_gate, group_sizes)
    up = reference.gmm(x, w_up, group_sizes)
    h = glu_forward(kind, gate, up, beta, linear_beta).astype(x.dtype)
    return reference.gmm(h, w_down, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _pallas_glu_ffn(x, w_gate, w_up, w_down, group_sizes, act, glu_blocks, blocks, interpret):
    return _glu_ffn_fwd(x, w_gate, w_up, w_down, group_sizes, act, glu_blocks, blocks, interpret)[0]


def _glu_ffn_fwd(x, w_gate, w_up, w_down, group_sizes, act, glu_blocks, blocks, interpret):
    fwd, _, _ = pallas_gpu.split_blocks(blocks)
    h, gu = pallas_gpu_glu.glu_gmm(x, w_gate, w_up, group_sizes, act=act, blocks=glu_blocks,
                                   interpret=interpret)  # h [Mp, Np], padded columns zero
    wd_p = pallas_gpu._pad_to(w_down, 1, h.shape[1])  # [G, Np, D]: zero rows meet h's zero columns
    y = pallas_gpu.gmm(h, wd_p, group_sizes, blocks=fwd, interpret=interpret)[:x.shape[0]]
    return y, (x, w_gate, w_up, w_down, group_sizes, h, gu)


def _glu_ffn_bwd(act, glu_blocks, blocks, interpret, res, dy):
    x, w_gate, w_up, w_down, group_sizes, h, gu = res
    _, b_dlhs, b_drhs = pallas_gpu.split_blocks(blocks)
    M, F = x.shape[0], w_gate.shape[2]
    Np = gu.shape[1] // 2
    dy = dy.astype(x.dtype)
    dgu = pallas_gpu_glu.glu_gmm_bwd(dy, w_down, gu, group_sizes, act=act, blocks=glu_blocks,
                                     interpret=interpret)[:M]  # [M, 2 Np]: [dgate | dup]
    dy_p = pallas_gpu._pad_to(dy, 0, h.shape[0])  # tgmm pairs h's rows with dy's
    dwd = pallas_gpu.tgmm(h, dy_p, group_sizes, blocks=b_drhs, interpret=interpret,
                          out_dtype=w_down.dtype)[:, :F]
    w_gu = jnp.concatenate([pallas_gpu._pad_to(w, 2, Np) for w in (w_gate, w_up)], axis=2)  # [G, D, 2 Np]
    dx = pallas_gpu.gmm(dgu, w_gu, group_sizes, transpose_rhs=True, blocks=b_dlhs, interpret=interpret)
    dw_gu = pallas_gpu.tgmm(x, dgu, group_sizes, blocks=b_drhs, interpret=interpret, out_dtype=w_gate.dtype)
    return (dx, dw_gu[:, :, :F], dw_gu[:, :, Np:Np + F], dwd,
            np.zeros(group_sizes.shape, jax.dtypes.float0))


_pallas_glu_ffn.defvjp(_glu_ffn_fwd, _glu_ffn_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _pallas_ffn(x, w_gate, w_up, w_down, group_sizes, act, ffn_blocks, blocks, interpret):
    return pallas_gpu_ffn.ffn_fwd(x, w_gate, w_up, w_down, group_sizes, act=act, blocks=ffn_blocks,
                                  interpret=interpret)


def _ffn_fwd(x, w_gate, w_up, w_down, group_sizes, act, ffn_blocks, blocks, interpret):
    y = _pallas_ffn(x, w_gate, w_up, w_down, group_sizes, act, ffn_blocks, blocks, interpret)
    return y, (x, w_gate, w_up, w_down, group_sizes)


def _ffn_bwd(act, ffn_blocks, blocks, interpret, res, dy):
    x, w_gate, w_up, w_down, group_sizes = res
    _, _, b_drhs = pallas_gpu.split_blocks(blocks)
    F = w_gate.shape[2]
    dx, h, dgu = pallas_gpu_ffn.ffn_bwd_rows(x, dy.astype(x.dtype), w_gate, w_up, w_down, group_sizes, act=act,
                                             blocks=ffn_blocks, interpret=interpret)
    Mp, Fp = h.shape
    dy_p = pallas_gpu._pad_to(dy.astype(x.dtype), 0, Mp)  # tgmm pairs h's (and dgu's) rows with these
    dwd = pallas_gpu.tgmm(h, dy_p, group_sizes, blocks=b_drhs, interpret=interpret, out_dtype=w_down.dtype)[:, :F]
    x_p = pallas_gpu._pad_to(x, 0, Mp)
    dw_gu = pallas_gpu.tgmm(x_p, dgu, group_sizes, blocks=b_drhs, interpret=interpret, out_dtype=w_gate.dtype)
    return (dx, dw_gu[:, :, :F], dw_gu[:, :, Fp:Fp + F], dwd,
            np.zeros(group_sizes.shape, jax.dtypes.float0))


_pallas_ffn.defvjp(_ffn_fwd, _ffn_bwd)

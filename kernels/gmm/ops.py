"""Public grouped-matmul entry points and the one place where an `impl` name is resolved.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G] int32) -> [M, N]
    tgmm(lhs [M, K], dout [M, N], group_sizes [G] int32) -> [G, K, N]

Rows of lhs are sorted by group; sum(group_sizes) <= M and rows past it come out zero.
impls: "ragged_dot" (XLA's `jax.lax.ragged_dot`, any platform and dtype) and "pallas_gpu"
(Mosaic GPU kernels with a custom VJP; bf16/f16 only; run by the Mosaic GPU interpreter when
the platform is not a GPU). "auto" picks "pallas_gpu" on Hopper for 16-bit operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import vma
from kernels.gmm import pallas_gpu, reference
from kernels.kda.hopper import device_kind

IMPLS = ("ragged_dot", "pallas_gpu")

# (forward, dlhs, drhs) tiles of the pallas_gpu kernels when none are given: the fastest of
# `benchmarks/moe.py --sweep` on an H200 at K3's expert shapes (forward and dlhs 128x128x64 in
# 4 stages, 76% of the bf16 peak; tgmm 128x128x128 in 3 stages, 71%).
DEFAULT_BLOCKS = (pallas_gpu.Blocks(), pallas_gpu.Blocks(),
                  pallas_gpu.Blocks(bm=128, bn=128, bk=128, stages=3))


def _is_hopper() -> bool:
    return device_kind() == "hopper"


def resolve_impl(impl: str, *dtypes) -> str:
    """Map "auto" to the best impl for this platform and dtypes; reject unknown names."""
    if impl == "auto":
        ok = all(jnp.dtype(d) in pallas_gpu.SUPPORTED_DTYPES for d in dtypes)
        return "pallas_gpu" if ok and _is_hopper() else "ragged_dot"
    if impl not in IMPLS:
        raise ValueError(f"Unknown impl={impl!r}; expected 'auto' or one of {list(IMPLS)}")
    return impl


def _interpret() -> bool:
    return device_kind() != "hopper" and jax.devices()[0].platform != "gpu"


def _check(lhs, rhs_or_dout, group_sizes, *, rhs_ndim):
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if rhs_or_dout.ndim != rhs_ndim:
        raise ValueError(f"expected a {rhs_ndim}-D second operand, got shape {rhs_or_dout.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be a 1-D integer array, got {group_sizes.shape} "
                         f"{group_sizes.dtype}")


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, impl="auto", blocks=None):
    """Grouped matmul: out[m] = lhs[m] @ rhs[group(m)] (rhs[g].T with transpose_rhs).
    `blocks`: one `pallas_gpu.Blocks` or a (forward, dlhs, drhs) tuple; None: DEFAULT_BLOCKS.

    lhs [M, K]; rhs [G, K, N] ([G, N, K] with transpose_rhs); group_sizes [G] int -> [M, N]
    in lhs's dtype, f32 accumulation. Differentiable in lhs and rhs with every impl.
    """
    _check(lhs, rhs, group_sizes, rhs_ndim=3)
    k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if lhs.shape[1] != k_rhs or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"shape mismatch: lhs {lhs.shape}, rhs {rhs.shape} "
                         f"(transpose_rhs={transpose_rhs}), group_sizes {group_sizes.shape}")
    group_sizes = group_sizes.astype(jnp.int32)
    impl = resolve_impl(impl, lhs.dtype, rhs.dtype)
    if impl == "ragged_dot":
        return reference.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"pallas_gpu gmm needs one operand dtype, got {lhs.dtype} and {rhs.dtype}")
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    lhs, rhs, group_sizes = vma.same_varying(lhs, rhs, group_sizes)  # inside shard_map: kernels/vma.py
    return pallas_gpu.gmm_vjp(lhs, rhs, group_sizes, blocks or DEFAULT_BLOCKS, _interpret())


def tgmm(lhs, dout, group_sizes, *, impl="auto", blocks=None):
    """Transposed grouped matmul: out[g] = lhs[rows_g]^T @ dout[rows_g] -> [G, K, N]."""
    _check(lhs, dout, group_sizes, rhs_ndim=2)
    if lhs.shape[0] != dout.shape[0]:
        raise ValueError(f"lhs {lhs.shape} and dout {dout.shape} need the same number of rows")
    group_sizes = group_sizes.astype(jnp.int32)
    impl = resolve_impl(impl, lhs.dtype, dout.dtype)
    if impl == "ragged_dot":
        return reference.tgmm(lhs, dout, group_sizes)
    return pallas_gpu.tgmm(lhs, dout, group_sizes, blocks=blocks or DEFAULT_BLOCKS[2],
                           interpret=_interpret())

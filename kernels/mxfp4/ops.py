"""MXFP4 expert matmuls: the one place where an `impl` name is resolved.

impls: "reference" (dequantise in XLA, then `ragged_dot`; any platform) and "pallas_gpu" (the
Mosaic GPU kernel that reads the packed bytes; the interpreter runs it off-GPU). "auto" picks
"pallas_gpu" on Hopper for bf16/f16 activations.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.gmm.ops import _interpret, _is_hopper
from kernels.mxfp4 import pallas_gpu, reference
from kernels.mxfp4.format import BLOCK

IMPLS = ("reference", "pallas_gpu")


def resolve_impl(impl: str, dtype) -> str:
    if impl == "auto":
        ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        return "pallas_gpu" if ok and _is_hopper() else "reference"
    if impl not in IMPLS:
        raise ValueError(f"Unknown impl={impl!r}; expected 'auto' or one of {list(IMPLS)}")
    return impl


def gmm(x, packed, scales, group_sizes, *, impl="auto", blocks=None):
    """x [M, K] (rows sorted by group) @ dequantize(W[g])^T -> [M, N] in x's dtype.

    packed u8 [G, N, K/2], scales u8 [G, N, K/32], group_sizes [G] int. Forward only
    (inference): the packed weights are not differentiable.
    """
    if x.ndim != 2 or packed.ndim != 3 or scales.ndim != 3:
        raise ValueError(f"expected x [M, K], packed [G, N, K/2], scales [G, N, K/32]; got "
                         f"{x.shape}, {packed.shape}, {scales.shape}")
    g, n, kh = packed.shape
    k = x.shape[1]
    if kh * 2 != k or scales.shape != (g, n, k // BLOCK) or group_sizes.shape != (g,):
        raise ValueError(f"shape mismatch: x {x.shape}, packed {packed.shape}, scales "
                         f"{scales.shape}, group_sizes {group_sizes.shape}")
    group_sizes = group_sizes.astype(jnp.int32)
    if resolve_impl(impl, x.dtype) == "reference":
        return reference.gmm(x, packed, scales, group_sizes)
    return pallas_gpu.gmm(x, packed, scales, group_sizes, blocks=blocks or pallas_gpu.DEFAULT_BLOCKS,
                          interpret=_interpret())

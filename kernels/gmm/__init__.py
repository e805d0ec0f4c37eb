"""Grouped matmul (MoE expert computation): `gmm`, `tgmm`; see `ops.py`."""

from kernels.gmm.ops import IMPLS, gmm, resolve_impl, tgmm

__all__ = ["IMPLS", "gmm", "resolve_impl", "tgmm"]

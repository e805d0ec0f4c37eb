"""Grouped matmul (MoE expert computation): `gmm`, `tgmm` (see `ops.py`) and the fused gated
expert FFN `glu_ffn` (see `glu.py`)."""

from kernels.gmm.glu import glu_ffn
from kernels.gmm.ops import IMPLS, gmm, resolve_impl, tgmm

__all__ = ["IMPLS", "glu_ffn", "gmm", "resolve_impl", "tgmm"]

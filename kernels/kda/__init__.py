"""The delta-rule operator family: DeltaNet, Gated DeltaNet, KDA and (gated) linear attention.

    from kernels.kda import kda, kda_step, kda_gate, linear_attention

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H] | [B, T, H, K] (float32, <= 0);
beta None | [B, T, H]; state [B, H, K, V] float32. See `ops.py` for the contract.
"""

from kernels.kda.gate import kda_gate
from kernels.kda.ops import IMPLS, LINEAR_IMPLS, kda, kda_step, linear_attention, resolve_impl

__all__ = ["kda", "kda_step", "kda_gate", "linear_attention", "resolve_impl", "IMPLS", "LINEAR_IMPLS"]

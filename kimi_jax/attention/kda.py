"""Kimi Delta Attention: the delta rule with one decay per (head, key channel).

The decay comes from a low-rank projection z = f_b(f_a(x)) (rank = head_v_dim) through
`kernels.kda.kda_gate`: Kimi Linear's softplus form, or K3's bounded form
`lower_bound * sigmoid(exp(A_log) (z + dt_bias))` when `lower_bound` is set (K3: -5), which is
also passed to the kernel. The output gate is low-rank (rank head_v_dim) in Kimi Linear and
full-rank in K3 (`use_full_rank_gate`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from kernels.kda import kda_gate
from kimi_jax.attention.linear import DeltaNet, DeltaNetConfig, a_log_init, dt_bias_init
from kimi_jax.layers import Linear, param


@dataclasses.dataclass(frozen=True)
class KDAConfig(DeltaNetConfig):
    """gate_rank None = head_v_dim; lower_bound None = softplus gate, else the bounded gate
    (then A_log starts at 0, fla's safe_gate init)."""

    gate_rank: int | None = None
    use_full_rank_gate: bool = False
    lower_bound: float | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive("gate_rank", allow_none=("gate_rank",))
        if self.lower_bound is not None and not -1e4 < float(self.lower_bound) < 0:
            raise ValueError(f"lower_bound must be a negative float or None; got {self.lower_bound}")

    def decay_rank(self, d_model: int) -> int:
        return self.dims(d_model)[2] if self.gate_rank is None else self.gate_rank

    def output_gate_rank(self, d_model: int) -> int | None:
        return None if self.use_full_rank_gate else self.dims(d_model)[2]

    def gate_params(self, d_model: int) -> tuple[int, int]:
        H, K, _ = self.dims(d_model)
        R = self.decay_rank(d_model)
        return d_model * R + R * H * K, H + H * K  # f_a, f_b; A_log, dt_bias


class KDA(DeltaNet):
    """x [B, T, D] -> [B, T, D]; g [B, T, H, K] float32 from the low-rank decay projection."""

    def _init_gate(self, H, K, V, kw):
        R = self.config.decay_rank(self.d_model)
        self.f_a_proj = Linear(self.d_model, R, axes=("embed", "latent"), **kw)
        self.f_b_proj = Linear(R, (H, K), axes=("latent", "heads", "head_dim"), **kw)
        a_init = a_log_init if self.config.lower_bound is None else nnx.initializers.zeros
        self.A_log = param(kw["rngs"], a_init, (H,), ("heads",), kw["param_dtype"])
        self.dt_bias = param(kw["rngs"], dt_bias_init, (H, K), ("heads", "head_dim"), kw["param_dtype"])

    def _gate(self, x):
        z = self.f_b_proj(self.f_a_proj(x))
        g = kda_gate(z, self.A_log[...], self.dt_bias[...], lower_bound=self.config.lower_bound)
        return g.astype(jnp.float32)

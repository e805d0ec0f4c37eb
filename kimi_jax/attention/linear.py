"""The recurrent mixer family: linear attention, DeltaNet and Gated DeltaNet (KDA in `kda.py`
extends it). One pipeline (fla's layer form):

    q, k [B, T, H, K], v [B, T, H, V] = SiLU(short_conv(proj(x)));  q, k l2-normalised
    o = recurrence(q, k, v[, g, beta])            (kernels.kda: linear_attention / kda)
    y = o_proj(RMSNorm_V(o) * w * sigmoid(gate(x)))   (gate optional)

Training/prefill call the chunked kernels (`impl`); decode carries the conv windows and the
float32 state [B, H, K, V] and calls `kda_step` (one-token `linear_attention` for plain LA).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.kda import IMPLS, kda, kda_gate, kda_step, linear_attention
from kimi_jax.attention.common import CACHE_DTYPES, MixerConfig, constrain_btd, constrain_heads, constrain_layout
from kimi_jax.layers import GatedRMSNorm, Linear, ShortConv, l2_normalize, param

CHUNK = 64  # the chunk size the FLOP count assumes


def a_log_init(key, shape, dtype):
    """A_log = log(U(1, 16)) per head (fla / Kimi Linear)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def dt_bias_init(key, shape, dtype, dt_min=1e-3, dt_max=0.1, floor=1e-4):
    """Inverse softplus of dt ~ log-uniform[dt_min, dt_max] (clamped at `floor`), per channel."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig(MixerConfig):
    """head_dim (K) None = d_model // num_heads (then state_bytes needs it set); head_v_dim (V) None = K; conv_size 0 = no short
    conv (SiLU only); output_gate: full-rank sigmoid gate on the output norm; cache_dtype (conv
    windows) None = the compute dtype."""

    num_heads: int = 4
    head_dim: int | None = None
    head_v_dim: int | None = None
    conv_size: int = 4
    output_gate: bool = True
    norm_eps: float = 1e-5
    impl: str = "auto"
    cache_dtype: str | None = None

    DELTA = False  # beta and the delta rule (DeltaNet and below)

    def __post_init__(self):
        self._check_positive("num_heads", "head_dim", "head_v_dim", allow_none=("head_dim", "head_v_dim"))
        if not isinstance(self.conv_size, int) or self.conv_size < 0:
            raise ValueError(f"{type(self).__name__}.conv_size must be an int >= 0; got {self.conv_size!r}")
        self._check_choice("impl", ("auto",) + tuple(IMPLS))
        self._check_choice("cache_dtype", (None,) + CACHE_DTYPES)
        if not float(self.norm_eps) > 0:
            raise ValueError(f"norm_eps must be positive; got {self.norm_eps}")

    def dims(self, d_model: int) -> tuple[int, int, int]:
        """(H, K, V)."""
        K = self.head_dim
        if K is None:
            if d_model % self.num_heads:
                raise ValueError(f"num_heads={self.num_heads} must divide d_model={d_model} when head_dim is None")
            K = d_model // self.num_heads
        return self.num_heads, K, K if self.head_v_dim is None else self.head_v_dim

    def output_gate_rank(self, d_model: int) -> int | None:
        """None: full-rank output gate d -> H*V."""
        return None

    def gate_params(self, d_model: int) -> tuple[int, int]:
        """(matmul params, vector params) of the decay gate; none for plain LA / DeltaNet."""
        return 0, 0

    def _matmul_params(self, d: int) -> int:
        H, K, V = self.dims(d)
        n = 2 * d * H * K + d * H * V + H * V * d + (d * H if self.DELTA else 0) + self.gate_params(d)[0]
        if self.output_gate:
            r = self.output_gate_rank(d)
            n += d * H * V if r is None else d * r + r * H * V
        return n

    def _conv_channels(self, d: int) -> int:
        H, K, V = self.dims(d)
        return (2 * H * K + H * V) if self.conv_size else 0

    def num_params(self, d_model: int) -> int:
        V = self.dims(d_model)[2]
        conv = self.conv_size * self._conv_channels(d_model)
        return self._matmul_params(d_model) + conv + self.gate_params(d_model)[1] + V

    def cache_bytes_per_token(self) -> int:
        return 0

    def recurrent_state_bytes(self) -> int:
        """The float32 recurrent state alone, H*K*V*4 (what the K3 report's 414 MiB counts)."""
        if self.head_dim is None:
            raise ValueError("state_bytes needs an explicit head_dim (it depends on d_model otherwise)")
        H, K, V = self.dims(self.num_heads * self.head_dim)
        return H * K * V * 4

    def state_bytes(self) -> int:
        """float32 state H*K*V*4 plus conv windows (W-1) per q/k/v channel in the cache dtype."""
        H, K, V = self.dims(self.num_heads * self.head_dim) if self.head_dim is not None else (0, 0, 0)
        conv = max(self.conv_size - 1, 0) * (2 * H * K + H * V) * self.cache_itemsize() if self.conv_size else 0
        return self.recurrent_state_bytes() + conv

    def flops_per_token(self, d_model: int, seq_len: int) -> float:
        """Projections (2 per matmul weight), the depthwise conv, and the chunked recurrence with
        chunk C = min(64, seq_len), per token and head: linear attention 2CK + 2CV + 4KV (QK^T,
        AV, q S, S update); delta rule 6CK + 4CV + 6KV + C^2/3 (QK^T and KK^T, w = T k, u = T v,
        A v_new, w S, q S, S update, and the unit-triangular inverse)."""
        H, K, V = self.dims(d_model)
        C = min(CHUNK, seq_len)
        rec = 6 * C * K + 4 * C * V + 6 * K * V + C * C / 3 if self.DELTA else 2 * C * K + 2 * C * V + 4 * K * V
        conv = 2 * self.conv_size * self._conv_channels(d_model)
        return 2.0 * self._matmul_params(d_model) + conv + H * rec


@dataclasses.dataclass(frozen=True)
class DeltaNetConfig(LinearAttentionConfig):
    DELTA = True


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig(DeltaNetConfig):
    def gate_params(self, d_model: int) -> tuple[int, int]:
        H = self.num_heads
        return d_model * H, 2 * H  # a_proj; A_log, dt_bias


class LinearAttention(nnx.Module):
    """Plain linear attention S_t = S_{t-1} + k v^T with l2-normalised q, k (no decay)."""

    def __init__(self, config, d_model: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config, self.d_model, self.dtype = config, d_model, dtype
        H, K, V = config.dims(d_model)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(d_model, (H, K), axes=("embed", "heads", "head_dim"), **kw)
        self.k_proj = Linear(d_model, (H, K), axes=("embed", "heads", "head_dim"), **kw)
        self.v_proj = Linear(d_model, (H, V), axes=("embed", "heads", "head_dim"), **kw)
        if config.conv_size:
            conv = lambda D: ShortConv((H, D), kernel_size=config.conv_size, axes=("heads", "head_dim"), **kw)
            self.q_conv, self.k_conv, self.v_conv = conv(K), conv(K), conv(V)
        if config.DELTA:
            self.b_proj = Linear(d_model, H, axes=("embed", "heads"), **kw)
        self._init_gate(H, K, V, kw)
        r = config.output_gate_rank(d_model)
        if config.output_gate and r is None:
            self.g_proj = Linear(d_model, (H, V), axes=("embed", "heads", "head_dim"), **kw)
        elif config.output_gate:
            self.g_a_proj = Linear(d_model, r, axes=("embed", "latent"), **kw)
            self.g_b_proj = Linear(r, (H, V), axes=("latent", "heads", "head_dim"), **kw)
        self.o_norm = GatedRMSNorm(V, eps=config.norm_eps, **kw)
        self.o_proj = Linear((H, V), d_model, axes=("heads", "head_dim", "embed"), **kw)

    # --- hooks the subclasses override -------------------------------------------------------
    def _init_gate(self, H, K, V, kw):
        pass

    def _gate(self, x):
        """x [B, T, D] -> log-decay g (float32, <= 0) or None."""
        return None

    # --- shared pipeline ---------------------------------------------------------------------
    def _beta(self, x):
        return jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)) if self.config.DELTA else None

    def _output(self, x, o):
        """o [B, T, H, V] -> y [B, T, D]: per-head (gated) RMSNorm, then o_proj."""
        gate = None
        if self.config.output_gate:
            gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        return constrain_btd(self.o_proj(self.o_norm(o, gate)))

    def __call__(self, x, *, segment_ids=None):
        # The named scopes split the mixer's time in a profile (they only extend op names).
        x = constrain_btd(x)
        with jax.named_scope("proj"):
            q, k, v = (constrain_layout(constrain_heads(p(x))) for p in (self.q_proj, self.k_proj, self.v_proj))
        with jax.named_scope("conv"):
            if self.config.conv_size:
                q, k, v = (c(t, segment_ids) for c, t in ((self.q_conv, q), (self.k_conv, k), (self.v_conv, v)))
            else:
                q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
            q, k, v = constrain_layout(l2_normalize(q)), constrain_layout(l2_normalize(k)), constrain_layout(v)
        if self.config.DELTA:
            with jax.named_scope("gate"):
                g, beta = constrain_layout(self._gate(x)), self._beta(x)
            with jax.named_scope("recurrence"):
                lb = getattr(self.config, "lower_bound", None)
                o, _ = kda(q, k, v, g, beta, segment_ids=segment_ids, lower_bound=lb, impl=self.config.impl)
        else:
            with jax.named_scope("recurrence"):
                o, _ = linear_attention(q, k, v, segment_ids=segment_ids, impl=self.config.impl)
        with jax.named_scope("out"):
            return self._output(x, constrain_layout(o))

    def init_cache(self, batch_size: int, max_len: int):
        """{"state": [B, H, K, V] float32, "conv_q"/"conv_k"/"conv_v": [B, W-1, H, K|V]}; max_len unused."""
        del max_len
        H, K, V = self.config.dims(self.d_model)
        cache = {"state": jnp.zeros((batch_size, H, K, V), jnp.float32)}
        if self.config.conv_size:
            dt = self.config.resolve_cache_dtype(self.dtype)
            for name in ("q", "k", "v"):
                cache[f"conv_{name}"] = getattr(self, f"{name}_conv").init_cache(batch_size, dt)
        return cache

    def decode(self, x, cache):
        """x [B, 1, D] -> (y [B, 1, D], cache)."""
        if x.ndim != 3 or x.shape[1] != 1:
            raise ValueError(f"decode takes one token x [B, 1, D]; got x.shape={x.shape}")
        x = constrain_btd(x)
        q, k, v = (p(x)[:, 0] for p in (self.q_proj, self.k_proj, self.v_proj))
        new = {}
        if self.config.conv_size:
            q, new["conv_q"] = self.q_conv.step(q, cache["conv_q"])
            k, new["conv_k"] = self.k_conv.step(k, cache["conv_k"])
            v, new["conv_v"] = self.v_conv.step(v, cache["conv_v"])
        else:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        q, k = l2_normalize(q), l2_normalize(k)
        if self.config.DELTA:
            g = self._gate(x)
            o, new["state"] = kda_step(cache["state"], q, k, v, None if g is None else g[:, 0], self._beta(x)[:, 0])
        else:
            o, S = linear_attention(
                q[:, None], k[:, None], v[:, None], initial_state=cache["state"], output_final_state=True, impl="naive"
            )
            o, new["state"] = o[:, 0], S
        return self._output(x, o[:, None]), new


class DeltaNet(LinearAttention):
    """Delta rule S_t = (I - beta k k^T) S_{t-1} + beta k v^T, beta = sigmoid(b_proj(x))."""


class GatedDeltaNet(DeltaNet):
    """Delta rule with one decay per head: g = -exp(A_log) softplus(a_proj(x) + dt_bias)."""

    def _init_gate(self, H, K, V, kw):
        self.a_proj = Linear(self.d_model, H, axes=("embed", "heads"), **kw)
        self.A_log = param(kw["rngs"], a_log_init, (H,), ("heads",), kw["param_dtype"])
        self.dt_bias = param(kw["rngs"], dt_bias_init, (H,), ("heads",), kw["param_dtype"])

    def _gate(self, x):
        z = self.a_proj(x)[..., None]  # [B, T, H, 1]
        return kda_gate(z, self.A_log[...], self.dt_bias[...][:, None])[..., 0]

"""Causal softmax multi-head attention with GQA, optional RoPE, packed-document masking and a
growing KV cache; training/prefill attention through attention/core.py (cuDNN flash attention
on GPU where it applies, else the float32-logit XLA path)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.attention.common import (
    CACHE_DTYPES,
    MixerConfig,
    check_cache_room,
    constrain_btd,
    constrain_heads,
    xla_attention,
)
from kimi_jax.attention.core import DEFAULT_MAX_SEGMENTS, IMPLS, attention, check_max_segments
from kimi_jax.config import check_dropout_rate
from kimi_jax.layers import Linear, apply_rope, segment_positions


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig(MixerConfig):
    """num_kv_heads None = num_heads (MHA); head_dim None = d_model // num_heads (then
    the byte counts need it set); rope_theta None = NoPE; cache_dtype None = the compute dtype.
    impl picks the training/prefill attention ("auto", "xla", "cudnn"; see attention/core.py)
    and max_segments bounds the packed documents per row on the cuDNN path. dropout: the rate of
    dropout on the attention probabilities in training (Zoology's attention: 0.1), applied when the
    model is called with a dropout key; it runs the XLA attention path."""

    num_heads: int = 8
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = 10000.0
    impl: str = "auto"
    cache_dtype: str | None = None
    max_segments: int = DEFAULT_MAX_SEGMENTS
    dropout: float = 0.0

    def __post_init__(self):
        self._check_positive("num_heads", "num_kv_heads", "head_dim", allow_none=("num_kv_heads", "head_dim"))
        self._check_choice("impl", IMPLS)
        check_dropout_rate("SoftmaxConfig.dropout", self.dropout)
        check_max_segments(self.max_segments)
        self._check_choice("cache_dtype", (None,) + CACHE_DTYPES)
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}")
        if self.rope_theta is not None and not float(self.rope_theta) > 0:
            raise ValueError(f"rope_theta must be positive or None (NoPE); got {self.rope_theta}")
        if self.rope_theta is not None and self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; got head_dim={self.head_dim}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def dims(self, d_model: int) -> tuple[int, int, int]:
        """(H, G, Dh): query heads, kv heads, head dim."""
        if self.head_dim is None:
            if d_model % self.num_heads:
                raise ValueError(f"num_heads={self.num_heads} must divide d_model={d_model} when head_dim is None")
            Dh = d_model // self.num_heads
            if self.rope_theta is not None and Dh % 2:
                raise ValueError(f"RoPE needs an even head dim; d_model // num_heads = {Dh}")
            return self.num_heads, self.kv_heads, Dh
        return self.num_heads, self.kv_heads, self.head_dim

    def num_params(self, d_model: int) -> int:
        H, G, Dh = self.dims(d_model)
        return 2 * d_model * H * Dh + 2 * d_model * G * Dh

    def cache_bytes_per_token(self) -> int:
        if self.head_dim is None:
            raise ValueError("cache_bytes_per_token needs an explicit head_dim (it depends on d_model otherwise)")
        return 2 * self.kv_heads * self.head_dim * self.cache_itemsize()

    def state_bytes(self) -> int:
        return 0

    def flops_per_token(self, d_model: int, seq_len: int) -> float:
        H, _, Dh = self.dims(d_model)
        return 2.0 * self.num_params(d_model) + 4.0 * H * Dh * (seq_len / 2)


class SoftmaxAttention(nnx.Module):
    """x [B, T, D] -> [B, T, D]; GQA with G kv heads shared by groups of H/G query heads."""

    def __init__(self, config: SoftmaxConfig, d_model: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config, self.d_model, self.dtype = config, d_model, dtype
        H, G, Dh = config.dims(d_model)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(d_model, (H, Dh), axes=("embed", "heads", "head_dim"), **kw)
        self.k_proj = Linear(d_model, (G, Dh), axes=("embed", "kv_heads", "head_dim"), **kw)
        self.v_proj = Linear(d_model, (G, Dh), axes=("embed", "kv_heads", "head_dim"), **kw)
        self.o_proj = Linear((H, Dh), d_model, axes=("heads", "head_dim", "embed"), **kw)

    def _qkv(self, x, positions):
        q, k, v = (constrain_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.config.rope_theta is not None:
            q = apply_rope(q, positions, self.config.rope_theta)
            k = apply_rope(k, positions, self.config.rope_theta)
        return q, k, v

    def __call__(self, x, *, segment_ids=None, dropout_key=None):
        """`dropout_key` (training): dropout at `config.dropout` on the attention probabilities."""
        x = constrain_btd(x)
        B, T, _ = x.shape
        q, k, v = self._qkv(x, segment_positions(segment_ids, T, B))
        drop = (self.config.dropout, dropout_key) if dropout_key is not None and self.config.dropout else None
        o = attention(q, k, v, segment_ids, scale=q.shape[-1] ** -0.5, impl=self.config.impl,
                      max_segments=self.config.max_segments, dropout=drop)
        return constrain_btd(self.o_proj(o))

    def init_cache(self, batch_size: int, max_len: int):
        """{"k", "v": [B, max_len, G, Dh] in the cache dtype, "pos": [] int32 (tokens so far)}."""
        _, G, Dh = self.config.dims(self.d_model)
        dt = self.config.resolve_cache_dtype(self.dtype)
        kv = jnp.zeros((batch_size, max_len, G, Dh), dt)
        return {"k": kv, "v": kv, "pos": jnp.zeros((), jnp.int32)}

    def decode(self, x, cache):
        """x [B, 1, D] at position cache["pos"] -> (y [B, 1, D], cache); needs pos < max_len."""
        B = x.shape[0]
        if x.shape[1] != 1:
            raise ValueError(f"decode takes one token x [B, 1, D]; got x.shape={x.shape}")
        pos = cache["pos"]
        check_cache_room(pos, cache["k"].shape[1])
        q, k, v = self._qkv(constrain_btd(x), jnp.full((B, 1), pos, jnp.int32))
        k_cache = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, pos, 0, 0))
        valid = (jnp.arange(k_cache.shape[1]) <= pos)[None, None, None, :]
        o = xla_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), valid, q.shape[-1] ** -0.5)
        return constrain_btd(self.o_proj(o)), {"k": k_cache, "v": v_cache, "pos": pos + 1}

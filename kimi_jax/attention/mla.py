"""Multi-head latent attention (DeepSeek-V2 MLA) in Kimi's gated NoPE form.

    q [B, T, H, n+r]    = q_b(RMSNorm(q_a(x)))  (or q_proj(x) without q compression)
    [c; k_pe]           = kv_a(x);  c = RMSNorm(c)  (c [B, T, C] is the latent, C = kv_lora_rank)
    [k_nope; v]         = kv_b(c);  k = [k_nope; k_pe broadcast over heads]
    o = softmax(q k^T / sqrt(n+r)) v;   y = o_proj(o * sigmoid(g_proj(x)))   (gate optional)

The r "rope" dims are computed, cached and attended but not rotated unless `rope_theta` is set
(DeepSeek's decoupled RoPE). Decode caches only [c; k_pe] per token ((C + r) values) and attends
in the latent space with kv_b absorbed into the query and the output (`absorb=True`).
"""

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
from kimi_jax.layers import Linear, RMSNorm, apply_rope, segment_positions


@dataclasses.dataclass(frozen=True)
class MLAConfig(MixerConfig):
    """q_lora_rank None = direct q projection; rope_theta None = NoPE (Kimi); norm_eps is the
    eps of the q/kv latent norms; cache_dtype None = the compute dtype. attention_impl picks the
    training/prefill attention ("auto", "xla", "cudnn"; see attention/core.py) and max_segments
    bounds the packed documents per row on the cuDNN path."""

    num_heads: int = 8
    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 0
    v_head_dim: int = 32
    output_gate: bool = True
    rope_theta: float | None = None
    norm_eps: float = 1e-6
    cache_dtype: str | None = None
    attention_impl: str = "auto"
    max_segments: int = DEFAULT_MAX_SEGMENTS

    def __post_init__(self):
        self._check_choice("attention_impl", IMPLS)
        check_max_segments(self.max_segments)
        self._check_positive(
            "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", allow_none=("q_lora_rank",)
        )
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be an int >= 0; got {self.qk_rope_head_dim!r}")
        if self.rope_theta is not None:
            if not float(self.rope_theta) > 0:
                raise ValueError(f"rope_theta must be positive or None (NoPE); got {self.rope_theta}")
            if self.qk_rope_head_dim == 0 or self.qk_rope_head_dim % 2:
                raise ValueError(
                    f"rope_theta needs an even qk_rope_head_dim > 0 (the decoupled RoPE part); "
                    f"got qk_rope_head_dim={self.qk_rope_head_dim}"
                )
        self._check_choice("cache_dtype", (None,) + CACHE_DTYPES)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _matmul_params(self, d: int) -> int:
        H, C, R = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        q = d * H * self.qk_head_dim if self.q_lora_rank is None else self.q_lora_rank * (d + H * self.qk_head_dim)
        gate = d * H * self.v_head_dim if self.output_gate else 0
        return q + d * (C + R) + C * H * (self.qk_nope_head_dim + self.v_head_dim) + gate + H * self.v_head_dim * d

    def num_params(self, d_model: int) -> int:
        return self._matmul_params(d_model) + self.kv_lora_rank + (self.q_lora_rank or 0)

    def cache_bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.cache_itemsize()

    def state_bytes(self) -> int:
        return 0

    def flops_per_token(self, d_model: int, seq_len: int) -> float:
        """Projections plus the MHA-mode (training) attention over the average context seq_len/2."""
        H = self.num_heads
        return 2.0 * self._matmul_params(d_model) + 2.0 * H * (self.qk_head_dim + self.v_head_dim) * (seq_len / 2)


class MLA(nnx.Module):
    """x [B, T, D] -> [B, T, D]; cache {"ckv": [B, L, C], "kpe": [B, L, r], "pos": []}."""

    def __init__(self, config: MLAConfig, d_model: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config, self.d_model, self.dtype = config, d_model, dtype
        c, H = config, config.num_heads
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if c.q_lora_rank is None:
            self.q_proj = Linear(d_model, (H, c.qk_head_dim), axes=("embed", "heads", "head_dim"), **kw)
        else:
            self.q_a_proj = Linear(d_model, c.q_lora_rank, axes=("embed", "q_lora"), **kw)
            self.q_a_norm = RMSNorm(c.q_lora_rank, eps=c.norm_eps, **kw)
            self.q_b_proj = Linear(c.q_lora_rank, (H, c.qk_head_dim), axes=("q_lora", "heads", "head_dim"), **kw)
        self.kv_a_proj = Linear(d_model, c.kv_lora_rank + c.qk_rope_head_dim, axes=("embed", "kv_lora"), **kw)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, eps=c.norm_eps, **kw)
        self.kv_b_proj = Linear(
            c.kv_lora_rank, (H, c.qk_nope_head_dim + c.v_head_dim), axes=("kv_lora", "heads", "head_dim"), **kw
        )
        if c.output_gate:
            self.g_proj = Linear(d_model, (H, c.v_head_dim), axes=("embed", "heads", "head_dim"), **kw)
        self.o_proj = Linear((H, c.v_head_dim), d_model, axes=("heads", "head_dim", "embed"), **kw)

    def _project(self, x, positions):
        """x [B, T, D] -> q_nope [B, T, H, n], q_pe [B, T, H, r], c [B, T, C], k_pe [B, T, r]."""
        c = self.config
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = constrain_heads(q)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        kv = self.kv_a_proj(x)
        latent, k_pe = self.kv_a_norm(kv[..., : c.kv_lora_rank]), kv[..., c.kv_lora_rank :]
        if c.rope_theta is not None:
            q_pe = apply_rope(q_pe, positions, c.rope_theta)
            k_pe = apply_rope(k_pe[:, :, None], positions, c.rope_theta)[:, :, 0]
        return q_nope, q_pe, latent, k_pe

    def _expand(self, q_nope, q_pe, latent, k_pe):
        """Naive (MHA-mode) q, k, v from the latent: [B, T, H, n+r], [B, S, H, n+r], [B, S, H, v]."""
        n, H = self.config.qk_nope_head_dim, self.config.num_heads
        kv = constrain_heads(self.kv_b_proj(latent))
        k_nope, v = kv[..., :n], kv[..., n:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None], k_pe.shape[:2] + (H, k_pe.shape[-1]))], -1)
        return jnp.concatenate([q_nope, q_pe], -1), k, v

    def _output(self, x, o):
        if self.config.output_gate:
            o = (o.astype(jnp.float32) * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32))).astype(self.dtype)
        return constrain_btd(self.o_proj(o))

    def __call__(self, x, *, segment_ids=None):
        x = constrain_btd(x)
        B, T, _ = x.shape
        q, k, v = self._expand(*self._project(x, segment_positions(segment_ids, T, B)))
        c = self.config
        o = attention(q, k, v, segment_ids, scale=c.qk_head_dim**-0.5, impl=c.attention_impl,
                      max_segments=c.max_segments)
        return self._output(x, o)

    def init_cache(self, batch_size: int, max_len: int):
        dt = self.config.resolve_cache_dtype(self.dtype)
        return {
            "ckv": jnp.zeros((batch_size, max_len, self.config.kv_lora_rank), dt),
            "kpe": jnp.zeros((batch_size, max_len, self.config.qk_rope_head_dim), dt),
            "pos": jnp.zeros((), jnp.int32),
        }

    def decode(self, x, cache, *, absorb: bool = True):
        """x [B, 1, D] at position cache["pos"] -> (y [B, 1, D], cache); needs pos < max_len.

        absorb=True attends in the latent space (kv_b folded into q and the output);
        absorb=False re-expands the cached latents through kv_b (the naive path)."""
        if x.ndim != 3 or x.shape[1] != 1:
            raise ValueError(f"decode takes one token x [B, 1, D]; got x.shape={x.shape}")
        x = constrain_btd(x)
        pos = cache["pos"]
        check_cache_room(pos, cache["ckv"].shape[1])
        q_nope, q_pe, latent, k_pe = self._project(x, jnp.full((x.shape[0], 1), pos, jnp.int32))
        ckv = jax.lax.dynamic_update_slice(cache["ckv"], latent.astype(cache["ckv"].dtype), (0, pos, 0))
        kpe = jax.lax.dynamic_update_slice(cache["kpe"], k_pe.astype(cache["kpe"].dtype), (0, pos, 0))
        valid = jnp.arange(ckv.shape[1]) <= pos  # [L]
        latents, k_pes = ckv.astype(self.dtype), kpe.astype(self.dtype)
        scale = self.config.qk_head_dim**-0.5
        if absorb:
            o = self._absorbed(q_nope[:, 0], q_pe[:, 0], latents, k_pes, valid, scale)[:, None]
        else:
            q, k, v = self._expand(q_nope, q_pe, latents, k_pes)
            o = xla_attention(q, k, v, valid[None, None, None, :], scale)
        return self._output(x, o), {"ckv": ckv, "kpe": kpe, "pos": pos + 1}

    def _absorbed(self, q_nope, q_pe, latents, k_pes, valid, scale):
        """q_nope [B, H, n], q_pe [B, H, r]; latents [B, L, C], k_pes [B, L, r] -> o [B, H, v]."""
        n = self.config.qk_nope_head_dim
        w = self.kv_b_proj.kernel[...].astype(self.dtype)  # [C, H, n+v]
        f32 = dict(preferred_element_type=jnp.float32)
        q_lat = jnp.einsum("bhn,chn->bhc", q_nope, w[..., :n], **f32).astype(self.dtype)
        s = jnp.einsum("bhc,blc->bhl", q_lat, latents, **f32) + jnp.einsum("bhr,blr->bhl", q_pe, k_pes, **f32)
        p = jax.nn.softmax(jnp.where(valid, s * scale, jnp.finfo(jnp.float32).min), axis=-1)
        o_lat = jnp.einsum("bhl,blc->bhc", p.astype(self.dtype), latents, **f32).astype(self.dtype)
        return jnp.einsum("bhc,chv->bhv", o_lat, w[..., n:], **f32).astype(self.dtype)

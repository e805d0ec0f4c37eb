"""Pieces shared by the mixers: settings parsing into frozen configs, the cache dtype rule,
activation constraints and the float32 XLA attention used by softmax attention and MLA."""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from kimi_jax.layers import dropout as apply_dropout, read_setting, traced_setting
from kimi_jax.sharding import constrain

BTD = ("act_batch", "act_len", "act_embed")
BTHD = ("act_batch", "act_len", "act_heads", "act_kv")
CACHE_DTYPES = ("bfloat16", "float16", "float32")


class MixerConfig:
    """Mixin for the frozen config dataclasses: parsing from a settings dict, and checks."""

    @classmethod
    def from_settings(cls, settings):
        settings = {} if settings is None else dict(settings)
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in settings if k not in allowed)
        if unknown:
            raise ValueError(f"Unknown settings {unknown} for {cls.__name__}; expected a subset of {allowed}")
        return cls(**settings)

    def _check_positive(self, *names, allow_none=()):
        for name in names:
            v = getattr(self, name)
            if v is None and name in allow_none:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive int; got {v!r}")

    def _check_choice(self, name, choices):
        v = getattr(self, name)
        if v not in choices:
            raise ValueError(f"Unknown {type(self).__name__}.{name}={v!r}; expected one of {list(choices)}")

    def cache_itemsize(self) -> int:
        """Bytes per cached value: the `cache_dtype` setting, or bfloat16 (the serving dtype of
        the released models) when it follows the compute dtype (None)."""
        return jnp.dtype(self.cache_dtype or "bfloat16").itemsize

    def resolve_cache_dtype(self, compute_dtype):
        return jnp.dtype(self.cache_dtype) if self.cache_dtype else jnp.dtype(compute_dtype)


# Physical layout of the recurrent mixers' [B, T, H, D] activations (read while tracing).
# "xla": XLA's layout assignment chooses; in the optimized HLO of configs/k3_1b3_dense.py's KDA
# layer on an H200 it made the projection outputs T-minor, so every step into or out of the
# chunked [N, B, H, C, K] layout is a 2D transpose. "row_major": layout constraints keep D minor
# at the mixer's boundaries (projections, convolutions, gate, output); on an H200 the KDA layer
# took 14.77 ms of kernels against 11.17 with "xla" (the op's backward rule 8.13 against 3.80;
# kda-mixer-profile-screen-*-h200-20261130T1937.json), so "xla" stays.
ACTIVATION_LAYOUTS = ("xla", "row_major")
ACTIVATION_LAYOUT = "xla"


def activation_layout(mode: str | None):
    """Within the block, trace the recurrent mixers with activation layout `mode` (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "ACTIVATION_LAYOUT", ACTIVATION_LAYOUTS, mode)


def constrain_layout(x):
    """x with its last dim minor (row-major) when ACTIVATION_LAYOUT says "row_major", else x."""
    if read_setting(sys.modules[__name__], "ACTIVATION_LAYOUT", ACTIVATION_LAYOUTS) == "xla" or x is None:
        return x
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def constrain_btd(x):
    return constrain(x, BTD)


def constrain_heads(x):
    return constrain(x, BTHD)


def check_cache_room(pos, max_len: int) -> None:
    """Raise when a concrete cache position is full (under jit the write would be clamped)."""
    if not isinstance(pos, jax.core.Tracer) and int(pos) >= max_len:
        raise ValueError(f"cache is full: position {int(pos)} >= max_len={max_len}; init_cache with a larger max_len")


def causal_mask(segment_ids, T: int, batch_size: int):
    """[B, 1, T, T] bool: causal, and within one packed document when segment_ids [B, T] is given."""
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is not None:
        if segment_ids.shape != (batch_size, T):
            raise ValueError(f"segment_ids must be [B, T] = {(batch_size, T)}; got {segment_ids.shape}")
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jnp.broadcast_to(mask, (batch_size, 1, T, T))


def xla_attention(q, k, v, mask, scale: float, dropout=None):
    """Softmax attention in float32 logits: q [B, T, H, Dk]; k [B, S, G, Dk]; v [B, S, G, Dv]
    with H a multiple of G (GQA); mask broadcastable to [B, H, T, S]. Returns [B, T, H, Dv].
    `dropout` = (rate, key): inverted dropout on the attention probabilities (training)."""
    B, T, H, Dk = q.shape
    G = k.shape[2]
    if H % G or k.shape[-1] != Dk or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"xla_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit")
    qg = q.reshape(B, T, G, H // G, Dk)
    logits = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32) * scale
    m = mask.reshape(mask.shape[0], -1, 1, *mask.shape[-2:]) if mask.shape[1] == 1 else mask.reshape(
        mask.shape[0], G, H // G, *mask.shape[-2:]
    )
    logits = jnp.where(m, logits, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(logits, axis=-1)
    if dropout is not None:
        p = apply_dropout(p, *dropout)
    out = jnp.einsum("bgrts,bsgd->btgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, v.shape[-1]).astype(v.dtype)


def blocked_xla_attention(q, k, v, segment_ids, scale: float, block: int = 512, dropout=None):
    """`xla_attention` under the causal (and same-document) mask, `block` query rows at a time:
    [B, H, block, T] float32 logits are live at once, recomputed per block in the backward, where
    the one-shot form holds [B, H, T, T] (4 GiB at B=4, H=16, T=4096, more in its backward) and
    would not fit at long T. Same arguments and result as `xla_attention(q, k, v, causal_mask(...))`;
    with `dropout` = (rate, key) each query block draws its mask from the key folded with its index."""
    B, T, H, Dk = q.shape
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")
    if T <= block:
        return xla_attention(q, k, v, causal_mask(segment_ids, T, B), scale, dropout)
    nb = -(-T // block)
    pad = nb * block - T  # padded query rows attend to something finite and are cut off below
    blocks = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(  # noqa: E731
        B, nb, block, *x.shape[2:]), 1, 0)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(args):
        i, q_blk, seg_blk = args  # [B, block, H, Dk], [B, block]
        rows = i * block + jnp.arange(block)
        mask = (rows[:, None] >= jnp.arange(T)[None, :])[None, None]  # [1, 1, block, T]
        if segment_ids is not None:
            mask = mask & (seg_blk[:, None, :, None] == seg[:, None, None, :])
        drop = None if dropout is None else (dropout[0], jax.random.fold_in(dropout[1], i))
        return xla_attention(q_blk, k, v, mask, scale, drop)

    out = jax.lax.map(one, (jnp.arange(nb), blocks(q), blocks(seg)))  # [nb, B, block, H, Dv]
    return jnp.moveaxis(out, 0, 1).reshape(B, nb * block, H, -1)[:, :T]

"""Residual streams: plain pre-norm residuals, and K3's block Attention Residuals.

Block AttnRes (Kimi Team 2026, arXiv 2603.15031; K3 §2.6): instead of adding every sublayer
output into one stream, the layers are grouped into blocks of `block_size` decoder layers and
each read site attends over the earlier block sums:

    sources = [embedding, block_1, ..., block_{n-1}, partial sum of the current block]
    p = softmax_s(<w, RMSNorm_noweight(v_s)>),  w = norm_weight * proj_weight   (float32)
    read = sum_s p_s v_s                         (unnormalised values)

with one learned query per read site (two per decoder layer, one before the output norm). The
query is zero-initialised, so the first reads are uniform averages. Per decoder layer l:
x = read_attn (or the prefix when no block is finished); if l % block_size == 0 the prefix is
pushed as a finished block; prefix += mixer(norm(x)); x = read_mlp; prefix += ffn(norm(x)).
Reads mix across depth only, never across time, so decoding one token needs no extra cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.layers import param, rms_normalize


class AttnResRead(nnx.Module):
    """One read site: sources [S] x [..., D] -> [..., D] (softmax over the S sources)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps, self.dtype = float(eps), dtype
        self.norm = param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)
        self.query = param(rngs, nnx.initializers.zeros, (dim,), ("norm",), param_dtype)

    def __call__(self, sources):
        if not sources:
            raise ValueError("AttnResRead needs at least one source")
        v = jnp.stack([s.astype(jnp.float32) for s in sources])  # [S, ..., D]
        w = self.norm[...].astype(jnp.float32) * self.query[...].astype(jnp.float32)
        logits = jnp.einsum("s...d,d->s...", rms_normalize(v, self.eps), w)
        p = jax.nn.softmax(logits, axis=0)
        return jnp.einsum("s...,s...d->...d", p, v).astype(self.dtype)


class PlainStream:
    """h += mixer(norm(h)); h += ffn(norm(h)). Python state threaded through one forward pass."""

    def __init__(self, embedding):
        self.h = embedding

    def before_mixer(self, read, layer: int):
        return self.h

    def before_ffn(self, read):
        return self.h

    def add(self, y):
        self.h = self.h + y.astype(self.h.dtype)

    def final(self, read):
        return self.h


class BlockAttnResStream:
    """Block attention residuals with finished blocks `blocks` and the running `prefix`."""

    def __init__(self, embedding, block_size: int):
        self.blocks, self.prefix, self.block_size = [], embedding, int(block_size)

    def before_mixer(self, read, layer: int):
        x = read(self.blocks + [self.prefix]) if self.blocks else self.prefix
        if layer % self.block_size == 0:
            self.blocks.append(self.prefix)
            self.prefix = None
        return x

    def before_ffn(self, read):
        return read(self._sources())

    def add(self, y):
        self.prefix = y if self.prefix is None else self.prefix + y.astype(self.prefix.dtype)

    def final(self, read):
        return read(self._sources())

    def _sources(self):
        return self.blocks + ([] if self.prefix is None else [self.prefix])


def make_stream(kind: str, embedding, block_size: int = 1):
    """The one place a residual kind is resolved."""
    if kind == "plain":
        return PlainStream(embedding)
    if kind == "attn_res":
        return BlockAttnResStream(embedding, block_size)
    raise ValueError(f"Unknown residual={kind!r}; expected one of ['attn_res', 'plain']")

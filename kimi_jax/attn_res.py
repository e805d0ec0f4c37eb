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

import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.layers import param, read_setting, rms_normalize, traced_setting

# What the backward may do with a read's output (read while tracing; `read_out(mode)` sets it for
# a block): "xla" leaves it to XLA, which in the 1.3B step's profile recomputes a read from its
# sources inside a backward fusion (one fusion of 5.8 ms at 464 GB/s reads about 40 source-sized
# arrays; train-profile-h200-20261130T2221.json); "saved" (default) puts the output behind an
# optimization barrier, so the backward reads the one stored copy instead. On an H200 the step
# took 405.9 ms with "saved" alone against 410.1 with "xla", and 393.9 with "saved" and the
# short conv's kernel backward (`layers.CONV_DW`), the pair now the default; temporaries unchanged
# (86.2 GiB; train-convdwda-saved-split-h200-20261201T0314.json).
READ_OUT = "saved"
READ_OUT_MODES = ("xla", "saved")


def read_out(mode: str | None):
    """Within the block, trace the read sites' outputs as `mode` says (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "READ_OUT", READ_OUT_MODES, mode)


def read_reference(sources, w, eps: float):
    """The read by autodiff-able stacking: sources [S] x [..., D], w [D] -> [..., D] float32."""
    v = jnp.stack([s.astype(jnp.float32) for s in sources])  # [S, ..., D]
    logits = jnp.einsum("s...d,d->s...", rms_normalize(v, eps), w)
    p = jax.nn.softmax(logits, axis=0)
    return jnp.einsum("s...,s...d->...d", p, v)


def _scores(sources, w, eps):
    """Per source (never stacked): r_s = rsqrt(mean(v_s^2) + eps), logit_s = r_s <v_s, w>."""
    r, logits = [], []
    for s in sources:
        v = s.astype(jnp.float32)
        r_s = jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)
        r.append(r_s)
        logits.append(r_s * jnp.einsum("...d,d->...", v, w))
    logits = jnp.stack(logits)  # [S, ...]: one scalar per token and source
    return jnp.stack(r), logits, jax.nn.softmax(logits, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def read(sources: tuple, w, eps: float):
    """`read_reference` without the float32 [S, ..., D] stack: each source is read in its own
    dtype by two fusions (scores, weighted sum); the backward reads each source twice more
    (dp_s, then dv_s) instead of differentiating through stacked float32 copies, which cost ~1 ms
    per read on an H200 at 4 x 4096 x 2048 (48 reads per step of the 1.3B model)."""
    return _read_fwd(sources, w, eps)[0]


def _weighted(sources, p):
    out = p[0][..., None] * sources[0].astype(jnp.float32)
    for p_s, s in zip(p[1:], sources[1:]):
        out = out + p_s[..., None] * s.astype(jnp.float32)
    return out


def _read_fwd(sources, w, eps):
    sources = tuple(sources)
    r, logits, p = _scores(sources, w, eps)
    return _weighted(sources, p), (sources, w, r, logits, p)


def _read_bwd(eps, res, g):
    del eps
    sources, w, r, logits, p = res
    dp = jnp.stack([jnp.einsum("...d,...d->...", g, s.astype(jnp.float32)) for s in sources])
    dl = p * (dp - jnp.sum(p * dp, axis=0))  # softmax backward, [S, ...]
    D = w.shape[-1]
    dsources, dw = [], jnp.zeros_like(w)
    for i, s in enumerate(sources):
        v = s.astype(jnp.float32)
        # d logit / d v = r w - logit r^2 v / D  (r = rsqrt(mean(v^2) + eps))
        c = dl[i] * r[i]
        dv = p[i][..., None] * g + c[..., None] * w - (c * logits[i] * r[i] / D)[..., None] * v
        dsources.append(dv.astype(s.dtype))
        dw = dw + jnp.einsum("...,...d->d", c, v)
    return tuple(dsources), dw


read.defvjp(_read_fwd, _read_bwd)


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
        dims = {tuple(s.shape) for s in sources}
        if len(dims) != 1:
            raise ValueError(f"AttnResRead sources must share one shape; got {sorted(dims)}")
        w = self.norm[...].astype(jnp.float32) * self.query[...].astype(jnp.float32)
        out = read(tuple(sources), w, self.eps).astype(self.dtype)
        if read_setting(sys.modules[__name__], "READ_OUT", READ_OUT_MODES) == "saved":
            out = jax.lax.optimization_barrier(out)
        return out


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

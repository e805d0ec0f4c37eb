"""KDA / Gated DeltaNet / DeltaNet as Pallas Mosaic TPU kernels, forward and backward (`impl="pallas_tpu"`).

`impl="auto"` picks this on TPU. Elsewhere it runs only when `impl="pallas_tpu"` is asked for,
and then in TPU interpret mode (`pltpu.InterpretParams()`: the kernels are simulated on CPU, slowly;
for tests). `interpret` is passed through every entry point: None = interpret unless on a TPU.

Pipeline (stages of `pallas_tpu_kernels.py`, shapes in `pallas_tpu_plan.plan`): XLA pads T to the
chunk (g = 0, beta = 0, zeros: the state passes through unchanged), takes the chunk-local cumsum
G of g and the chunk-local count of segment starts, then fwd_prepare (chunk-parallel) and
fwd_state (serial over chunks, state in VMEM scratch) run under a `jax.custom_vjp` whose backward
is bwd_state (reverse serial) and bwd_chunk (chunk-parallel). The cumsum, padding and layout
changes stay outside the custom_vjp, so XLA differentiates them (the cumsum's VJP is the reverse
chunk-local cumsum of dG). bf16 inputs use bf16 MXU operands; states, gates, the triangular
inverse and all accumulation are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from kernels.kda import pallas_tpu_kernels as tk
from kernels.kda.pallas_tpu_intra import BOUNDED_MIN_G
from kernels.kda.pallas_tpu_plan import DEFAULT_CHUNK, Plan, plan, unsupported_reason
from kernels.kda.validate import segment_starts

log = logging.getLogger(__name__)


def default_interpret(interpret=None):
    """None -> TPU interpret mode unless running on a TPU; False/True/InterpretParams kept."""
    if interpret is None:
        return False if jax.devices()[0].platform == "tpu" else pltpu.InterpretParams()
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


@dataclasses.dataclass(frozen=True)
class _Config:
    plan: Plan
    scale: float
    interpret: object
    bounded: bool  # g >= BOUNDED_MIN_G guaranteed: the all-MXU intra-chunk path

    @property
    def cd(self):
        return jnp.dtype(self.plan.dtype)

    def run(self, name, args, **params):
        stage = self.plan.stage(name)
        return tk.run_stage(stage, self.plan, name, params, args, self.interpret)


def _forward(cfg: _Config, q, k, v, G, beta, seg_row, decay, h0):
    qg, kg, w, u, aqk, ai = cfg.run(
        "fwd_prepare", (q, k, v, G, beta, seg_row), scale=cfg.scale, cd=cfg.cd, bounded=cfg.bounded
    )
    o, vn, hs, ht = cfg.run("fwd_state", (qg, kg, w, u, aqk, decay, h0), cd=cfg.cd)
    return (o, ht), (q, k, v, G, beta, seg_row, decay, qg, kg, w, aqk, ai, vn, hs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, G, beta, seg_row, decay, h0):
    return _forward(cfg, q, k, v, G, beta, seg_row, decay, h0)[0]


def _core_bwd(cfg, res, cts):
    q, k, v, G, beta, seg_row, decay, qg, kg, w, aqk, ai, vn, hs = res
    do, dht = cts
    do = do.astype(v.dtype)
    dvn, dh, dh0 = cfg.run("bwd_state", (qg, kg, w, aqk, decay, do, dht.astype(jnp.float32)), cd=cfg.cd)
    args = (q, k, v, G, beta, seg_row, ai, hs, dh, vn, dvn, do)
    dq, dk, dv, dbeta, dG, ddecay = cfg.run("bwd_chunk", args, scale=cfg.scale, cd=cfg.cd, bounded=cfg.bounded)
    return dq, dk, dv, dG, dbeta, jnp.zeros_like(seg_row), ddecay, dh0


_core.defvjp(_forward, _core_bwd)


def _chunk_cumsum(x, C):
    """Inclusive cumsum along axis 1 of x [B, Tp, ...], restarting every C steps."""
    B, Tp = x.shape[:2]
    return jnp.cumsum(x.reshape(B, Tp // C, C, *x.shape[2:]), axis=2).reshape(x.shape)


def chunk_kda_tpu(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None, lower_bound=None,
                  chunk_size=DEFAULT_CHUNK, interpret=None):
    """Chunked KDA over the canonical form (q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
    initial_state [B, H, K, V] or None; segment_ids [B, T] or None) with K, V in {64, 128} and
    bf16 or float32 inputs. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] f32).
    Differentiable in q, k, v, g, beta and initial_state. Raises ValueError on unsupported shapes.
    `lower_bound` >= -5 (the caller guarantees g >= lower_bound) selects the all-MXU intra-chunk
    path; otherwise the 16x16 diagonal blocks are evaluated elementwise, exact for any g <= 0."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    p = plan(B, T, H, K, V, jnp.dtype(q.dtype).name, chunk_size)
    C, Tp, NT = p.chunk, p.Tp, p.NT
    bounded = lower_bound is not None and float(lower_bound) >= BOUNDED_MIN_G
    cfg = _Config(p, float(scale), default_interpret(interpret), bounded)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))

    G = _chunk_cumsum(pad(g.astype(jnp.float32)), C)  # [B, Tp, H, K]
    starts = segment_starts(segment_ids, T)
    starts = jnp.zeros((B, T), jnp.float32) if starts is None else starts.astype(jnp.float32)
    count = _chunk_cumsum(pad(starts), C)  # segment starts so far in the chunk, [B, Tp]
    carry_last = (count[:, C - 1 :: C] == 0).astype(jnp.float32)  # [B, NT]
    decay = carry_last[:, :, None, None] * jnp.exp(G[:, C - 1 :: C])  # [B, NT, H, K]
    decay = decay.transpose(0, 2, 1, 3)[..., None, :]  # [B, H, NT, 1, K]

    def to_layout(x):  # [B, Tp, H, D] -> plan layout
        return x.reshape(B, Tp, -1) if p.layout == "flat" else x.transpose(0, 2, 1, 3)

    h0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    o, ht = _core(
        cfg,
        to_layout(pad(q)),
        to_layout(pad(k)),
        to_layout(pad(v)),
        to_layout(G),
        pad(beta.astype(jnp.float32)).transpose(0, 2, 1).reshape(B, H, NT, 1, C),
        count.reshape(B, NT, 1, C),
        decay,
        h0,
    )
    o = o.reshape(B, Tp, H, V) if p.layout == "flat" else o.transpose(0, 2, 1, 3)
    return o[:, :T], ht


def kda_impl(q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, output_final_state=True,
             interpret=None):
    """Canonical-form entry of the impl registry (see `kernels.kda.kda`). Calls the kernels cannot
    take (K or V outside {64, 128}, float16 / float64) fall back to `chunk` with a logged reason.
    `lower_bound` >= -5 selects the all-MXU intra-chunk path."""
    del output_final_state
    kw = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids, lower_bound=lower_bound)
    reason = unsupported_reason(q.shape[-1], v.shape[-1], jnp.dtype(q.dtype).name)
    if reason:
        log.warning("pallas_tpu falls back to chunk: %s", reason)
        from kernels.kda import chunk

        return chunk.kda_impl(q, k, v, g, beta, output_final_state=True, **kw)
    return chunk_kda_tpu(q, k, v, g, beta, interpret=interpret, **kw)

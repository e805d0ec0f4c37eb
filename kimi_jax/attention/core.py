"""Causal softmax attention for training and prefill, the one place an attention impl is chosen.

    o = attention(q, k, v, segment_ids, scale=s, impl="auto")   # q [B,T,H,Dqk], k [B,T,G,Dqk],
                                                                 # v [B,T,G,Dv] -> o [B,T,H,Dv]

impl:
- "xla": float32 logits and softmax (`xla_attention` with `causal_mask`), any platform and dtype.
- "cudnn": cuDNN's fused flash attention through JAX. It computes q k^T in bf16/fp16 with a float32
  softmax, so it differs from "xla" by bf16 rounding (about 1e-2 relative). The public
  `jax.nn.dot_product_attention` serves equal widths without packing; JAX's cuDNN module serves
  a value head narrower than q/k (MLA: cuDNN >= 9.10 on Hopper) and packed documents. A call
  cuDNN does not take (no CUDA GPU, float32 inputs, head dims, cuDNN too old) raises ValueError.
- "auto": "cudnn" where the call is supported, else "xla"; on a GPU the fallback is logged once.

Packed documents (segment_ids [B, T]) go to cuDNN as its ragged layout: every row is cut into
its runs of equal ids (segment_layout), each run is a sequence of its own with causal masking
inside it, so no token sees another document. The number of runs per row has a static bound,
`max_segments` (a mixer setting). The kernel is chosen per batch at run time (`lax.switch`):
rows that are each one document take cuDNN's plain causal kernel (the ragged layout costs about
2.5x at T = 4096), packed rows the ragged layout, and a batch with a row of more than
`max_segments` runs the exact "xla" path, logged once where a CPU device is present for the
host callback: never a wrong answer, only slower (its float32 logits are formed 512 query rows
at a time, `blocked_xla_attention`, so it fits where the one-shot [B, H, T, T] form would not).
"xla" masks by id equality, which is the same as runs for ids that form one run per document (as
the data packer writes them). With packing and Dv != Dqk, v is zero-padded to Dqk, since the
ragged offsets are token strides shared by q/o and by k/v.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.attention.common import blocked_xla_attention, causal_mask, xla_attention

IMPLS = ("auto", "xla", "cudnn")
DEFAULT_MAX_SEGMENTS = 64
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

log = logging.getLogger(__name__)
_logged: set[str] = set()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"Unknown attention impl={impl!r}; expected one of {list(IMPLS)}")


def check_max_segments(max_segments) -> None:
    if not isinstance(max_segments, int) or isinstance(max_segments, bool) or max_segments < 2:
        raise ValueError(f"max_segments must be an int >= 2 (runs per row for cuDNN packing); got {max_segments!r}")


def segment_layout(segment_ids, max_segments: int):
    """segment_ids [B, T] -> (seqlens [B, M] int32, offsets [B, M+1] int32, covered [B, T] bool).

    Row b's runs of equal consecutive ids, in order: offsets[b, j] is the first position of run j
    and seqlens[b, j] its length, for j < min(runs, M); the rest are -1 (the convention of JAX's
    cuDNN packing). covered is False on tokens of runs j >= M, which cuDNN does not attend."""
    check_max_segments(max_segments)
    B, T = segment_ids.shape
    M = max_segments
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [B, T] run index of each token
    rows = jnp.arange(B)[:, None]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slot = jnp.where(starts & (run < M), run, M + 1)  # M + 1 is out of range: dropped
    offsets = jnp.full((B, M + 1), -1, jnp.int32).at[rows, slot].set(pos, mode="drop")
    lengths = jnp.zeros((B, M), jnp.int32).at[rows, run].add(1, mode="drop")
    seqlens = jnp.where(jnp.arange(M) <= run[:, -1:], lengths, -1)
    return seqlens, offsets, run < M


def _on_cuda() -> bool:
    try:
        from jax._src import xla_bridge

        return jax.devices()[0].platform == "gpu" and "cuda" in xla_bridge.get_backend().platform_version
    except RuntimeError:
        return False


def cudnn_attention(q, k, v, segment_ids, scale: float, max_segments: int = DEFAULT_MAX_SEGMENTS):
    """The cuDNN path of `attention`, without support checks (see cudnn_unsupported). With packing
    and Dv < Dqk, v is zero-padded to Dqk: handed over narrower, cuDNN's ragged layout gave a wrong
    loss and NaN gradients (checked on an H200 with JAX 0.11.2 at q/k 192, v 128)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    Dqk, Dv = q.shape[-1], v.shape[-1]
    if segment_ids is None:
        if Dqk == Dv:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
        return fa.dot_product_attention(q, k, v, scale=scale, mask_type=fa.MaskType.CAUSAL)
    seqlens, offsets, covered = segment_layout(segment_ids, max_segments)
    vp = v if Dv == Dqk else jnp.pad(v, [(0, 0)] * 3 + [(0, Dqk - Dv)])
    out = fa.dot_product_attention(
        q, k, vp, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets, kv_offsets=offsets,
        scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL,
    )[..., :Dv]
    # Tokens of runs past max_segments are not attended: NaN marks them (`attention` never sends such rows).
    return jnp.where(covered[:, :, None, None], out, jnp.nan).astype(out.dtype)


@functools.lru_cache(maxsize=256)
def _unsupported(q_shape, k_shape, v_shape, dtypes, seg_shape, max_segments) -> str | None:
    if not _on_cuda():
        return f"no CUDA GPU (platform {jax.devices()[0].platform})"
    if len(set(dtypes)) != 1 or jnp.dtype(dtypes[0]) not in CUDNN_DTYPES:
        return f"q/k/v must all be bfloat16 or float16; got {[jnp.dtype(d).name for d in dtypes]}"
    if v_shape[-1] % 8 or v_shape[-1] > q_shape[-1]:
        return f"the value head dim must be a multiple of 8 and <= the q/k head dim; got {v_shape[-1]}"
    from jax._src.cudnn import fused_attention_stablehlo as fa

    try:
        fa.check_cudnn_version()
        sds = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in zip((q_shape, k_shape, v_shape), dtypes)]
        seg = None if seg_shape is None else jax.ShapeDtypeStruct(seg_shape, jnp.int32)

        def loss(q, k, v, seg):
            return jnp.sum(cudnn_attention(q, k, v, seg, 1.0, max_segments).astype(jnp.float32))

        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), *sds, seg)
    except (NotImplementedError, ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def cudnn_unsupported(q, k, v, segment_ids=None, max_segments: int = DEFAULT_MAX_SEGMENTS) -> str | None:
    """None when cuDNN's fused attention takes this call (forward and backward), else the reason.
    Beyond its own checks it lets JAX's cuDNN module trace the call abstractly."""
    seg_shape = None if segment_ids is None else tuple(segment_ids.shape)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in (q, k, v))
    return _unsupported(tuple(q.shape), tuple(k.shape), tuple(v.shape), dtypes, seg_shape, max_segments)


def resolve_impl(impl: str, q, k, v, segment_ids=None, max_segments: int = DEFAULT_MAX_SEGMENTS) -> str:
    """"xla" or "cudnn" for this call: "cudnn" raises where unsupported, "auto" falls back."""
    check_impl(impl)
    if impl == "xla":
        return "xla"
    reason = cudnn_unsupported(q, k, v, segment_ids, max_segments)
    if reason is None:
        return "cudnn"
    if impl == "cudnn":
        raise ValueError(
            f"impl='cudnn' needs a GPU with cuDNN fused attention for this call (q {q.shape} {q.dtype}, "
            f"k {k.shape}, v {v.shape}, packed={segment_ids is not None}): {reason}"
        )
    if _on_cuda() and reason not in _logged:
        _logged.add(reason)
        log.warning("attention impl='auto' uses the XLA path: cuDNN does not take q %s %s, v %s: %s",
                    q.shape, q.dtype, v.shape, reason)
    return "xla"


def count_runs(segment_ids):
    """segment_ids [B, T] -> [B] int32: documents per row (runs of equal consecutive ids)."""
    return 1 + jnp.sum(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1, dtype=jnp.int32)


@functools.cache
def _has_cpu() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:
        return False


def _log_fallback(runs, max_segments):
    msg = f"max_segments={max_segments}"
    if msg not in _logged:
        _logged.add(msg)
        log.warning("attention: a batch row holds %d documents, more than cuDNN packing's max_segments=%d; "
                    "this batch takes the XLA path (raise the mixer's max_segments)", int(runs), max_segments)


def attention(q, k, v, segment_ids=None, *, scale: float, impl: str = "auto",
              max_segments: int = DEFAULT_MAX_SEGMENTS, dropout=None):
    """Causal attention: q [B, T, H, Dqk], k [B, T, G, Dqk], v [B, T, G, Dv] (H a multiple of G),
    segment_ids [B, T] or None -> [B, T, H, Dv] in v's dtype. `dropout` = (rate, key): dropout on
    the attention probabilities (training), which needs them explicit: the blocked XLA path runs
    (impl "cudnn" refuses; "auto" on a GPU says so once)."""
    B, T, H, Dqk = q.shape
    if k.shape[:2] != (B, T) or k.shape[-1] != Dqk or v.shape[:3] != k.shape[:3] or H % k.shape[2]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got {segment_ids.shape}")
    check_max_segments(max_segments)
    if dropout is not None:
        check_impl(impl)
        if impl == "cudnn":
            raise ValueError("attention dropout needs the probabilities explicit, which impl='cudnn' does not "
                             "form; use impl='auto' or 'xla'")
        if impl == "auto" and _on_cuda() and "dropout" not in _logged:
            _logged.add("dropout")
            log.warning("attention with dropout runs the float32 XLA path (query blocks of 512), not cuDNN")
        return blocked_xla_attention(q, k, v, segment_ids, scale, dropout=dropout).astype(v.dtype)
    def exact(q, k, v, segment_ids):
        return xla_attention(q, k, v, causal_mask(segment_ids, T, B), scale).astype(v.dtype)

    if resolve_impl(impl, q, k, v, segment_ids, max_segments) != "cudnn":
        return exact(q, k, v, segment_ids)
    if segment_ids is None:
        return cudnn_attention(q, k, v, None, scale, max_segments)
    runs = jnp.max(count_runs(segment_ids))

    # Under autodiff every branch of a switch returns the residuals of all branches (zeros where
    # not taken): the XLA path's [B, H, T, T] logits and probabilities would be written as zeros on
    # every cuDNN step. Rematerialised, its residuals are its inputs only; blocked over queries,
    # its working memory is [B, H, 512, T] float32 per block instead of several [B, H, T, T]
    # (4 GiB each at B=4, H=16, T=4096), so a batch that takes it still fits at long T.
    def exact_blocked(q, k, v, segment_ids):
        return blocked_xla_attention(q, k, v, segment_ids, scale).astype(v.dtype)

    exact_remat = jax.checkpoint(exact_blocked, policy=jax.checkpoint_policies.nothing_saveable)

    def fallback(q, k, v, segment_ids):
        if _has_cpu():  # the host callback needs a CPU device (absent under JAX_PLATFORMS=cuda)
            jax.debug.callback(_log_fallback, runs, max_segments)
        return exact_remat(q, k, v, segment_ids)

    def packed(q, k, v, segment_ids):
        return cudnn_attention(q, k, v, segment_ids, scale, max_segments).astype(v.dtype)

    def one_document(q, k, v, segment_ids):  # every row one document: cuDNN's plain causal kernel
        return cudnn_attention(q, k, v, None, scale, max_segments).astype(v.dtype)

    branch = jnp.where(runs == 1, 0, jnp.where(runs <= max_segments, 1, 2))
    return jax.lax.switch(branch, (one_document, packed, fallback), q, k, v, segment_ids)

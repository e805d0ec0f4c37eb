"""Metrics on known predictions: Zoology's accuracy (per example over the scored positions, then
the mean over examples), the exact-match rate and the token-mean loss. Pure array functions, so
they are tested on hand-made logits and shared by every evaluator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def score_logits(logits, targets, loss_mask) -> dict:
    """Per-example sums of one batch; logits [B, T, V] float, targets [B, T] int, loss_mask [B, T].

    Returns `correct` (argmax over the FULL vocabulary equals the target), `count` (scored
    positions), `nll` (summed cross-entropy) and `all_correct` (every scored position right: the
    exact match of a greedy generation of those tokens), each [B]."""
    if logits.ndim != 3 or logits.shape[:2] != targets.shape or targets.shape != loss_mask.shape:
        raise ValueError(f"score_logits: logits {logits.shape}, targets {targets.shape} and "
                         f"loss_mask {loss_mask.shape} must be [B, T, V], [B, T], [B, T]")
    mask = loss_mask.astype(bool)
    logits = logits.astype(jnp.float32)
    hit = (jnp.argmax(logits, axis=-1) == targets) & mask
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    count = mask.sum(-1)
    correct = hit.sum(-1)
    return {"correct": correct, "count": count, "nll": jnp.where(mask, nll, 0.0).sum(-1),
            "all_correct": (correct == count) & (count > 0)}


def summarize(parts: list[dict]) -> dict:
    """Combine per-example sums of several batches into the reported numbers.

    accuracy: mean over examples (with at least one scored position) of correct / count;
    exact: fraction of those examples with every scored position right; loss: mean
    cross-entropy per scored token."""
    cat = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}
    scored = cat["count"] > 0
    if not scored.any():
        raise ValueError("summarize: no example has a scored position")
    count = cat["count"][scored]
    return {
        "accuracy": float(np.mean(cat["correct"][scored] / count)),
        "exact": float(np.mean(cat["all_correct"][scored])),
        "loss": float(cat["nll"].sum() / count.sum()),
        "num_examples": int(scored.sum()),
    }

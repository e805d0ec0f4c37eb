"""Expert load balancing: statistics computed in the forward pass and the bias updates.

Three methods (chosen by `MoEConfig.balancing`, applied by `kimi_jax.moe.apply_balancing`):
- "quantile" (K3 §2.3.3; Su, kexue.fm 11619): route with the current bias b, take each token's
  cutoff a_t = the (k+1)-th largest biased score, and set b_j to the k/n quantile of the margins
  r_tj = a_t - s_tj (expert j wins token t iff s_tj + b_j > a_t, so this b_j admits exactly
  T k / n tokens), estimated from a histogram, then mean-centred; used from the next step on.
- "aux_free" (DeepSeek-V3): b_j += rate * sign(mean load - load_j).
- "aux_loss" (DeepSeek-V3 sequence-wise): alpha * sum_j f_j P_j per sequence, averaged, with
  f_j = n / (k T) * #{t: j selected} and P_j = mean_t s_tj / sum_i s_ti.
All statistics are reductions over the whole (global) batch, so under jit with a sharded batch
they already include every data-parallel shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_load(expert_idx, num_experts: int):
    """Fraction of the routed (token, expert) pairs per expert: expert_idx [..., k] -> [E] f32."""
    counts = jnp.bincount(expert_idx.reshape(-1), length=num_experts).astype(jnp.float32)
    return counts / max(expert_idx.size, 1)


def load_metrics(load):
    """(max / mean load, normalised entropy of the load in [0, 1]) of load [E] (sums to 1)."""
    E = load.shape[-1]
    max_over_mean = jnp.max(load, axis=-1) * E
    entropy = -jnp.sum(jnp.where(load > 0, load * jnp.log(jnp.maximum(load, 1e-30)), 0.0), axis=-1)
    return max_over_mean, entropy / jnp.log(max(E, 2))


def quantile_bias(scores, cutoff, bias, top_k: int, num_bins: int = 1000):
    """K3 quantile balancing estimate of the next bias, mean-centred.

    scores [N, E] float32 (sigmoid, unbiased); cutoff [N] = each token's (k+1)-th largest biased
    score under `bias` [E]. Margins r = cutoff - scores are binned per expert into `num_bins` bins
    over [min b - 1, max b + 1] (they all lie there since scores are in (0, 1)); the bias is the
    position where the cumulative count reaches N k / E, interpolated inside its bin.
    """
    N, E = scores.shape
    lo = jnp.min(bias) - 1.0
    width = (jnp.max(bias) + 1.0 - lo) / num_bins
    r = cutoff[:, None] - scores
    bins = jnp.clip(jnp.floor((r - lo) / width).astype(jnp.int32), 0, num_bins - 1)
    hist = jnp.zeros((E, num_bins), jnp.int32)
    hist = hist.at[jnp.broadcast_to(jnp.arange(E), (N, E)), bins].add(1)
    return bias_from_histogram(hist, lo, width, N * top_k / E)


def bias_from_histogram(hist, lo, width, target):
    """Bias per expert from margin histograms hist [E, bins] (see `quantile_bias`), centred."""
    hist = hist.astype(jnp.float32)
    cum = jnp.cumsum(hist, axis=1)
    idx = jnp.argmax(cum >= target, axis=1)  # first bin reaching the target
    idx = jnp.where(cum[:, -1] >= target, idx, hist.shape[1] - 1)
    count = jnp.take_along_axis(hist, idx[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(cum, idx[:, None], axis=1)[:, 0] - count
    frac = jnp.clip((target - before) / jnp.maximum(count, 1.0), 0.0, 1.0)
    pos = lo + (idx.astype(jnp.float32) + frac) * width
    return pos - jnp.mean(pos)


def aux_free_update(bias, load, rate: float):
    """DeepSeek-V3 aux-loss-free step: raise under-loaded experts, lower over-loaded ones."""
    return bias + rate * jnp.sign(jnp.mean(load) - load)


def sequence_aux_loss(scores, expert_idx, top_k: int, coef: float):
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences.

    scores [B, T, E] (sigmoid), expert_idx [B, T, k] (the selected experts) -> scalar float32.
    """
    B, T, E = scores.shape
    selected = jax.nn.one_hot(expert_idx, E, dtype=jnp.float32).sum(axis=2)  # [B, T, E]
    f = selected.sum(axis=1) * E / (top_k * T)  # [B, E]
    p = (scores / jnp.sum(scores, axis=-1, keepdims=True)).mean(axis=1)  # [B, E]
    return coef * jnp.mean(jnp.sum(f * p, axis=-1))

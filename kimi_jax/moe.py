"""Mixture of experts: sigmoid router with a selection-only correction bias, routed experts
(optionally K3's LatentMoE), shared experts, and the load-balancing update `apply_balancing`.

Routing (DeepSeek-V3 / Kimi): s = sigmoid(x W) in float32; the experts are the top-k of s + b;
their weights are the *unbiased* s, renormalised to sum 1 and times `routed_scaling_factor`.
The bias b is a non-trainable `RouterBias` variable, changed only by `apply_balancing`.
LatentMoE (K3 §2.5): the routed experts run at `latent_dim`: y = up(RMSNorm(sum_k w_k E_k(down x))),
while the router and the shared experts see the full-width x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax import moe_balance
from kimi_jax.config import MoEConfig
from kimi_jax.ffn import MLP, glu_activation
from kimi_jax.layers import Linear, RMSNorm, param
from kimi_jax.moe_dispatch import DISPATCH, ExpertWeights, dispatch_fn  # noqa: F401
from kimi_jax.quantize import MXFP4Experts
from kimi_jax.sharding import constrain

STAT_KEYS = ("load", "max_over_mean", "load_entropy", "bias_target", "aux_loss", "dropped")


class RouterBias(nnx.Variable):
    """Selection-only expert bias (K3's e_score_correction_bias): not a gradient target."""


class Router(nnx.Module):
    """x [N, D] -> scores [N, E] f32, top-(k+1) biased indices/values (the extra one is the cutoff)."""

    def __init__(self, d_model: int, num_experts: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = Linear(d_model, num_experts, axes=("embed", "experts"), dtype=jnp.float32,
                           param_dtype=param_dtype, rngs=rngs)
        self.bias = RouterBias(jnp.zeros((num_experts,), jnp.float32), out_sharding=("experts",),
                               eager_sharding=False)

    def __call__(self, x, top_k: int):
        scores = jax.nn.sigmoid(self.proj(x.astype(jnp.float32)))
        biased = scores + self.bias[...]
        k_plus = min(top_k + 1, scores.shape[-1])
        values, idx = jax.lax.top_k(biased, k_plus)
        return scores, idx, values


class RoutedExperts(nnx.Module):
    """E stacked gated experts: gate/up [E, D, F], down [E, F, D]."""

    def __init__(self, num_experts: int, width: int, hidden: int, *, in_axis: str,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                 in_axis=-2, out_axis=-1, batch_axis=(0,))
        shape_in, shape_out = (num_experts, width, hidden), (num_experts, hidden, width)
        self.gate = param(rngs, init, shape_in, ("experts", in_axis, "expert_mlp"), param_dtype)
        self.up = param(rngs, init, shape_in, ("experts", in_axis, "expert_mlp"), param_dtype)
        self.down = param(rngs, init, shape_out, ("experts", "expert_mlp", in_axis), param_dtype)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate[...], self.up[...], self.down[...])


class MoE(nnx.Module):
    """x [B, T, D] -> (y [B, T, D], stats) with stats keys `STAT_KEYS` (per layer)."""

    def __init__(self, d_model: int, cfg: MoEConfig, *, activation: str = "swiglu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, norm_eps: float = 1e-5,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        dispatch_fn(cfg.dispatch)  # fail at build time on an unknown name
        self.cfg, self.dtype = cfg, dtype
        self.activation = (activation, situ_beta, situ_linear_beta)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.router = Router(d_model, cfg.num_experts, param_dtype=param_dtype, rngs=rngs)
        width, in_axis = (cfg.latent_dim, "latent") if cfg.latent_dim else (d_model, "embed")
        latent = bool(cfg.latent_dim)
        self.down_proj = Linear(d_model, width, axes=("embed", "latent"), **kw) if latent else None
        self.latent_norm = (RMSNorm(width, eps=norm_eps, **kw)
                            if latent and cfg.latent_norm else None)
        self.up_proj = Linear(width, d_model, axes=("latent", "embed"), **kw) if latent else None
        expert_module = MXFP4Experts if cfg.experts_dtype == "mxfp4" else RoutedExperts
        self.experts = expert_module(cfg.num_experts, width, cfg.expert_hidden, in_axis=in_axis,
                                     param_dtype=param_dtype, rngs=rngs)
        self.shared = (MLP(d_model, cfg.num_shared_experts * cfg.expert_hidden,
                           activation=activation, situ_beta=situ_beta,
                           situ_linear_beta=situ_linear_beta, **kw)
                       if cfg.num_shared_experts else None)

    def __call__(self, x):
        B, T, D = x.shape
        cfg = self.cfg
        flat = x.reshape(B * T, D)
        scores, idx, weights, values = self.route(flat)
        h = self.down_proj(flat) if self.down_proj is not None else flat.astype(self.dtype)
        name, beta, linear_beta = self.activation
        act = glu_activation(name, beta=beta, linear_beta=linear_beta)
        ep = ({"capacity_factor": cfg.capacity_factor, "return_dropped": True}
              if cfg.dispatch in ("expert_parallel", "auto") else {})
        y = dispatch_fn(cfg.dispatch)(h.astype(self.dtype), idx, weights,
                                      self.experts.weights(), act, **ep)
        y, dropped = y if ep else (y, jnp.zeros((), jnp.int32))
        if self.latent_norm is not None:
            y = self.latent_norm(y)
        if self.up_proj is not None:
            y = self.up_proj(y.astype(self.dtype))
        y = y.astype(jnp.float32)
        if self.shared is not None:
            y = y + self.shared(flat).astype(jnp.float32)
        y = constrain(y.reshape(B, T, D).astype(self.dtype), ("act_batch", "act_len", "act_embed"))
        return y, {**self._stats(scores, idx, values, B, T), "dropped": dropped}

    def route(self, x):
        """x [N, D] -> scores [N, E] (unbiased sigmoid, f32), expert idx [N, k] (top-k of scores
        + bias), weights [N, k] (the unbiased scores of idx, renormalised, times the routed scaling
        factor), values [N, k+1] (the top-(k+1) biased scores; the last is the cutoff)."""
        cfg = self.cfg
        scores, idx_plus, values = self.router(x, cfg.top_k)
        idx = idx_plus[:, :cfg.top_k]
        weights = jnp.take_along_axis(scores, idx, axis=1)
        if cfg.renormalize:
            weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
        return scores, idx, weights * cfg.routed_scaling_factor, values

    def _stats(self, scores, idx, values, B: int, T: int):
        """Per-layer statistics; only `aux_loss` carries gradients (to the router)."""
        cfg = self.cfg
        aux_loss = jnp.zeros((), jnp.float32)
        if cfg.balancing == "aux_loss":
            aux_loss = moe_balance.sequence_aux_loss(
                scores.reshape(B, T, -1), idx.reshape(B, T, -1), cfg.top_k, cfg.aux_loss_coef)
        scores = jax.lax.stop_gradient(scores)
        load = moe_balance.expert_load(idx, cfg.num_experts)
        max_over_mean, entropy = moe_balance.load_metrics(load)
        target = jnp.zeros((cfg.num_experts,), jnp.float32)
        if cfg.balancing == "quantile":
            cutoff = jax.lax.stop_gradient(values[:, cfg.top_k])
            target = moe_balance.quantile_bias(scores, cutoff, self.router.bias[...], cfg.top_k,
                                               cfg.num_bins)
        return dict(load=load, max_over_mean=max_over_mean, load_entropy=entropy,
                    bias_target=target, aux_loss=aux_loss)


def moe_layers(model) -> list[MoE]:
    """The MoE layers of `model` in layer order (the order of the stacked `aux` entries)."""
    if isinstance(model, MoE):
        return [model]
    if hasattr(model, "moe_layers"):
        return list(model.moe_layers())
    raise ValueError(f"apply_balancing: {type(model).__name__} is neither a MoE nor has moe_layers()")


def apply_balancing(model, aux) -> None:
    """Update every MoE router bias in place from the step's `aux` (call after the optimizer step).

    aux["moe_load"] [L, E] and aux["moe_bias_target"] [L, E] come from the forward pass with
    `return_aux=True`. "quantile" sets the bias to the estimate, "aux_free" moves it by
    `balance_rate` towards balance, "aux_loss" and "none" leave it unchanged.
    """
    layers = moe_layers(model)
    load, target = aux["moe_load"], aux["moe_bias_target"]
    if load.shape[0] != len(layers) or target.shape[0] != len(layers):
        raise ValueError(f"aux has statistics for {load.shape[0]} MoE layers; the model has "
                         f"{len(layers)}")
    for i, layer in enumerate(layers):
        method = layer.cfg.balancing
        bias = layer.router.bias
        if method == "quantile":
            bias[...] = target[i].astype(jnp.float32)
        elif method == "aux_free":
            bias[...] = moe_balance.aux_free_update(bias[...], load[i], layer.cfg.balance_rate)
        elif method not in ("aux_loss", "none"):
            raise ValueError(f"Unknown balancing={method!r}; expected one of "
                             f"['aux_free', 'aux_loss', 'none', 'quantile']")

"""Frozen model configuration, built from `config.model` (an ml_collections.ConfigDict).

Modules never see ml_collections: `ModelConfig.from_config_dict(config.model)` validates every key
once and returns plain frozen dataclasses. Keys of `config.model`:

    vocab_size, d_model, num_layers        sizes
    mixer_pattern                          tuple of mixer names, repeated over the layers
                                           (("kda", "kda", "kda", "mla") is the 3:1 hybrid)
    final_mixer                            "" or a mixer name forced on the last layer (K3, Kimi Linear)
    mixers                                 {mixer name: settings dict} (see kimi_jax.attention)
    activation                             "swiglu" | "situ" (every FFN site)
    situ_beta, situ_linear_beta            SiTU-GLU bounds (K3: 4, 25)
    dense_layers, dense_hidden             the first N layers use a dense MLP of this width
    ffn                                    False: mixer-only layers, no FFN sublayer (Zoology's MQAR
                                           models); needs moe None and plain residuals
    moe                                    None (all layers dense) or a dict of MoEConfig fields
    residual, attn_res_block_size          "plain" | "attn_res"; block size in decoder layers
    max_position_embeddings                0 (none: positions come from the mixers, e.g. RoPE) or the
                                           length of a learned absolute position table added to the
                                           token embedding (Zoology's attention models, GPT-2)
    embed_dropout                          dropout rate on the embedding (with positions) in training,
                                           when the model is called with a dropout key (Zoology: 0.1)
    tie_embeddings                         True: the logits are the final hidden state against the
                                           token embedding (no separate head; Zoology, GPT-2)
    init_std                               std of a tied embedding table (an untied one starts at 1;
                                           every Linear kernel is fan-in scaled)
    norm_eps, dtype, param_dtype
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "situ")
RESIDUALS = ("plain", "attn_res")
BALANCING = ("none", "quantile", "aux_free", "aux_loss")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _check_unknown(what: str, given: Mapping[str, Any], allowed) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"Unknown {what} key(s) {unknown}; expected a subset of {sorted(allowed)}")


def _choice(what: str, value: str, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"Unknown {what}={value!r}; expected one of {list(allowed)}")
    return value


def resolve_dtype(name: str):
    """"bfloat16" -> jnp.bfloat16; the one place a dtype name is resolved."""
    return DTYPES[_choice("dtype", str(name), DTYPES)]


def _positive(name: str, value) -> int:
    if int(value) != value or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts (sigmoid router, top-k with a selection-only correction bias) plus shared
    experts; `latent_dim > 0` is K3's LatentMoE (experts run at that width, RMSNorm after the sum)."""

    num_experts: int
    top_k: int
    expert_hidden: int
    num_shared_experts: int = 0
    latent_dim: int = 0
    latent_norm: bool = True
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    dispatch: str = "auto"  # kimi_jax.moe_ep.resolve_auto: gmm, expert_parallel or ragged for the device and mesh
    balancing: str = "quantile"
    balance_rate: float = 1e-3  # gamma of the DeepSeek-V3 aux-loss-free update
    aux_loss_coef: float = 1e-4  # alpha of the sequence-wise balance loss
    num_bins: int = 1000  # histogram bins of quantile balancing
    capacity_factor: float | None = None  # expert_parallel: None = dropless (worst-case buffers)
    experts_dtype: str | None = None  # "mxfp4": routed experts quantised (kimi_jax/quantize.py)

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_hidden", "num_bins"):
            _positive(f"moe.{name}", getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.balancing == "quantile" and self.top_k == self.num_experts:
            raise ValueError("quantile balancing needs moe.top_k < moe.num_experts (it reads the "
                             "(k+1)-th score)")
        if self.num_shared_experts < 0 or self.latent_dim < 0:
            raise ValueError(f"moe.num_shared_experts={self.num_shared_experts} and "
                             f"moe.latent_dim={self.latent_dim} must be >= 0")
        from kimi_jax.moe_dispatch import DISPATCH

        _choice("moe.dispatch", self.dispatch, sorted(DISPATCH))
        _choice("moe.balancing", self.balancing, BALANCING)
        from kimi_jax.quantize import check_experts_dtype

        check_experts_dtype(self.experts_dtype, self.dispatch)


def check_dropout_rate(name: str, rate) -> None:
    """A dropout rate (the model's or a mixer's) must be a number in [0, 1)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ValueError(f"{name} must be a dropout rate in [0, 1); got {rate!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    layer_mixers: tuple[str, ...]  # one mixer name per layer
    mixer_settings: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]  # frozen {name: settings}
    activation: str = "swiglu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    dense_layers: int = 1
    dense_hidden: int = 0
    ffn: bool = True
    moe: MoEConfig | None = None
    residual: str = "plain"
    attn_res_block_size: int = 1
    max_position_embeddings: int = 0
    embed_dropout: float = 0.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "attn_res_block_size"):
            _positive(name, getattr(self, name))
        if len(self.layer_mixers) != self.num_layers:
            raise ValueError(f"layer_mixers has {len(self.layer_mixers)} entries for "
                             f"num_layers={self.num_layers}")
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("residual", self.residual, RESIDUALS)
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype)
        if not 0 <= self.dense_layers <= self.num_layers:
            raise ValueError(f"dense_layers={self.dense_layers} must lie in [0, num_layers="
                             f"{self.num_layers}]")
        if self.moe is None and self.dense_layers != self.num_layers:
            raise ValueError(f"moe is None, so every layer is dense: set dense_layers="
                             f"{self.num_layers} (got {self.dense_layers})")
        if (isinstance(self.max_position_embeddings, bool) or not isinstance(self.max_position_embeddings, int)
                or self.max_position_embeddings < 0):
            raise ValueError(f"max_position_embeddings must be an int >= 0 (0 = no learned positions); "
                             f"got {self.max_position_embeddings!r}")
        check_dropout_rate("embed_dropout", self.embed_dropout)
        if not float(self.init_std) > 0:
            raise ValueError(f"init_std must be positive; got {self.init_std!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be True or False; got {self.tie_embeddings!r}")
        if not isinstance(self.ffn, bool):
            raise ValueError(f"ffn must be True or False; got {self.ffn!r}")
        if not self.ffn and (self.moe is not None or self.residual != "plain"):
            raise ValueError(f"ffn=False (mixer-only layers) needs moe None and residual 'plain'; got "
                             f"moe={'set' if self.moe is not None else None}, residual={self.residual!r}")
        if self.dense_layers > 0 and self.ffn:
            _positive("dense_hidden", self.dense_hidden)
        settings = dict(self.mixer_settings)
        missing = sorted(set(self.layer_mixers) - set(settings))
        if missing:
            raise ValueError(f"mixers has no settings for {missing} used by the layer pattern")

    # ---------------------------------------------------------------- derived
    def settings(self, mixer: str) -> dict:
        """The settings dict of one mixer name."""
        return dict(dict(self.mixer_settings)[mixer])

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - self.dense_layers

    @property
    def compute_dtype(self):
        return resolve_dtype(self.dtype)

    @property
    def weight_dtype(self):
        return resolve_dtype(self.param_dtype)

    # ---------------------------------------------------------------- building
    @classmethod
    def from_config_dict(cls, model) -> "ModelConfig":
        """Validate `config.model` (ConfigDict or dict) and freeze it."""
        model = _to_dict(model)
        allowed = {f.name for f in dataclasses.fields(cls)} - {"layer_mixers", "mixer_settings"}
        allowed |= {"mixer_pattern", "final_mixer", "mixers"}
        _check_unknown("config.model", model, allowed)
        for key in ("vocab_size", "d_model", "num_layers", "mixer_pattern", "mixers"):
            if key not in model:
                raise ValueError(f"config.model needs {key!r}")
        layer_mixers = layer_pattern(model["mixer_pattern"], model["num_layers"],
                                     model.get("final_mixer") or "")
        mixers = model["mixers"]
        _check_mixer_names(set(layer_mixers) | set(mixers))
        frozen = tuple(sorted((name, _freeze(s or {})) for name, s in mixers.items()))
        moe = model.get("moe")
        if moe is not None:
            _check_unknown("config.model.moe", moe, {f.name for f in dataclasses.fields(MoEConfig)})
            moe = MoEConfig(**moe)
        rest = {k: v for k, v in model.items()
                if k not in ("mixer_pattern", "final_mixer", "mixers", "moe")}
        if "dense_layers" not in rest and moe is None:
            rest["dense_layers"] = int(model["num_layers"])
        cfg = cls(layer_mixers=layer_mixers, mixer_settings=frozen, moe=moe, **rest)
        for name in sorted(set(layer_mixers)):
            _validate_mixer(name, cfg.settings(name), cfg.d_model)
        return cfg


def layer_pattern(pattern, num_layers: int, final_mixer: str = "") -> tuple[str, ...]:
    """Repeat `pattern` over `num_layers` layers, then force `final_mixer` on the last layer."""
    pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    num_layers = _positive("num_layers", num_layers)
    if not pattern:
        raise ValueError("mixer_pattern is empty; give at least one mixer name")
    if len(pattern) > num_layers:
        raise ValueError(f"mixer_pattern {pattern} has {len(pattern)} entries, longer than "
                         f"num_layers={num_layers}")
    out = [pattern[i % len(pattern)] for i in range(num_layers)]
    if final_mixer:
        out[-1] = final_mixer
    return tuple(out)


def _check_mixer_names(names) -> None:
    from kimi_jax.attention import MIXERS

    for name in sorted(names):
        _choice("mixer", name, sorted(MIXERS))


def _validate_mixer(name: str, settings: dict, d_model: int) -> None:
    """The mixer's own config checks its settings (unknown keys, bad values) and, through
    `num_params(d_model)`, that its heads divide the model width."""
    from kimi_jax.attention import mixer_config

    mixer_config(name, settings).num_params(d_model)


def _to_dict(value):
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {k: _to_dict(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_to_dict(v) for v in value)
    return value


def _freeze(settings: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items()))

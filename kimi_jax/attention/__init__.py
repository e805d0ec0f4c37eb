"""Token mixers and the ONE registry that resolves a mixer name.

    from kimi_jax.attention import build_mixer, mixer_config, MIXERS
    mixer = build_mixer("kda", {"num_heads": 4, "head_dim": 32}, d_model=128,
                        dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    y = mixer(x, segment_ids=seg)                      # x, y [B, T, D]
    cache = mixer.init_cache(batch_size, max_len)
    y_t, cache = mixer.decode(x_t, cache)              # x_t, y_t [B, 1, D]

Each config also answers num_params(d_model), cache_bytes_per_token(), state_bytes() and
flops_per_token(d_model, seq_len) for the summary.
"""

from __future__ import annotations

from kimi_jax.attention.kda import KDA, KDAConfig
from kimi_jax.attention.linear import (
    DeltaNet,
    DeltaNetConfig,
    GatedDeltaNet,
    GatedDeltaNetConfig,
    LinearAttention,
    LinearAttentionConfig,
)
from kimi_jax.attention.mla import MLA, MLAConfig
from kimi_jax.attention.softmax import SoftmaxAttention, SoftmaxConfig

MIXERS = {
    "softmax": (SoftmaxAttention, SoftmaxConfig),
    "linear": (LinearAttention, LinearAttentionConfig),
    "deltanet": (DeltaNet, DeltaNetConfig),
    "gated_deltanet": (GatedDeltaNet, GatedDeltaNetConfig),
    "kda": (KDA, KDAConfig),
    "mla": (MLA, MLAConfig),
}


def _entry(name: str):
    if name not in MIXERS:
        raise ValueError(f"Unknown mixer {name!r}; expected one of {sorted(MIXERS)}")
    return MIXERS[name]


def mixer_config(name: str, settings=None):
    """The frozen config of mixer `name` from a settings mapping (unknown keys raise)."""
    return _entry(name)[1].from_settings(settings)


def build_mixer(name: str, settings, d_model: int, *, dtype, param_dtype, rngs):
    """Build mixer `name` for width d_model; invalid settings or shapes raise ValueError."""
    if not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"d_model must be a positive int; got {d_model!r}")
    module_cls, _ = _entry(name)
    return module_cls(mixer_config(name, settings), d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


__all__ = ["MIXERS", "build_mixer", "mixer_config"] + [c.__name__ for pair in MIXERS.values() for c in pair]

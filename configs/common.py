"""Pieces shared by every config file. Each section has one owner function; config files call
`base_config()` and then fill `config.model` (see `kimi_jax/config.py` for its schema)."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **spec):
    """Parse "key=value,key2=value2" into a ConfigDict with defaults and types from `spec`
    (big_vision's convention). A bare "key" sets a boolean to True. Unknown keys raise."""
    out = ml_collections.ConfigDict(spec)
    if not arg:
        return out
    for item in arg.split(","):
        key, _, value = item.partition("=")
        if key not in spec:
            raise ValueError(f"Unknown config arg {key!r}; expected one of {sorted(spec)}")
        default = spec[key]
        if isinstance(default, bool):
            out[key] = value.lower() in ("", "1", "true", "yes")
        elif value == "":
            raise ValueError(f"Config arg {key!r} needs a value")
        else:
            out[key] = type(default)(value)
    return out


def training_defaults(config: ml_collections.ConfigDict) -> None:
    """Loop keys of the contract (train.py reads these)."""
    config.seed = 0
    config.total_steps = 1000
    config.log_every_steps = 10
    config.eval_every_steps = 200
    config.checkpoint_every_steps = 200
    config.keep_checkpoints = 3
    config.profile_steps = ()


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    training_defaults(config)
    config.model = ml_collections.ConfigDict()
    return config

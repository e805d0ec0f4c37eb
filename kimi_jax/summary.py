"""Parameter, cache and FLOP summary of a config, computed abstractly (`nnx.eval_shape`: shapes
only, nothing allocated, seconds even for K3).

    python -m kimi_jax.summary --config configs/k3.py[:arg] [--seq_len 4096]

prints a per-component table, the decode cache (bytes per token) and fixed state (bytes per
sequence), the training FLOPs per token, and ends with `params total=<int> active=<int>`.
Active parameters are what one token uses: everything except the embedding tables (tokens and
learned positions), with only top_k of the num_experts routed experts of each MoE layer.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import sys

import jax
from flax import nnx

from kimi_jax import flops, quantize
from kimi_jax.attention import mixer_config
from kimi_jax.config import ModelConfig


def model_config(config) -> ModelConfig:
    """A ModelConfig from the full config, `config.model`, or a ModelConfig."""
    if isinstance(config, ModelConfig):
        return config
    return ModelConfig.from_config_dict(config["model"] if "model" in config else config)


def abstract_model(config):
    """The model with ShapeDtypeStruct leaves (no allocation)."""
    from kimi_jax.model import Model

    cfg = model_config(config)
    return nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0)))


def component(path) -> str:
    """Component name of a parameter path, e.g. ('blocks', 3, 'mixer', ...) -> 'mixer'."""
    keys = [str(p) for p in path]
    if keys[0] != "blocks":
        return {"embed": "embedding", "pos_embed": "position embedding", "head": "head"}.get(
            keys[0], "final norm + read")
    part = keys[2]
    if part == "ffn":
        if "experts" == keys[3]:
            return "moe routed experts"
        return "moe router + latent + shared" if keys[3] in MOE_PARTS else "dense mlp"
    return {"mixer_norm": "norms", "ffn_norm": "norms"}.get(part, "attn_res reads"
                                                           if part.endswith("_read") else part)


MOE_PARTS = ("router", "down_proj", "up_proj", "latent_norm", "shared")


def param_table(config):
    """{component: (layers, params)} for every variable of the model (router biases included);
    mixers are split by mixer name."""
    model = abstract_model(config)
    cfg = model.config
    sizes = collections.Counter()
    layers = collections.defaultdict(set)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = component(path)
        if name == "mixer":
            name = f"mixer {cfg.layer_mixers[int(path[1])]}"
        sizes[name] += quantize.logical_size(path, var)
        layers[name].add(int(path[1]) if str(path[0]) == "blocks" else -1)
    return {name: (len(layers[name]), sizes[name]) for name in sizes}


def count_params(config, table=None) -> tuple[int, int]:
    """(total, active) parameter counts; see the module docstring. `table`: a `param_table`
    of the same config, to avoid building the abstract model again."""
    cfg = model_config(config)
    table = param_table(cfg) if table is None else table
    total = sum(n for _, n in table.values())
    active = total - table.get("embedding", (0, 0))[1] - table.get("position embedding", (0, 0))[1]
    if cfg.moe is not None:
        routed = table.get("moe routed experts", (0, 0))[1]
        active -= routed - routed // cfg.moe.num_experts * cfg.moe.top_k
    return total, active


def cache_bytes(config) -> tuple[int, int]:
    """(decode cache bytes per token, fixed state bytes per sequence), summed over the layers."""
    cfg = model_config(config)
    per_token = state = 0
    for name in cfg.layer_mixers:
        mc = mixer_config(name, cfg.settings(name))
        per_token += mc.cache_bytes_per_token()
        state += mc.state_bytes()
    return per_token, state


def recurrent_state_bytes(config) -> int:
    """The float32 recurrent states alone (no conv windows), summed over the layers."""
    cfg = model_config(config)
    total = 0
    for name in cfg.layer_mixers:
        mc = mixer_config(name, cfg.settings(name))
        total += mc.recurrent_state_bytes() if hasattr(mc, "recurrent_state_bytes") else 0
    return total


def train_flops_per_token(config, seq_len: int) -> float:
    """Forward + backward FLOPs per token at `seq_len` (for MFU)."""
    return flops.train_flops_per_token(model_config(config), seq_len)


def load_config(spec: str):
    """"path/to/config.py[:arg]" -> get_config(arg)."""
    path, _, arg = spec.partition(":")
    folder = os.path.dirname(os.path.abspath(path))
    while os.path.basename(folder) != "configs" and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # config files import `configs.*` from the repo root
    root = os.path.dirname(folder) if os.path.basename(folder) == "configs" else os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)
    spec_ = importlib.util.spec_from_file_location("_summary_config", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module.get_config(arg or None)


def _fmt(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def report(config, seq_len: int = 4096) -> str:
    cfg = model_config(config)
    table = param_table(cfg)
    total, active = count_params(cfg, table)
    lines = [f"{'component':<30} {'layers':>6} {'params':>18} {'':>9}", "-" * 66]
    for name, (n_layers, n) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{name:<30} {max(n_layers, 1):>6} {n:>18,} {_fmt(n):>9}")
    lines.append("-" * 66)
    for name in sorted(set(cfg.layer_mixers)):
        mc = mixer_config(name, cfg.settings(name))
        lines.append(f"mixer {name}: {cfg.layer_mixers.count(name)} layers x "
                     f"{mc.num_params(cfg.d_model):,} params (config formula), "
                     f"{mc.cache_bytes_per_token():,} cache bytes per token, "
                     f"{mc.state_bytes():,} state bytes per sequence")
    per_token, state = cache_bytes(cfg)
    recurrent = recurrent_state_bytes(cfg)
    lines.append(f"decode cache bytes per token={per_token:,}  fixed state bytes per sequence="
                 f"{state:,} ({state / 2**20:.1f} MiB; float32 recurrent state {recurrent:,} = "
                 f"{recurrent / 2**20:.1f} MiB, the rest short-conv windows)")
    lines.append(f"train FLOPs per token at seq_len={seq_len}: "
                 f"{_fmt(train_flops_per_token(cfg, seq_len))}")
    if (line := quantize.storage_line(abstract_model(cfg))) is not None:
        lines.append(line)
    lines.append(f"params total={total} active={active}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--seq_len", type=int, default=4096, help="for the FLOP count")
    args = parser.parse_args(argv)
    with jax.default_device(jax.devices("cpu")[0]):
        print(report(load_config(args.config), args.seq_len))


if __name__ == "__main__":
    main()

"""Traced implementation settings, set by name from a config: `config.kernel_settings`.

    config.kernel_settings = "block_v=auto/grad_issue=early/gate_up=fused_ffn"

Every lever that changes how a step is computed but not what it computes (the KDA kernels' module
settings, the MoE forms, the backward forms of norms, GLUs and short convolutions) is a module
setting read while a function is traced. This is the one table of them: `parse` checks a
"key=value/..." string against it (an unknown key or value raises, listing the choices), and
`applied` puts the values in place for a block, so train.py and eval.py trace their steps with
them and `benchmarks/train.py` rows time them side by side.
"""

from __future__ import annotations

import contextlib

from kernels.kda import chunk
from kimi_jax import attn_res, ffn, layers, moe_dispatch
from kimi_jax.attention import common as attention_common

# The model's settings: key -> (allowed values, context manager that sets one for a block).
MODEL_SETTINGS = {
    "conv_dw": (layers.CONV_DW_MODES, layers.conv_dw),  # the short conv backward's tap sums
    "layout": (attention_common.ACTIVATION_LAYOUTS, attention_common.activation_layout),  # recurrent mixers
    "glu_vjp": (ffn.GLU_VJP_MODES, ffn.glu_vjp),  # the GLUs' backward
    "norm_vjp": (layers.NORM_VJP_MODES, layers.norm_vjp),  # the norms' backward
    "attn_res_out": (attn_res.READ_OUT_MODES, attn_res.read_out),  # attention-residual reads' outputs
    "gate_up": (moe_dispatch.GATE_UP_MODES, moe_dispatch.gate_up),  # the routed experts' FFN form
    "pair_sort": (moe_dispatch.PAIR_SORTS, moe_dispatch.pair_sort),  # the MoE dispatch's sort
}


def keys() -> tuple[str, ...]:
    """Every key: the KDA kernels' (`kernels.kda.chunk.SETTINGS`) and the model's (MODEL_SETTINGS)."""
    return tuple(chunk.SETTINGS) + tuple(MODEL_SETTINGS)


def values(key: str) -> tuple:
    """The values `key` takes (a KDA key's are looked up only when asked: "forward_only" imports
    the Mosaic GPU passes)."""
    return chunk.setting_values(key) if key in chunk.SETTINGS else MODEL_SETTINGS[key][0]


def parse(text: str, extra: dict | None = None) -> dict:
    """"block_v=auto/gate_up=fused_ffn" -> {"block_v": "auto", "gate_up": "fused_ffn"} (values as
    the settings take them, e.g. "segments=8" -> 8); "" -> {}. `extra`: more keys a caller
    accepts (key -> allowed string values). An unknown key or value raises."""
    extra = extra or {}
    out = {}
    for item in filter(None, str(text or "").split("/")):
        key, eq, value = item.partition("=")
        if not eq or key not in keys() + tuple(extra):
            raise ValueError(f"kernel setting {item!r}: expected key=value with key in "
                             f"{sorted(keys() + tuple(extra))}")
        allowed = {str(v): v for v in (extra[key] if key in extra else values(key))}
        if value not in allowed:
            raise ValueError(f"kernel setting {key}={value!r}: expected one of {list(allowed)}")
        out[key] = allowed[value]
    return out


@contextlib.contextmanager
def applied(settings: dict):
    """Within the block, the KDA and model settings among `settings` are in place (other keys are
    the caller's); restored afterwards."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(chunk.settings(**{k: v for k, v in settings.items() if k in chunk.SETTINGS}))
        for key, (_, setter) in MODEL_SETTINGS.items():
            stack.enter_context(setter(settings.get(key)))
        yield

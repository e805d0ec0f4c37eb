"""The row settings of `benchmarks/train.py` (`devices:remat:batch[:key=value/...]`): which keys a
row may set, how they are parsed and checked, and how a row is traced with them in place. Also read
by `benchmarks/kda_profile.py --mixer --settings`."""

from __future__ import annotations

import contextlib

from kernels.kda import chunk
from kimi_jax import attn_res, ffn, layers
from kimi_jax.attention import common as attention_common

MESH_AXES = ("data", "fsdp")  # the axis a row's devices form
# The model's traced settings a row may set: key -> (allowed values, context manager that sets it
# while the row is traced).
MODEL_SETTINGS = {
    "conv_dw": (layers.CONV_DW_MODES, layers.conv_dw),  # the short conv backward's tap sums
    "layout": (attention_common.ACTIVATION_LAYOUTS, attention_common.activation_layout),  # recurrent mixers
    "glu_vjp": (ffn.GLU_VJP_MODES, ffn.glu_vjp),  # the GLUs' backward
    "norm_vjp": (layers.NORM_VJP_MODES, layers.norm_vjp),  # the norms' backward
    "attn_res_out": (attn_res.READ_OUT_MODES, attn_res.read_out),  # attention-residual reads' outputs
}


def parse_settings(text: str) -> dict:
    """"mesh=fsdp/diag=split" -> {"mesh": "fsdp", "diag": "split"}; unknown keys or values raise."""
    allowed = {k: chunk.setting_values(k) for k in chunk.SETTINGS} | {"mesh": MESH_AXES} | {
        k: values for k, (values, _) in MODEL_SETTINGS.items()}
    out = {}
    for item in filter(None, text.split("/")):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"row setting {item!r}: expected key=value with key in {sorted(allowed)}")
        if value not in allowed[key]:
            raise ValueError(f"row setting {key}={value!r}: expected one of {allowed[key]}")
        out[key] = value
    return out


def traced_with(settings: dict, f):
    """f() with the KDA module settings among `settings` (`kernels.kda.chunk.settings`) and the
    model settings among them (MODEL_SETTINGS) in place."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(chunk.settings(**{k: v for k, v in settings.items() if k in chunk.SETTINGS}))
        for key, (_, setter) in MODEL_SETTINGS.items():
            stack.enter_context(setter(settings.get(key)))
        return f()


def parse_row(item: str) -> tuple[int, str, int, dict]:
    """"devices:remat:batch[:settings]" -> (devices, remat, batch per device, settings)."""
    parts = item.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"row {item!r}: expected devices:remat:batch_per_device[:settings]")
    return int(parts[0]), parts[1], int(parts[2]), parse_settings(parts[3] if len(parts) == 4 else "")

"""The row settings of `benchmarks/train.py` (`devices:remat:batch[:key=value/...]`): the traced
settings of `kimi_jax.kernel_settings` (the same keys as `config.kernel_settings`) plus the mesh
axis a row's devices form and the MoE dispatch its model is built with. Also read by `benchmarks/kda_profile.py --mixer --settings`."""

from __future__ import annotations

from kimi_jax import kernel_settings

MESH_AXES = ("data", "fsdp")  # the axis a row's devices form
DISPATCHES = ("auto", "ragged", "gmm", "expert_parallel")  # a row's `config.model.moe.dispatch`


def parse_settings(text: str) -> dict:
    """"mesh=fsdp/diag=split" -> {"mesh": "fsdp", "diag": "split"}; unknown keys or values raise."""
    return kernel_settings.parse(text, extra={"mesh": MESH_AXES, "dispatch": DISPATCHES})


def traced_with(settings: dict, f):
    """f() with the traced settings among `settings` in place (`kimi_jax.kernel_settings.applied`)."""
    with kernel_settings.applied(settings):
        return f()


def parse_row(item: str) -> tuple[int, str, int, dict]:
    """"devices:remat:batch[:settings]" -> (devices, remat, batch per device, settings)."""
    parts = item.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"row {item!r}: expected devices:remat:batch_per_device[:settings]")
    return int(parts[0]), parts[1], int(parts[2]), parse_settings(parts[3] if len(parts) == 4 else "")

"""Logical axis names and the rules that map them onto the mesh.

Parameters carry logical names (`nnx.Param(..., out_sharding=names)` or
`nnx.with_partitioning`); activations are constrained at block boundaries with `constrain`.

Parameter names:  vocab, embed, heads, kv_heads, head_dim, q_lora, kv_lora, mlp, experts,
                  expert_mlp, latent, conv, norm (unsharded), layers.
Activation names: act_batch, act_len, act_embed, act_heads, act_kv, act_mlp, act_vocab, act_experts.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

# logical name -> mesh axis (or tuple of axes, or None). The single table of the project.
LOGICAL_AXIS_RULES = (
    ("act_batch", ("data", "fsdp", "expert")),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_experts", "expert"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("latent", None),
    ("conv", None),
    ("norm", None),
    ("layers", None),
)


def logical_to_spec(names, rules=LOGICAL_AXIS_RULES) -> P:
    """PartitionSpec for a tuple of logical names (None entries stay unsharded)."""
    table = dict(rules)
    return P(*(None if n is None else table.get(n) for n in names))


def constrain(x, names):
    """Constrain an activation's sharding by logical names when a mesh is active; else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_spec(names)
    spec = P(*(_keep_present(s, mesh.axis_names) for s in spec))
    return jax.lax.with_sharding_constraint(x, spec)


def _keep_present(entry, axis_names):
    if entry is None:
        return None
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    axes = tuple(a for a in axes if a in axis_names)
    return None if not axes else axes[0] if len(axes) == 1 else axes


__all__ = ["LOGICAL_AXIS_RULES", "logical_to_spec", "constrain", "nnx"]

"""Logical axis names and the rules that map them onto the mesh.

Parameters carry logical names (`nnx.Param(..., out_sharding=names)` or
`nnx.with_partitioning`); activations are constrained at block boundaries with `constrain`.

Parameter names:  vocab, embed, heads, kv_heads, head_dim, q_lora, kv_lora, mlp, experts,
                  expert_mlp, latent, conv, norm (unsharded), layers.
Activation names: act_batch, act_len, act_embed, act_heads, act_kv, act_mlp, act_vocab, act_experts.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert")
# Mesh axes the batch dimension of inputs and activations is split over.
BATCH_AXES = ("data", "fsdp", "expert")

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


def mesh_shape(mesh_config, num_devices: int) -> dict:
    """Resolve {axis: size} (one size may be -1) against the device count; raise when it does not fit."""
    sizes = {a: int(mesh_config.get(a, 1)) for a in MESH_AXES}
    unknown = set(mesh_config.keys()) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"Unknown mesh axes {sorted(unknown)}; expected some of {MESH_AXES}")
    free = [a for a, n in sizes.items() if n == -1]
    if len(free) > 1 or any(n == 0 or n < -1 for n in sizes.values()):
        raise ValueError(f"config.mesh={sizes}: sizes must be positive, with at most one -1")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"config.mesh={sizes}: {num_devices} devices are not divisible by {fixed}")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"config.mesh={sizes} needs {math.prod(sizes.values())} devices but {num_devices} are present")
    return sizes


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
    """The (data, fsdp, tensor, expert) mesh from `config.mesh`, over all devices by default."""
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(mesh_config, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if list(devices) == list(jax.devices()):  # all of them: jax.make_mesh's topology-aware order
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
    """Inputs [B, T, ...]: batch over the data-parallel axes, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *(None,) * (ndim - 1)))


def spec_for_shape(names, shape, mesh, rules=LOGICAL_AXIS_RULES) -> P:
    """Mesh PartitionSpec for an array with logical `names`: each dimension takes the mesh axes its
    name maps to, keeping only axes present in the mesh, not used by an earlier dimension, and
    dividing the dimension (else that dimension stays replicated)."""
    if names is None:
        return P()
    if len(names) != len(shape):
        raise ValueError(f"logical names {names} do not match the array shape {shape}")
    table, used, out = dict(rules), set(), []
    for name, dim in zip(names, shape):
        entry = None if name is None else table.get(name)
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(a for a in axes if a in mesh.shape and a not in used and mesh.shape[a] > 1)
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def logical_names(state):
    """Tree of logical-name tuples (or None) for an nnx.State of (abstract) variables."""
    return jax.tree.map(lambda v: v.get_metadata().get("out_sharding") or v.get_metadata().get("sharding_names"),
                        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(abstract_state, mesh, rules=LOGICAL_AXIS_RULES):
    """NamedShardings for an (abstract) nnx.State, from the variables' logical names and the rules."""
    def one(v):
        names = v.get_metadata().get("out_sharding") or v.get_metadata().get("sharding_names")
        return v.replace(NamedSharding(mesh, spec_for_shape(names, v.shape, mesh, rules)))
    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _fits(spec: P, shape, mesh) -> bool:
    """Whether `spec` can shard an array of `shape` (rank and divisibility)."""
    if len(spec) > len(shape):
        return False
    for entry, dim in zip(spec, shape):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if dim % math.prod(mesh.shape[a] for a in axes):
            return False
    return True


def optimizer_shardings(tx, abstract_opt_state, param_shardings, mesh):
    """Optimizer-state shardings with the structure of `abstract_opt_state`.

    Each copy of the parameter tree inside the state (Adam moments, Muon momentum) takes the
    parameters' shardings leaf by leaf; a leaf whose shape the parameter's sharding cannot split
    (a factored statistic) and every other leaf (step counts, scalars, Newton-Schulz coefficients)
    is replicated. `optax.MaskedNode` placeholders, which `optax.masked`/`partition` (and so
    Muon's Adam and Muon groups) leave where a parameter belongs to the other group, stay in place
    so the result matches the state's pytree structure (as `jit`'s out_shardings and Orbax need).
    """
    import optax

    replicated = NamedSharding(mesh, P())

    def leaf(x, s):
        if isinstance(x, optax.MaskedNode):
            return x
        return s if _fits(s.spec, x.shape, mesh) else replicated

    def params_like(tree):
        return jax.tree.map(leaf, tree, param_shardings, is_leaf=lambda x: isinstance(x, optax.MaskedNode))

    # is_leaf=True: `params_like` gets each parameter-shaped subtree whole.
    return optax.tree_utils.tree_map_params(
        tx, params_like, abstract_opt_state, is_leaf=lambda _: True,
        transform_non_params=lambda t: jax.tree.map(lambda _: replicated, t))


__all__ = ["LOGICAL_AXIS_RULES", "MESH_AXES", "BATCH_AXES", "logical_to_spec", "constrain", "mesh_shape",
           "make_mesh", "batch_sharding", "spec_for_shape", "logical_names", "state_shardings",
           "optimizer_shardings", "nnx"]

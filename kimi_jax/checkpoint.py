"""Orbax checkpoints of the train state and the data iterator, and `load_model` for other programs.

Layout: `<workdir>/checkpoints/<step>/{params,rest,opt_state,data}`. `params` and `rest` are the
model's `nnx.State` as pure dicts (parameters, and non-trainable variables such as MoE router
biases), `opt_state` the optax state, `data` the iterator state of every host (JSON). Empty trees (a model without non-trainable
variables) are not written. Saves are
asynchronous; Orbax writes each step into a temporary folder and renames it when complete, so a
run killed mid-save leaves no checkpoint that `latest_step` would pick up.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

ITEMS = ("params", "rest", "opt_state")

# Orbax's replica-parallel save splits each replicated shard among its replicas, one slice op per
# piece. For small arrays (norm scales, biases, small optimizer states) those dispatches cost more
# than the writes they spread: on 8 CPU devices a small model's save took seconds per step. Arrays
# whose per-replica piece would be under this many bytes are written whole by one replica.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _register_array_handler():
    default = ocp.type_handlers.get_type_handler(jax.Array)
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=getattr(default, "_array_metadata_store", None),  # keep Orbax's metadata store
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES)
    # Orbax warns on every override (a line at each launch); this one is intended.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_logger.setLevel(level)


_register_array_handler()


def checkpoint_dir(workdir: str) -> epath.Path:
    """`<workdir>/checkpoints` (local paths made absolute; URLs such as gs://... kept)."""
    return epath.Path(workdir if "://" in workdir else os.path.abspath(workdir)) / "checkpoints"


class Checkpointer:
    """A CheckpointManager keeping the last `keep` steps, saving asynchronously."""

    def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(checkpoint_dir(workdir), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: dict, data_state, *, force: bool = False) -> bool:
        """Start saving `state` ({params, rest, opt_state} pytrees) and the JSON `data_state`."""
        args = {k: ocp.args.StandardSave(state[k]) for k in ITEMS if jax.tree.leaves(state[k])}
        args["data"] = ocp.args.JsonSave(data_state)
        return self.manager.save(step, args=ocp.args.Composite(**args), force=force)

    def restore(self, step: int, abstract_state: dict, items=ITEMS + ("data",)) -> dict:
        """Restore `items` of `step` into the shapes, dtypes and shardings of `abstract_state`."""
        empty = {k: abstract_state[k] for k in items if k != "data" and not jax.tree.leaves(abstract_state[k])}
        args = {k: ocp.args.StandardRestore(abstract_state[k]) for k in items if k != "data" and k not in empty}
        if "data" in items:
            args["data"] = ocp.args.JsonRestore()
        return {**empty, **dict(self.manager.restore(step, args=ocp.args.Composite(**args)))}

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (what Orbax restores into)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def load_model(config, workdir: str, step: int | None = None, *, mesh=None):
    """A model built from `config` with the parameters (and router biases etc.) of checkpoint
    `step` (default: the latest) in `workdir`, sharded over `mesh` (default: all devices, data axis)."""
    from kimi_jax import sharding, train_lib

    if not checkpoint_dir(workdir).exists():  # (a Checkpointer would create the folder)
        raise FileNotFoundError(f"No checkpoint in {checkpoint_dir(workdir)}")
    ckpt = Checkpointer(workdir, async_save=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"No checkpoint in {checkpoint_dir(workdir)}")
    mesh = mesh or sharding.make_mesh({"data": -1})
    graphdef, params, rest = train_lib.abstract_model(config)
    shardings = {"params": sharding.state_shardings(params, mesh), "rest": sharding.state_shardings(rest, mesh)}
    target = {k: abstract_with_shardings(v.to_pure_dict(), shardings[k].to_pure_dict())
              for k, v in (("params", params), ("rest", rest))}
    restored = ckpt.restore(step, target, items=("params", "rest"))
    ckpt.close()
    return nnx.merge(graphdef, restored["params"], restored["rest"])

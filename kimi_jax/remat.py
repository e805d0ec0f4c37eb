"""Per-layer rematerialisation (activation checkpointing) of the decoder blocks.

Without it a 1.3B K3 hybrid at 4 x 4096 tokens keeps every intermediate of every layer for the
backward pass (hundreds of GiB: MLA's [B, H, T, T] float32 logits, the KDA chunk tensors, the
float32 norm inputs). `jax.checkpoint` around each block keeps only what the policy saves:

    "none"      no checkpointing (everything the backward pass needs stays live)
    "full"      only the block inputs (the residual stream); the backward recomputes the layer
    "dots"      also the outputs of matmuls without batch dimensions, i.e. the projections and
                the MLP; attention logits, the KDA recurrence and elementwise work are recomputed
    "dots_all"  every matmul output, attention logits included

The residual stream is a Python object (`kimi_jax.attn_res`); its arrays are passed through the
checkpoint and its other attributes (block size, Python lists) are rebuilt around it.
"""

from __future__ import annotations

import copy

import jax
from flax import nnx

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_all": jax.checkpoint_policies.dots_saveable,
}


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"Unknown remat policy {name!r}; expected one of {sorted(POLICIES)}")
    return name


def _split_arrays(tree):
    """(arrays, rebuild): the jax arrays among the leaves of `tree`, and arrays -> tree."""
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(x, jax.Array) for x in leaves]

    def rebuild(arrays):
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])
    return [x for x, a in zip(leaves, is_array) if a], rebuild


def checkpointed_block(block, stream, policy: str, *, segment_ids=None):
    """`block(stream, segment_ids=...)` under `jax.checkpoint(policy)`; advances `stream` in place
    and returns the block's second output (MoE statistics or None)."""
    check_policy(policy)
    if policy == "none":
        return block(stream, segment_ids=segment_ids)[1]
    graphdef, state = nnx.split(block)
    arrays, rebuild = _split_arrays(vars(stream))
    out_rebuild = []  # set while tracing: the stream's non-array attributes after the block

    def run(state, arrays, segment_ids):
        inner = copy.copy(stream)
        inner.__dict__.update(rebuild(arrays))
        _, stats = nnx.merge(graphdef, state)(inner, segment_ids=segment_ids)
        new_arrays, new_rebuild = _split_arrays(vars(inner))
        out_rebuild[:] = [new_rebuild]
        return new_arrays, stats

    new_arrays, stats = jax.checkpoint(run, policy=POLICIES[policy])(state, arrays, segment_ids)
    stream.__dict__.update(out_rebuild[0](new_arrays))
    return stats

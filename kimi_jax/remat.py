"""Per-layer rematerialisation (activation checkpointing) of the decoder blocks.

Without it every layer's intermediates stay live for the backward pass: the 1.3B K3 hybrid at
4 x 4096 tokens keeps 89 GiB of temporaries on an H200 (it fits there and is the fastest, 409 ms
vs 457 for "dots16": benchmarks/results/train-h200-20261130T0621.json), and memory grows with the
tokens per device. `jax.checkpoint` around each block keeps only what the policy saves:

    "none"      no checkpointing (everything the backward pass needs stays live)
    "full"      only the block inputs (the residual stream); the backward recomputes the layer
    "dots"      also the outputs of matmuls without batch dimensions, i.e. the projections and
                the MLP; attention logits, the KDA recurrence and elementwise work are recomputed
    "dots_all"  every matmul output, attention logits included
    "dots16"    "dots" plus every bf16 result of a matmul or of a float32 -> bf16 rounding of at
                most 16384 elements per token, and the KDA chunk state snapshots and v'
                (checkpoint names `kernels.kda.chunk.STATES_NAME`, `VN_NAME`): the mixers' bf16
                activations are kept, so the backward redoes float32 elementwise work, data
                movement and MLA's [T, T] attention, not the KDA state scan

A spec may give mixers their own policy after the default: "dots16/mla=dots_all" keeps MLA's
attention logits and KDA's bf16 activations.

The residual stream is a Python object (`kimi_jax.attn_res`); its arrays are passed through the
checkpoint and its other attributes (block size, Python lists) are rebuilt around it.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.kda.chunk import STATES_NAME, VN_NAME

SMALL_PER_TOKEN = 16384  # elements per token below which "dots16" keeps a 16-bit value
# Checkpoint names "dots16" keeps: the KDA chunk states and, when the op keeps it
# (`chunk.settings(residuals="states_vn")`), v' (Pallas kernels' outputs, which the dtype rule
# cannot see), so the backward does not rerun the forward state pass.
SAVED_NAMES = (STATES_NAME, VN_NAME)
_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@dataclasses.dataclass(frozen=True)
class Dots16:
    """Saveable: matmul outputs without batch dimensions, and the 16-bit results of matmuls and
    of float32 -> 16-bit roundings, of at most `limit` elements (the policy sees an operation's
    inputs; the output dtype comes from `new_dtype` / `preferred_element_type`), and the values
    named by `checkpoint_name` with a name in SAVED_NAMES."""

    limit: int

    def __call__(self, prim, *avals, **params):
        if _DOTS(prim, *avals, **params):
            return True
        if prim.name == "name" and params.get("name") in SAVED_NAMES:
            return True
        if prim.name not in ("dot_general", "convert_element_type") or not avals:
            return False  # data movement (slices, pads, transposes) is cheap to redo
        dtype = params.get("new_dtype") or params.get("preferred_element_type") or avals[0].dtype
        if np.dtype(dtype).itemsize != 2 or not jnp.issubdtype(dtype, jnp.floating):
            return False
        return max(int(np.prod(a.shape)) for a in avals) <= self.limit


POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": _DOTS,
    "dots_all": jax.checkpoint_policies.dots_saveable,
    "dots16": Dots16,
}


def make_policy(name: str, tokens: int):
    """The jax.checkpoint policy of `name` for a block over `tokens` tokens (B x T)."""
    policy = POLICIES[policy_for(name, "")]
    return policy(SMALL_PER_TOKEN * tokens) if policy is Dots16 else policy


def parse_spec(spec: str) -> tuple[str, dict]:
    """"dots16/mla=dots_all" -> ("dots16", {"mla": "dots_all"}): a default policy, then
    per-mixer overrides separated by "/"."""
    default, *overrides = spec.split("/")
    per_mixer = {}
    for item in overrides:
        mixer, sep, name = item.partition("=")
        if not sep or not mixer:
            raise ValueError(f"remat override {item!r} in {spec!r} is not mixer=policy")
        per_mixer[mixer] = name
    for name in [default, *per_mixer.values()]:
        if name not in POLICIES:
            raise ValueError(f"Unknown remat policy {name!r} in {spec!r}; expected one of {sorted(POLICIES)}, "
                             f"optionally followed by /mixer=policy overrides")
    return default, per_mixer


def check_policy(spec: str) -> str:
    parse_spec(spec)
    return spec


def policy_for(spec: str, mixer: str) -> str:
    """The policy name `spec` gives the blocks of `mixer`."""
    default, per_mixer = parse_spec(spec)
    return per_mixer.get(mixer, default)


def _split_arrays(tree):
    """(arrays, rebuild): the jax arrays among the leaves of `tree`, and arrays -> tree."""
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(x, jax.Array) for x in leaves]

    def rebuild(arrays):
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])
    return [x for x, a in zip(leaves, is_array) if a], rebuild


def checkpointed_block(block, stream, spec: str, *, segment_ids=None, dropout_key=None):
    """`block(stream, segment_ids=..., dropout_key=...)` under `jax.checkpoint` with the policy
    `spec` gives the block's mixer; advances `stream` in place and returns the block's second
    output (MoE statistics or None)."""
    policy = policy_for(spec, block.mixer_name)
    if policy == "none":
        return block(stream, segment_ids=segment_ids, dropout_key=dropout_key)[1]
    graphdef, state = nnx.split(block)
    arrays, rebuild = _split_arrays(vars(stream))
    out_rebuild = []  # set while tracing: the stream's non-array attributes after the block

    def run(state, arrays, segment_ids, dropout_key):
        inner = copy.copy(stream)
        inner.__dict__.update(rebuild(arrays))
        _, stats = nnx.merge(graphdef, state)(inner, segment_ids=segment_ids, dropout_key=dropout_key)
        new_arrays, new_rebuild = _split_arrays(vars(inner))
        out_rebuild[:] = [new_rebuild]
        return new_arrays, stats

    tokens = int(np.prod(arrays[0].shape[:2]))  # the stream's first array is [B, T, D]
    new_arrays, stats = jax.checkpoint(run, policy=make_policy(policy, tokens))(state, arrays, segment_ids,
                                                                                 dropout_key)
    stream.__dict__.update(out_rebuild[0](new_arrays))
    return stats

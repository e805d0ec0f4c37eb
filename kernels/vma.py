"""Pallas kernels inside `jax.shard_map` with its varying-axes check on (`check_vma=True`, the
default; `kimi_jax.moe_ep.expert_parallel` runs the grouped-matmul kernels so).

Under that check every value carries the set of mesh axes it varies over
(`jax.typeof(x).manual_axis_type.varying` in jax 0.11).
A kernel's outputs come back without one, as if the same on every device, although they depend
on per-device inputs; the next operation or a custom VJP whose cotangent does carry the axes then
fails to trace. Two fixes, both no-ops outside shard_map:

  * `kernel_outputs(out, *inputs)`: a launcher's outputs vary over every axis its inputs vary over
    (`kernels.lowering.lowered_once` applies it to every launcher);
  * `same_varying(*xs)`: operands cast to their common axes before a custom VJP, so the rule sees
    one type throughout; the cast's transpose sums a replicated operand's gradient over the axes
    it was cast along (a weight replicated over the data axis gets the sum of every shard's part).
"""

from __future__ import annotations

import jax


def _varying(x) -> frozenset:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if mat is None else frozenset(mat.varying)


def varying_axes(*trees) -> frozenset:
    """The mesh axes any array leaf of `trees` varies over (empty outside shard_map)."""
    axes = frozenset()
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):
            axes |= _varying(leaf)
    return axes


def to_varying(tree, axes: frozenset):
    """Every array leaf of `tree` cast to vary over `axes` (those it already varies over kept)."""
    if not axes:
        return tree

    def cast(x):
        if not isinstance(x, jax.Array):
            return x
        missing = tuple(sorted(axes - _varying(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def kernel_outputs(out, *inputs):
    """`out` (a kernel's results) typed as varying over every axis `inputs` vary over."""
    return to_varying(out, varying_axes(*inputs))


def same_varying(*xs):
    """`xs` each cast to the axes any of them varies over (a tuple, in order)."""
    return tuple(to_varying(xs, varying_axes(*xs)))

"""Routed-expert computation and the token dispatch strategies, resolved by name in `dispatch_fn`.

Every strategy has the signature
    fn(x [N, D], expert_idx [N, k] int32, weights [N, k] float32, experts: ExpertWeights,
       activation) -> y [N, D] (float32)
and computes y_n = sum_j weights[n, j] * Expert_{expert_idx[n, j]}(x_n).

- "dense": the reference. Every expert runs on every token and the combine weights mask it
  ([N, E, F] memory); exact and simple, for tests and tiny models.
- "ragged": dropless. The N*k (token, expert) pairs are sorted by expert, the expert FFN runs as a
  grouped matmul over (sorted tokens, group sizes) with `jax.lax.ragged_dot`, and the outputs are
  un-permuted and weighted. `grouped_ffn` is the piece a Pallas grouped matmul or an
  expert-parallel all-to-all wrapper replaces (pass `matmul=`).
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kernels.gmm import ops as gmm_ops
from kernels.mxfp4.format import MXFP4Weight
from kimi_jax.ffn import GLU
from kimi_jax.layers import read_setting, traced_setting


class ExpertWeights(NamedTuple):
    """Stacked SwiGLU-style expert weights: gate, up [E, D, F]; down [E, F, D]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


# How `grouped_ffn` forms gate and up (read while tracing; `gate_up(mode)` sets it for a block):
# "separate" (two grouped matmuls, against gate and against up) or "fused" (one grouped matmul
# against [gate | up] concatenated along N, then split: x is read once, N is 2F per tile, and the
# backward forms dx with one grouped matmul of contraction 2F instead of two and a sum, and the
# weight gradient with one tgmm instead of two). The concatenation is of the compute-dtype copies
# the matmuls read anyway (MXFP4 weights: their packed codes and scales). Same values; one of the
# fusions the small-config byte model names (README, MoE). Timed on an H200 it is slower at both
# workloads of benchmarks/moe.py (k3_small FFN 0.47 vs 0.43 ms, K3 per-device layer 224.2 vs
# 215.5 ms; benchmarks/results/moe-gateup-h200-20261201T0113.json), so "separate" stays.
# "fused_bwd": the forward of "separate" with the backward of "fused" (`_gate_up_fused_bwd`): the
# fused forward's one matmul of width 2F is what made it slower, its backward is the saving. Timed
# at k3_small it ties with "separate" (layer 0.528 vs 0.525 ms; moe-k3small-h200-20261201T0706.json):
# two fewer launches (0.27 vs 0.31 ms of Mosaic time), but XLA concatenates the two cotangents (36 us).
# "fused_glu": gate, up and the activation in one kernel, and the activation's backward in the
# down projection's input-gradient kernel (`kernels.gmm.glu_ffn`); needs the dispatch's fused GLU
# (`glu_ffn=`, given by the gmm and expert-parallel dispatches) and dense expert weights. The
# fastest form at k3_small (ffn 0.37 vs 0.43 ms, layer 0.46 vs 0.51;
# moe-k3small-glu-h200-20261202T0220.json) but untimed at K3's per-device shapes: "auto" runs it
# only for experts as narrow as k3_small's.
# "fused_ffn": the whole FFN of a block of rows in one kernel, its hidden activation in SMEM
# (`glu_ffn(..., fusion="ffn")`): four launches per step and x the only residual, for experts
# narrow enough (k3_small's; wider ones raise). Slower than "fused_glu" at k3_small (ffn 0.46 vs
# 0.37 ms, layer 0.50 vs 0.40; moe-k3small-sort-ffn-h200-20261205T0318.json).
# "auto" (the default): "fused_glu" where it was timed fastest, experts no wider than
# AUTO_GLU_MAX_WIDTH (D and F; k3_small's 256 x 224) with dense weights, a named GLU activation and a
# dispatch whose fused GLU runs the Pallas kernels (on Hopper; elsewhere it would be the reference);
# otherwise "separate" (K3's per-device 3584 x 3072 experts: "fused_glu" untimed there).
GATE_UP_MODES = ("auto", "separate", "fused", "fused_bwd", "fused_glu", "fused_ffn")
GATE_UP = "auto"
AUTO_GLU_MAX_WIDTH = 256


def gate_up(mode: str | None):
    """Within the block, trace `grouped_ffn` with gate/up `mode` (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "GATE_UP", GATE_UP_MODES, mode)


def resolve_gate_up(w: ExpertWeights, activation, glu_ffn: Callable | None, dtype) -> str:
    """GATE_UP for these experts, run in compute dtype `dtype` by a dispatch that passes `glu_ffn`
    (or None), with "auto" resolved (see GATE_UP_MODES)."""
    mode = read_setting(sys.modules[__name__], "GATE_UP", GATE_UP_MODES)
    if mode != "auto":
        return mode
    dense = not any(isinstance(x, MXFP4Weight) for x in w)
    if glu_ffn is None or not dense or not isinstance(activation, GLU):
        return "separate"
    narrow = max(w.gate.shape[1:]) <= AUTO_GLU_MAX_WIDTH
    kernel = gmm_ops.resolve_impl("auto", dtype) == "pallas_gpu"
    return "fused_glu" if narrow and kernel else "separate"


def concat_n(a, b):
    """Two stacked weights [E, K, N1], [E, K, N2] (arrays or MXFP4Weight) -> [E, K, N1 + N2]."""
    if isinstance(a, MXFP4Weight) != isinstance(b, MXFP4Weight):
        raise ValueError("concat_n needs both weights packed (MXFP4Weight) or both dense")
    if isinstance(a, MXFP4Weight):  # packed [E, N, K/2], scales [E, N, K/32]: N is axis 1
        return MXFP4Weight(jnp.concatenate([a.packed, b.packed], axis=1), jnp.concatenate([a.scales, b.scales], axis=1))
    return jnp.concatenate([a, b], axis=2)


def grouped_ffn(x_sorted, group_sizes, w: ExpertWeights, activation,
                *, matmul: Callable = jax.lax.ragged_dot, glu_ffn: Callable | None = None):
    """Expert FFN over tokens sorted by expert.

    x_sorted [M, D] (rows of expert e are contiguous, experts in order), group_sizes [E] int32
    (sum <= M; trailing rows beyond the sum give zeros), w: ExpertWeights -> [M, D] in x's dtype.
    `matmul(lhs [M, K], rhs [E, K, N], group_sizes [E]) -> [M, N]` is the grouped matmul; gate and
    up run as GATE_UP says. `glu_ffn(x, w_gate, w_up, w_down, group_sizes, activation, fusion) -> [M, D]`
    is the whole FFN with the activation fused, which GATE_UP="fused_glu" (fusion "glu") and
    "fused_ffn" (fusion "ffn") run.
    """
    dtype = x_sorted.dtype
    mode = resolve_gate_up(w, activation, glu_ffn, dtype)
    if mode in ("fused_glu", "fused_ffn"):
        if glu_ffn is None:
            raise ValueError(f"GATE_UP={mode!r} needs a fused GLU kernel; the 'gmm' and 'expert_parallel' "
                             "dispatches have one (kernels.gmm.glu_ffn), this dispatch passes none")
        return glu_ffn(x_sorted, w.gate.astype(dtype), w.up.astype(dtype), w.down.astype(dtype), group_sizes,
                       activation, mode.removeprefix("fused_"))
    if mode == "fused":
        F = w.gate.shape[2]
        gu = matmul(x_sorted, concat_n(w.gate.astype(dtype), w.up.astype(dtype)), group_sizes)
        gate, up = gu[:, :F], gu[:, F:]
    elif mode == "fused_bwd":
        gate, up = _gate_up_fused_bwd(x_sorted, w.gate.astype(dtype), w.up.astype(dtype), group_sizes, matmul)
    else:
        gate = matmul(x_sorted, w.gate.astype(dtype), group_sizes)
        up = matmul(x_sorted, w.up.astype(dtype), group_sizes)
    h = activation(gate, up).astype(dtype)
    return matmul(h, w.down.astype(dtype), group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gate_up_fused_bwd(x, w_gate, w_up, group_sizes, matmul):
    """(x @ w_gate, x @ w_up) by group as two grouped matmuls; the backward runs the concatenated
    product's: dx with one grouped matmul of contraction 2F (no sum of two input gradients) and
    the weight gradients with one transposed grouped matmul of width 2F."""
    return matmul(x, w_gate, group_sizes), matmul(x, w_up, group_sizes)


def _gate_up_fused_bwd_fwd(x, w_gate, w_up, group_sizes, matmul):
    return _gate_up_fused_bwd(x, w_gate, w_up, group_sizes, matmul), (x, w_gate, w_up, group_sizes)


def _gate_up_fused_bwd_bwd(matmul, res, cts):
    x, w_gate, w_up, group_sizes = res
    F = w_gate.shape[2]
    # The product's own backward; its forward output is unused, so the compiler drops it.
    _, vjp = jax.vjp(lambda x, w: matmul(x, w, group_sizes), x, concat_n(w_gate, w_up))
    dx, dw = vjp(jnp.concatenate([c.astype(x.dtype) for c in cts], axis=1))
    return dx, dw[:, :, :F], dw[:, :, F:], None


_gate_up_fused_bwd.defvjp(_gate_up_fused_bwd_fwd, _gate_up_fused_bwd_bwd)


# How the dispatch sorts the (token, expert) pairs (read while tracing; `pair_sort(mode)` sets it for a
# block): "argsort" (a stable sort of the expert ids, then one scatter for the inverse permutation;
# at k3_small XLA's GPU sort took 37 us in 12 launches and the scatter 11 us,
# benchmarks/results/moe-k3small-h200-20261201T0706.json) or "counting" (a stable counting sort: a
# pair's sorted position is its expert's offset plus its rank among that expert's pairs, a cumsum
# down a [pairs, experts] one-hot. Those positions are the inverse permutation, and one scatter of
# them gives the order). "counting" holds pairs x experts int32 (2 MiB at k3_small, 256 MiB at K3's
# per-device 524288 x 128), so it refuses more than COUNTING_MAX_ELEMENTS. "auto" (the default) takes
# "counting" up to that size and "argsort" past it: on an H200 the k3_small layer step (fused_glu)
# took 0.40 ms with "counting" against 0.46 with "argsort" side by side
# (benchmarks/results/moe-k3small-sort-ffn-h200-20261205T0318.json; 2^19 one-hot entries there, the
# only size timed so far).
PAIR_SORTS = ("auto", "argsort", "counting")
PAIR_SORT = "auto"
COUNTING_MAX_ELEMENTS = 1 << 24


def pair_sort(mode: str | None):
    """Within the block, trace the dispatch's pair sort as `mode` (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "PAIR_SORT", PAIR_SORTS, mode)


def resolve_pair_sort(pairs: int, num_experts: int) -> str:
    """PAIR_SORT for `pairs` (token, expert) pairs over `num_experts`: "auto" is "counting" while its
    [pairs, experts] one-hot stays within COUNTING_MAX_ELEMENTS, else "argsort" (same order)."""
    mode = read_setting(sys.modules[__name__], "PAIR_SORT", PAIR_SORTS)
    if mode == "auto":
        return "counting" if pairs * num_experts <= COUNTING_MAX_ELEMENTS else "argsort"
    return mode


def sort_pairs(expert_idx, num_experts: int):
    """The (token, expert) pairs sorted by expert, stably, as PAIR_SORT says: expert_idx [N, k]
    -> (order [N*k] (flat pair of each sorted position), inverse [N*k] (sorted position of each
    pair, argsort(order)), group_sizes [E] int32)."""
    flat = expert_idx.reshape(-1)
    if resolve_pair_sort(flat.size, num_experts) == "argsort":
        order, _, group_sizes = sort_by_expert(expert_idx, num_experts)
        return order, inverse_permutation(order), group_sizes
    if flat.size * num_experts > COUNTING_MAX_ELEMENTS:
        raise ValueError(f"PAIR_SORT='counting' forms a [{flat.size}, {num_experts}] one-hot, more than "
                         f"COUNTING_MAX_ELEMENTS={COUNTING_MAX_ELEMENTS}; use 'argsort' at this size")
    onehot = (flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype)).astype(jnp.int32)
    group_sizes = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # earlier pairs of the same expert
    inverse = (jnp.cumsum(group_sizes) - group_sizes)[flat] + rank
    return inverse_permutation(inverse), inverse, group_sizes


def sort_by_expert(expert_idx, num_experts: int):
    """Sort the N*k (token, expert) pairs by expert.

    expert_idx [N, k] -> (order [N*k] (indices into the flattened pairs), token [N*k] (token of
    each sorted pair), group_sizes [E] int32).
    """
    flat = expert_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // expert_idx.shape[1]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, token, group_sizes


# The row gathers of the sort and the un-sort. Autodiff transposes a gather into a scatter-add,
# which XLA runs with atomic adds; knowing the indices form a permutation, the backward of each is
# a gather by the inverse permutation instead (and, for the k copies of a token, a sum).


def inverse_permutation(perm):
    """argsort(perm) for a permutation `perm` [M] of 0..M-1, as one scatter (no second sort)."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype), unique_indices=True)


def _take_rows(x, idx):
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def permute_rows(x, perm, inverse):
    """x[perm] [M', D] for `perm` [M'] that maps rows one to one (out-of-range entries: zero rows)
    and `inverse` [M] its inverse (argsort(perm) for a permutation; out of range for rows of x
    that `perm` does not take). Its backward is the gather dy[inverse] (no scatter)."""
    return _take_rows(x, perm)


def _permute_rows_fwd(x, perm, inverse):
    return _take_rows(x, perm), inverse


def _permute_rows_bwd(inverse, dy):
    return _take_rows(dy, inverse), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def gather_pairs(x, order, inverse):
    """Rows of the sorted (token, expert) pairs: x [N, D] -> x[order // k] [N*k, D], k = len(order) / N,
    with `order` the pairs' sort (`sort_by_expert`) and `inverse` = argsort(order). The backward
    gathers the pairs back into token order and sums each token's k rows (in float32)."""
    if order.shape[0] % x.shape[0]:
        raise ValueError(f"gather_pairs: {order.shape[0]} pairs are not a multiple of {x.shape[0]} tokens")
    return _gather_pairs(x, order, inverse, order.shape[0] // x.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_pairs(x, order, inverse, k):
    return x[order // k]


def _gather_pairs_fwd(x, order, inverse, k):
    return x[order // k], inverse


def _gather_pairs_bwd(k, inverse, dy):
    dx = dy[inverse].reshape(-1, k, dy.shape[-1]).astype(jnp.float32).sum(1)
    return dx.astype(dy.dtype), None, None


_gather_pairs.defvjp(_gather_pairs_fwd, _gather_pairs_bwd)


def combine_rows(rows, src, weights, dst):
    """Each token's k expert outputs, weighted and summed: y[n] = sum_j weights[n, j] * rows[src[n k + j]]
    -> [N, D] float32, from rows [R, D], src [N*k] (the row of every (token, slot) pair; out of range:
    a dropped pair, zero) and dst [R] its inverse (the pair each row holds; out of range: none).

    One gather-and-reduce each way instead of an un-permute, a [N, k, D] float32 copy and a batched
    product: the backward forms rows' gradient as dy[dst // k] * weights[dst] in one gather (no
    [N, k, D] outer product) and the weights' as a gather-and-reduce of rows against dy."""
    if src.shape != (weights.size,) or dst.shape != (rows.shape[0],):
        raise ValueError(f"combine_rows: src {src.shape} must be [N*k] = [{weights.size}] and dst {dst.shape} "
                         f"[{rows.shape[0]}] (one entry per row)")
    return _combine_rows(rows, src, weights, dst)


def _weighted_sum(rows, src, weights):
    N, k = weights.shape
    y = _take_rows(rows, src).reshape(N, k, -1).astype(jnp.float32)
    return jnp.sum(y * weights.astype(jnp.float32)[:, :, None], axis=1)


@jax.custom_vjp
def _combine_rows(rows, src, weights, dst):
    return _weighted_sum(rows, src, weights)


def _combine_rows_fwd(rows, src, weights, dst):
    return _weighted_sum(rows, src, weights), (rows, src, weights, dst)


def _combine_rows_bwd(res, dy):
    rows, src, weights, dst = res
    N, k = weights.shape
    w_flat = _take_rows(weights.reshape(-1).astype(jnp.float32), dst)  # 0 where a row holds no pair
    drows = (_take_rows(dy, dst // k) * w_flat[:, None]).astype(rows.dtype)
    picked = _take_rows(rows, src).reshape(N, k, -1).astype(jnp.float32)
    dw = jnp.sum(picked * dy[:, None, :], axis=2).astype(weights.dtype)
    return drows, None, dw, None


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def combine_sorted(y_sorted, order, weights, inverse=None):
    """Undo the sort and sum each token's k expert outputs with its weights.

    y_sorted [N*k, D], order [N*k] (inverse = argsort(order), computed if not given),
    weights [N, k] -> [N, D] float32.
    """
    inverse = inverse_permutation(order) if inverse is None else inverse
    return combine_rows(y_sorted, inverse, weights, order)


def ragged_dispatch(x, expert_idx, weights, experts: ExpertWeights, activation,
                    *, matmul: Callable = jax.lax.ragged_dot, glu_ffn: Callable | None = None):
    """Dropless sort + grouped matmul + un-sort (see module docstring; `glu_ffn`: see grouped_ffn)."""
    _check(x, expert_idx, weights, experts)
    order, inverse, group_sizes = sort_pairs(expert_idx, experts.gate.shape[0])
    y_sorted = grouped_ffn(gather_pairs(x, order, inverse), group_sizes, experts, activation, matmul=matmul,
                           glu_ffn=glu_ffn)
    return combine_sorted(y_sorted, order, weights, inverse)


def dense_dispatch(x, expert_idx, weights, experts: ExpertWeights, activation):
    """Reference: every expert on every token, masked by the [N, E] combine weights."""
    _check(x, expert_idx, weights, experts)
    E = experts.gate.shape[0]
    dtype = x.dtype
    combine = jnp.zeros((x.shape[0], E), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], expert_idx].add(weights.astype(jnp.float32))
    gate = jnp.einsum("nd,edf->nef", x, experts.gate.astype(dtype))
    up = jnp.einsum("nd,edf->nef", x, experts.up.astype(dtype))
    h = activation(gate, up).astype(dtype)
    y = jnp.einsum("nef,efd->ned", h, experts.down.astype(dtype)).astype(jnp.float32)
    return jnp.einsum("ned,ne->nd", y, combine)


def _check(x, expert_idx, weights, experts: ExpertWeights) -> None:
    E, D, F = experts.gate.shape
    if x.ndim != 2 or x.shape[1] != D:
        raise ValueError(f"dispatch expects x [N, {D}]; got x.shape={x.shape}")
    if expert_idx.shape != weights.shape or expert_idx.shape[0] != x.shape[0]:
        raise ValueError(f"expert_idx and weights must both be [N={x.shape[0]}, k]; got "
                         f"{expert_idx.shape} and {weights.shape}")
    if experts.up.shape != (E, D, F) or experts.down.shape != (E, F, D):
        raise ValueError(f"expert weights must be gate/up [E, D, F], down [E, F, D]; got "
                         f"{experts.gate.shape}, {experts.up.shape}, {experts.down.shape}")


DISPATCH = {
    "dense": dense_dispatch,
    "ragged": ragged_dispatch,
}


def dispatch_fn(name: str):
    """The one place a dispatch name is resolved."""
    if name not in DISPATCH:
        raise ValueError(f"Unknown dispatch={name!r}; expected one of {sorted(DISPATCH)}")
    return DISPATCH[name]


# "gmm" and "expert_parallel" (grouped-matmul kernels, expert parallelism) register on import.
from kimi_jax import moe_ep  # noqa: E402,F401

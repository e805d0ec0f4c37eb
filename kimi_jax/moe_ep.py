"""Routed experts as grouped matmuls, on one device ("gmm") or expert-parallel ("expert_parallel"),
and "auto", which picks among them and "ragged" for the device and mesh (`resolve_auto`).

All follow the dispatch signature of `kimi_jax.moe_dispatch`:
    fn(x [N, D], expert_idx [N, k], weights [N, k], experts: ExpertWeights, activation)
        -> y [N, D] float32
`expert_parallel_dispatch` and `auto_dispatch` also take `capacity_factor` and `return_dropped`.

Expert parallelism (mesh axis "expert", P shards of E/P experts each), inside `shard_map`:
1. each device holds the tokens of its batch shard (`act_batch`: data, fsdp, expert axes) and
   sorts its N_l*k (token, expert) pairs by destination shard;
2. the pairs go to their shard through a dense `all_to_all` over fixed [P, C, D] buffers
   (`ragged_all_to_all` has no CPU lowering and is reported broken on H100 in jax 0.11.2);
3. each shard sorts what it received by local expert and runs the expert FFN as a grouped matmul
   (`kernels.gmm`; MXFP4 weights through `kernels.mxfp4`); with a "tensor" axis the expert
   hidden width is sharded and the down projection is summed over it;
4. a second `all_to_all` brings the outputs home, where each token sums its k outputs.
Capacity: `capacity_factor=None` is dropless: C = N_l*k, the worst case of every pair going to
one shard (memory P*N_l*k*D per buffer). A number bounds memory: C = ceil(cf * N_l*k / P), and
pairs past C on their shard are dropped (contribute zero); their count is returned (summed over
the mesh) so the MoE can report it. Weights enter shard_map as [E/P, D, F/tensor]: a
"fsdp"-sharded D is gathered at the boundary (the FSDP all-gather; its transpose reduce-scatters
the gradient).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels import gmm as gmm_ops
from kernels import mxfp4
from kimi_jax.ffn import GLU
from kimi_jax.moe_dispatch import (DISPATCH, ExpertWeights, _check, combine_rows, grouped_ffn, inverse_permutation,
                                   permute_rows, ragged_dispatch)
from kimi_jax.sharding import LOGICAL_AXIS_RULES

log = logging.getLogger(__name__)

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


def grouped_matmul(lhs, rhs, group_sizes):
    """lhs [M, K] x rhs [G, K, N] by group; rhs float or `mxfp4.MXFP4Weight` (read packed)."""
    if isinstance(rhs, mxfp4.MXFP4Weight):
        return mxfp4.gmm(lhs, rhs.packed, rhs.scales, group_sizes)
    return gmm_ops.gmm(lhs, rhs, group_sizes)


def fused_glu_ffn(x, w_gate, w_up, w_down, group_sizes, activation, fusion="glu"):
    """The expert FFN with its activation fused into the grouped matmuls (`kernels.gmm.glu_ffn`,
    `fusion` "glu" or "ffn"), for GATE_UP="fused_glu" / "fused_ffn": dense weights and a GLU
    activation from `ffn.glu_activation`."""
    mode = f"fused_{fusion}"
    if any(isinstance(w, mxfp4.MXFP4Weight) for w in (w_gate, w_up, w_down)):
        raise ValueError(f"GATE_UP={mode!r} runs dense expert weights; MXFP4 experts take 'separate' or 'fused'")
    if not isinstance(activation, GLU):
        raise ValueError(f"GATE_UP={mode!r} needs a named GLU activation (ffn.glu_activation); got {activation!r}")
    return gmm_ops.glu_ffn(x, w_gate, w_up, w_down, group_sizes, kind=activation.kind, beta=activation.beta,
                           linear_beta=activation.linear_beta, fusion=fusion)


def gmm_dispatch(x, expert_idx, weights, experts: ExpertWeights, activation):
    """Dropless single-device dispatch through `kernels.gmm` (Pallas on Hopper)."""
    return ragged_dispatch(x, expert_idx, weights, experts, activation, matmul=grouped_matmul,
                           glu_ffn=fused_glu_ffn)


def _batch_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in dict(LOGICAL_AXIS_RULES)["act_batch"] if a in mesh.axis_names)


def capacity(tokens_per_shard: int, top_k: int, num_shards: int, capacity_factor) -> int:
    """Rows each device reserves per destination shard (worst case when capacity_factor is None)."""
    pairs = tokens_per_shard * top_k
    if capacity_factor is None:
        return pairs
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
    return max(1, min(pairs, math.ceil(capacity_factor * pairs / num_shards)))


def _local_experts(x, expert_idx, weights, experts, activation, *, num_shards, cap, ep_axis,
                   tensor_axis):
    """One device's part: route pairs to shards, run local experts, bring outputs back.

    x [N_l, D], expert_idx/weights [N_l, k], experts [E/P, ...] -> (y [N_l, D] f32, dropped).
    """
    n_tok, k = expert_idx.shape
    e_local = experts.gate.shape[0]
    d = x.shape[1]
    flat = expert_idx.reshape(-1)
    dest, local = flat // e_local, flat % e_local
    order = jnp.argsort(flat, stable=True)  # by global expert, hence by destination shard
    counts = jnp.zeros((num_shards,), jnp.int32).at[dest].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[dest[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    keep = rank < cap
    slot = jnp.where(keep, dest * cap + rank, num_shards * cap)  # out of range = dropped
    # Rows of the send buffer <-> kept pairs, one to one: gathers both ways (no scatter of rows,
    # and gather backwards: `permute_rows`); the broadcast's backward sums each token's k rows.
    pair_of_slot = jnp.full((num_shards * cap,), flat.shape[0], jnp.int32).at[slot].set(
        jnp.arange(flat.shape[0], dtype=jnp.int32), mode="drop")
    pairs_x = jnp.broadcast_to(x[:, None], (n_tok, k, d)).reshape(n_tok * k, d)
    send_x = permute_rows(pairs_x, pair_of_slot, slot)
    send_e = jnp.full((num_shards * cap,), e_local, jnp.int32).at[slot].set(local, mode="drop")
    if ep_axis is not None:
        send_x = jax.lax.all_to_all(send_x, ep_axis, 0, 0, tiled=True)
        send_e = jax.lax.all_to_all(send_e, ep_axis, 0, 0, tiled=True)
    # received rows: sort by local expert; padding (id e_local) sorts last and yields zeros
    order2 = jnp.argsort(send_e, stable=True)
    inverse2 = inverse_permutation(order2)
    group_sizes = jnp.zeros((e_local,), jnp.int32).at[send_e].add(1, mode="drop")
    y_sorted = grouped_ffn(permute_rows(send_x, order2, inverse2), group_sizes, experts, activation,
                           matmul=grouped_matmul, glu_ffn=fused_glu_ffn).astype(jnp.float32)
    if tensor_axis is not None:
        y_sorted = jax.lax.psum(y_sorted, tensor_axis)
    y_rows = permute_rows(y_sorted, inverse2, order2).astype(x.dtype)
    if ep_axis is not None:
        y_rows = jax.lax.all_to_all(y_rows, ep_axis, 0, 0, tiled=True)
    y = combine_rows(y_rows, slot, weights, pair_of_slot)  # dropped pairs: zero rows
    return y, jnp.sum(~keep).astype(jnp.int32)


def _weight_specs(experts, expert, tensor):
    def spec(w, hidden_axis):
        if isinstance(w, mxfp4.MXFP4Weight):  # [E, N, K/2] packed: shard experts only
            return mxfp4.MXFP4Weight(P(expert), P(expert))
        dims = [expert, None, None]
        dims[hidden_axis] = tensor
        return P(*dims)

    return ExpertWeights(spec(experts.gate, 2), spec(experts.up, 2), spec(experts.down, 1))


def expert_parallel_dispatch(x, expert_idx, weights, experts: ExpertWeights, activation, *,
                             capacity_factor=None, return_dropped=False):
    """Expert-parallel routed experts over the active mesh (see module docstring).

    Without an active mesh this is the same algorithm on one shard; a mesh without an "expert"
    axis still runs it per batch shard (one expert shard, no all-to-all).
    Returns y [N, D] float32, and with `return_dropped` also the int32 count of dropped pairs.
    """
    _check(x, expert_idx, weights, experts)
    num_experts = experts.gate.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        cap = capacity(x.shape[0], expert_idx.shape[1], 1, capacity_factor)
        y, dropped = _local_experts(x, expert_idx, weights, experts, activation, num_shards=1,
                                    cap=cap, ep_axis=None, tensor_axis=None)
        return (y, dropped) if return_dropped else y

    expert = EXPERT_AXIS if EXPERT_AXIS in mesh.axis_names else None
    shards = mesh.shape[expert] if expert else 1
    batch_axes = _batch_axes(mesh)
    batch_shards = math.prod(mesh.shape[a] for a in batch_axes)
    packed = isinstance(experts.gate, mxfp4.MXFP4Weight)  # inference: experts split only
    has_tensor = TENSOR_AXIS in mesh.axis_names and mesh.shape[TENSOR_AXIS] > 1 and not packed
    tensor = TENSOR_AXIS if has_tensor else None
    hidden = experts.gate.shape[2]
    if num_experts % shards or x.shape[0] % batch_shards or (tensor and hidden % mesh.shape[tensor]):
        raise ValueError(
            f"expert_parallel: num_experts={num_experts} must divide by expert={shards}, tokens "
            f"N={x.shape[0]} by the batch shards {batch_shards} ({batch_axes}), and the expert "
            f"hidden width {hidden} by tensor={mesh.shape.get(TENSOR_AXIS, 1)}")
    cap = capacity(x.shape[0] // batch_shards, expert_idx.shape[1], shards, capacity_factor)
    local = functools.partial(_local_experts, activation=activation, num_shards=shards, cap=cap,
                              ep_axis=expert, tensor_axis=tensor)

    def body(x, idx, w, ex):
        y, dropped = local(x, idx, w, ex)
        return y, jax.lax.psum(dropped, batch_axes) if batch_axes else dropped

    tok = P(batch_axes or None, None)
    y, dropped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, tok, tok, _weight_specs(experts, expert, tensor)),
        out_specs=(tok, P()),
    )(x, expert_idx, weights, experts)
    return (y, dropped) if return_dropped else y


def resolve_auto(dtype, packed: bool) -> tuple[str, str]:
    """The dispatch "auto" runs for experts computed in `dtype` (MXFP4 when `packed`) under the
    active mesh, and why: (name, reason). The Pallas grouped matmul is a per-device kernel that
    XLA does not partition, so on several devices it runs inside `expert_parallel`'s shard_map
    (per batch shard, and per expert shard where the mesh has an expert axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh is None or mesh.empty else mesh.size
    expert = 1 if devices == 1 else mesh.shape.get(EXPERT_AXIS, 1)
    if expert > 1:
        return "expert_parallel", f"experts sharded over the mesh's {EXPERT_AXIS!r} axis ({expert})"
    pallas = packed or gmm_ops.resolve_impl("auto", dtype) == "pallas_gpu"
    if not pallas:
        return "ragged", (f"the grouped matmul is not a Pallas kernel here ({jax.devices()[0].device_kind}, "
                          f"{jnp.dtype(dtype).name}): jax.lax.ragged_dot, which XLA partitions")
    what = "MXFP4 experts (read packed)" if packed else "Pallas grouped matmul (Hopper)"
    if devices == 1:
        return "gmm", f"{what} on one device"
    return "expert_parallel", f"{what} per batch shard of {devices} devices"


_auto_logged: set = set()


def auto_dispatch(x, expert_idx, weights, experts: ExpertWeights, activation, *,
                  capacity_factor=None, return_dropped=False):
    """The dispatch `resolve_auto` picks for these experts under the active mesh (logged once per
    choice); takes and returns what `expert_parallel_dispatch` does (the others drop nothing)."""
    packed = isinstance(experts.gate, mxfp4.MXFP4Weight)
    name, reason = resolve_auto(x.dtype, packed)
    if (name, reason) not in _auto_logged:
        _auto_logged.add((name, reason))
        log.info("moe dispatch 'auto' -> %r: %s", name, reason)
    if name == "expert_parallel":
        return expert_parallel_dispatch(x, expert_idx, weights, experts, activation,
                                        capacity_factor=capacity_factor, return_dropped=return_dropped)
    y = DISPATCH[name](x, expert_idx, weights, experts, activation)
    return (y, jnp.zeros((), jnp.int32)) if return_dropped else y


# moe_dispatch imports this module at its end, so these names are registered with either import order.
DISPATCH.update(gmm=gmm_dispatch, expert_parallel=expert_parallel_dispatch, auto=auto_dispatch)

"""impl="chunk_mosaic": `chunk.py`'s chunked algorithm with its serial passes as the Mosaic GPU
kernels of `mosaic_scan.py`, and the routing of the calls it takes (the kernels' forward for calls
that are not differentiated, per-shard calls under a mesh, logged fallbacks)."""

from __future__ import annotations

import functools
import logging

from kernels.kda import chunk
from kernels.kda.hopper import per_shard, unsupported_reason
from kernels.kda.hopper import device_kind as _device_kind

log = logging.getLogger(__name__)

_warned: set = set()
# Calls with a bounded gate (lower_bound >= -5) and no segment resets go through impl="pallas_gpu"
# with its bf16 intra kernel ("pallas_gpu"): calls that are not differentiated (evaluation,
# inference) run its all-kernel forward, on an H200 1.24x (8,4096,16,128) and 1.34x
# (4,4096,16,128) faster than this impl's own forward (benchmarks/results/kda-intrabf16-h200-
# 20261130T1551.json, as pallas_gpu:mosaic_bf16); under differentiation its custom VJP runs this
# impl's forward and backward (pallas_gpu train_forward="chunk"). "chunk": always this impl
# (`chunk.settings(forward_only="chunk")`).
FORWARD_ONLY = "pallas_gpu"
FORWARD_ONLY_CHOICES = ("pallas_gpu", "chunk")


def kda_impl(
    q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, output_final_state=True, interpret=None
):
    """impl="chunk_mosaic": `chunk.kda_impl` with both serial passes in these kernels, once per
    (batch, head) shard under a mesh (`hopper.per_shard`). Falls back to the XLA passes (logged
    once per reason) where the kernels do not apply. `interpret` None
    means the interpreter on a CPU-only machine, compiled kernels on a GPU."""
    if interpret is None:
        interpret = _device_kind() == "cpu"
    reason = unsupported_reason(q.shape[-1], v.shape[-1], q.dtype, interpret)
    if reason is not None and reason not in _warned:
        _warned.add(reason)
        log.warning("kda impl='chunk_mosaic' runs the XLA state passes: %s", reason)
    state_pass = "xla" if reason else ("mosaic_interpret" if interpret else "mosaic")

    def run(q, k, v, g, beta, initial_state, segment_ids):
        return chunk.kda_impl(q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                              lower_bound=lower_bound, output_final_state=output_final_state, state_pass=state_pass)

    if reason:  # plain XLA: the partitioner shards it like any other computation
        return run(q, k, v, g, beta, initial_state, segment_ids)
    if FORWARD_ONLY not in FORWARD_ONLY_CHOICES:
        raise ValueError(f"chunk_mosaic.FORWARD_ONLY={FORWARD_ONLY!r}; expected one of {FORWARD_ONLY_CHOICES}")
    from kernels.kda import pallas_gpu

    kernel_forward = pallas_gpu.resolve_intra("mosaic_bf16", lower_bound, segment_ids, q.dtype) == "mosaic_bf16"
    if FORWARD_ONLY == "pallas_gpu" and kernel_forward:
        run = functools.partial(pallas_gpu.run, scale=scale, intra="mosaic_bf16", interpret=interpret,
                                chunk_bounded=chunk.use_bounded_path(lower_bound, q.dtype), train_forward="chunk")
    return per_shard(run, q, k, v, g, beta, initial_state, segment_ids)

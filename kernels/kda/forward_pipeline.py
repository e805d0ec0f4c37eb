"""The forward-only Mosaic GPU call as a pipeline over pieces of the sequence, on two GPU streams.

The bounded forward is two launches: the intra-chunk kernel (`mosaic_intra_bf16`, one program per
(chunk, head), bound by each program's serial chain at two programs per SM) and the state pass
(`mosaic_state.state_output`, one program per (sequence-head, 64 V columns) walking the chunks in
order). One after the other, the state pass leaves most SMs idle wherever it has fewer programs
than the GPU has SMs (64 at 2,16384,16,128), and the intra kernel's latency-bound programs leave
bandwidth unused. With PIECES = p > 1 the chunks split into p runs of consecutive chunks:

    intra(0) | intra(1)          | intra(2)          | ... | intra(p-1)
             | state(0) from h0  | state(1) from (0) | ... | state(p-2) | state(p-1)

intra(i) on XLA's main stream, state(i) on a second one (`compute_on("gpu_stream:1")`), so that
state(i) runs beside intra(i + 1): the state pass of a piece needs only its own chunk operands and
the previous piece's final state (float32, exactly what the single pass carries in registers).
The intra kernel reads each piece's rows in place (`intra_bf16(chunks=...)`); each state pass
writes its piece of o, joined along T at the end (one copy of o). Outputs equal the single pass's.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax._src import core as jax_core
from jax.experimental.compute_on import compute_on
from jax.experimental.xla_metadata import set_xla_metadata

from kernels import lowering
from kernels.kda import mosaic_intra_bf16, mosaic_state

# Runs of chunks the forward-only bounded call pipelines (`chunk.settings(forward_pipeline=...)`,
# read while tracing); 1: the two launches one after the other.
PIECE_CHOICES = (1, 2, 3, 4, 6, 8)
PIECES = 1
STREAM = "gpu_stream:1"  # the state passes' stream


def pieces() -> int:
    """PIECES, checked (read while tracing)."""
    if PIECES not in PIECE_CHOICES:
        raise ValueError(f"forward_pipeline.PIECES={PIECES!r}; expected one of {PIECE_CHOICES}")
    return PIECES


def piece_bounds(NT: int, p: int) -> list[tuple[int, int]]:
    """(first chunk, count) of each of min(p, NT) runs covering NT chunks, the first ones a chunk
    longer where p does not divide NT."""
    p = min(p, NT)
    base, extra = divmod(NT, p)
    out, first = [], 0
    for i in range(p):
        count = base + (i < extra)
        out.append((first, count))
        first += count
    return out


def forward(q, k, v, g, beta_t, h0, *, scale, p, interpret=False):
    """o [B, Tp, H, V] (v's dtype) and the final state [B * H, K, V] float32 of the bounded
    forward-only call in p pieces. q, k, v, g, beta_t as `mosaic_intra_bf16.intra_bf16` takes them
    (Tp a multiple of 64); h0 [B * H, K, V] float32 or None (zeros)."""
    B, Tp, H, _ = q.shape
    NT = Tp // mosaic_state.C
    def state(ops, h, group):
        with lowering.inline():  # no jit of its own: XLA refuses annotated calls nested in the stream's
            if interpret:  # the interpreter runs on the CPU, whose compiler has no streams
                return mosaic_state.state_output(*ops, h, out_dtype=v.dtype, interpret=True, heads=H,
                                                 a_transposed=True)
            with set_xla_metadata(_xla_stream_annotation=STREAM.split(":")[1], **group):
                return mosaic_state.state_output(*ops, h, out_dtype=v.dtype, heads=H, a_transposed=True)

    intra = lambda chunks: mosaic_intra_bf16.intra_bf16(q, k, v, g, beta_t, scale=scale,  # noqa: E731
                                                        interpret=interpret, chunks=chunks)
    bounds = piece_bounds(NT, p)
    outs, h, ops = [], h0, intra(bounds[0])
    for i in range(len(bounds)):
        # state(i) and intra(i + 1) in one scheduling group: XLA overlaps their streams
        group = dict(_scheduling_group_id=str(i)) if i + 1 < len(bounds) else {}
        o, h = state(ops, h, group)
        if i + 1 < len(bounds):
            with set_xla_metadata(**group), lowering.inline():  # on the kernel's own custom call
                ops = intra(bounds[i + 1])
        outs.append(o)
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0], h


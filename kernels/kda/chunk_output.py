"""How a differentiated call's Mosaic forward forms the output o (`chunk.settings(forward_state=...)`).

"scan": the state pass `mosaic_scan.state_scan` writes the chunk states S_n and v', then `chunk.py`
forms o = qg S_n + Aqk v' as two XLA products whose float32 results XLA adds and transposes.
"output": `mosaic_state.state_output` (pallas_gpu's state kernel, which also writes S_n and v' for
the backward) forms o itself from qg and Aqk, one float32 accumulator per chunk rounded once to
the compute dtype. "output" applies to the delta rule's WY pass (elsewhere "scan" runs); with
segments (`chunk_segments.SEGMENTS`) the segments' pass 1 runs first and the kernel walks each
segment from its start. XLA ops of a forward+backward (`benchmarks/xla_bytes.py --deviceless`):
53.47 -> 50.92 GB at 1,65536,16,128 and 29.58 -> 28.31 at 8,4096,16,128, the forward kernel's operands 1.62 -> 2.28
and 0.83 -> 1.16 GB (it reads qg and Aqk and writes o;
xla-bytes-deviceless-forward-state-{t65536,8x4096}-20261205.json). Its chunk step runs three
products instead of two on the chain that bounds the pass. Timed at 1,65536,16,128 on an H100
(benchmarks/results/kda-t65536-stack-h100-20261205T1010.json): 21.66 against 21.77 ms forward +
backward, within one run's spread. Timed since together with the backward's two kernel-side
levers (`chunk_segments.GRAD_INTRA` says how and where): 4.5%-8.9% faster forward+backward at the
four benchmark shapes on an H100. "output" is the default.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.kda import chunk_segments
from kernels.kda.chunk_intra import to_chunks

FORWARD_STATE_CHOICES = ("scan", "output")
FORWARD_STATE = "output"


def output_pass(state_pass: str, delta: bool) -> bool:
    """Whether this forward runs `kernel_output` (an unknown FORWARD_STATE raises)."""
    if FORWARD_STATE not in FORWARD_STATE_CHOICES:
        raise ValueError(f"chunk_output.FORWARD_STATE={FORWARD_STATE!r}; expected one of {FORWARD_STATE_CHOICES}")
    return FORWARD_STATE == "output" and state_pass != "xla" and delta and chunk_segments.scan_form() == "wy"


def kernel_output(nm, P, w, u, h0, *, interpret: bool):
    """The forward's (o [N, B, H, C, V] state dtype, final state [B, H, K, V], states
    [N, B, H, K, V], v' [N, B, H, C, V] compute dtype) from `mosaic_state.state_output` on
    `chunk.py`'s pieces P (qg, kg, Aqk, decay), w, u [N, B, H, C, *] and h0 [B, H, K, V]; `nm`
    its numerics (`chunk._Numerics`). With `chunk_segments.SEGMENTS` > 1 the segments' starting
    states come first (`mosaic_scan.segment_starts`)."""
    from kernels.kda import mosaic_state  # Mosaic GPU is only imported when a kernel pass is asked for

    N, B, H, C, K = P["qg"].shape
    V = u.shape[-1]
    flat = lambda x: x.reshape(N, B * H, *x.shape[3:]).astype(nm.cd)  # noqa: E731
    decay = P["decay"].reshape(N, B * H, K).astype(jnp.float32)
    h0f = h0.reshape(B * H, K, V).astype(jnp.float32)
    s = chunk_segments.effective_segments(N, chunk_segments.SEGMENTS, chunk_segments.pass_programs(B * H, V))
    if s > 1:
        from kernels.kda import mosaic_scan

        h0f, final = mosaic_scan.segment_starts(flat(w), flat(u), flat(P["kg"]), decay, h0f, s, interpret=interpret)
    # W as it is (the kernel subtracts W S: no XLA pass negating it) and o straight into the
    # inputs' [B, T, H, V] layout: chunked below as the caller's un-chunking transposes it back,
    # XLA cancels the two transposes (one pass over o fewer than a chunk-major o).
    o, S, states, vn = mosaic_state.state_output(
        flat(P["qg"]), flat(w), flat(P["kg"]), flat(u), flat(P["Aqk"]), decay, h0f, out_dtype=nm.cd,
        interpret=interpret, with_states=True, with_vn=True, chunk_major=True, heads=H, w_negated=False, segments=s)
    o = to_chunks(o).astype(nm.sdt)  # [B, N C, H, V] -> [N, B, H, C, V]
    S = final if s > 1 else S
    unflat = lambda x: x.reshape(N, B, H, *x.shape[2:])  # noqa: E731
    return o, S.reshape(B, H, K, V).astype(h0.dtype), unflat(states), unflat(vn)

"""Segment-parallel serial passes of the chunked delta rule, for long sequences on few heads.

The forward pass S_{n+1} = A_n S_n + kg_n^T u_n (A_n = Diag(decay_n) - kg_n^T w_n) and the reverse
pass dS_n = A_n^T dS_{n+1} + (qg_n^T do_n - w_n^T dvi_n) walk the N chunks in order, one program
per (batch * head, BLOCK_V = 64 columns of V): at B * H = 16 and V = 128 that is 32 programs on a 132-SM
H200, each a chain of N steps (N = 1024 at T = 65536). With `segments` = s the chunks are cut into
s segments of L = N / s and each pass becomes:
  1. every segment at once from the identity: one pass of width K + V with [I | 0] in and zeros
     before the V columns of every input that carries V, giving [T_j | S_j]: the segment's
     transition T_j (a product of L A_n, or of their transposes) and its part from a zero start;
  2. a float32 scan over the s segments for each one's true starting state (forward
     S_in(j + 1) = T_j S_in(j) + S_j; reverse the same from the last segment back);
  3. every segment at once from its true start, for the per-chunk outputs.
The chain shrinks from N steps to 2 L over s times as many programs, for the width-(K + V) pass (it
writes only its final tiles). The Mosaic GPU passes index the segments themselves (program (segment,
batch * head) walks chunks segment * L ...); the XLA passes go through copies into segment-major
order (`per_segment`). Values: pass 3 rounds as the plain pass does;
only the segments' starting states differ, by the roundings of pass 1's bf16-cast states.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from kernels.kda.hopper import num_sms

log = logging.getLogger(__name__)

# Segments per serial pass (1: the plain pass; "auto": `auto_segments`). Set with
# `chunk.settings(segments=...)`; read while tracing. 8 segments timed slower at 1,65536,16,128
# (23.99 against 23.24 ms forward+backward, kda-segments-h200-20261202T0222.json), so it stays 1.
# Again with the Mosaic output pass in the training forward, on an H100: at 1,65536,16,128 4, 8
# ("auto") and 16 segments took 18.66-18.89 ms against 18.82 / 18.85 for one; at 2,16384,16,128
# "auto" (4) took 9.99 against 9.01 / 9.24 (kda-train-segments{,-t16384}-h100-20261206T05*.json).
SEGMENT_CHOICES = (1, 2, 4, 8, 16, 32, 64, "auto")
SEGMENTS = 1
# Segments of the forward-only call's state pass (`pallas_gpu`: pass 1 `mosaic_scan.state_scan`
# from [I | 0] on the intra kernel's operands, pass 3 `mosaic_state.state_output` forming o), the
# same choices, "auto" by `auto_forward_segments`. Set with `chunk.settings(forward_segments=...)`;
# read while tracing. Forward-only calls on an H100, 30 calls each: at 1,65536,16,128 (32 state
# programs) 16 segments took 3.32 ms against 3.89 / 4.05 for one (two runs of the same program in
# the one process), 8 to 32 segments with either state buffering 3.32-3.66; at 2,16384,16,128
# (64 programs) every segment count was slower, 1.74-2.07 against 1.61 / 1.75
# (kda-fwd-segments-h100-20261206T0540.json, kda-fwd-segments-t16384-h100-20261206T0542.json).
# "auto" (`auto_forward_segments`) is the default: 3.39 / 3.29 ms against 3.72 at 1,65536,16,128,
# one segment (the same program) at the three other shapes (kda-fwd-auto-h100-20261206T0549.json).
# With the kernels of 2026-12-07, forward device time at 1,65536,16,128 on an H100: 2 segments 2.68 ms, 4 2.25,
# 8 2.33, 16 (then "auto") 2.44 (kda-fwd-segments-t65536-h100-20261207T0849.json; 4 again 2.26 against
# 2.43 in kda-fwd-stream-segments-single-h100-20261207T0839.json), so "auto" now takes one program
# per SM (FORWARD_WAVES = 1: 4 segments there).
FORWARD_SEGMENTS = "auto"
# V columns per program of the Mosaic GPU passes (`mosaic_scan`; the XLA passes ignore it): at
# V = 128, 64 gives two chains per (batch * head), 32 four, 16 eight, each step a product of width
# BV. The other way besides segments to put more programs on the GPU when B * H is small. Set with
# `chunk.settings(block_v=...)`; read while tracing. "auto" (`auto_block_v`) takes the widest block
# that still gives every SM a program. Timed at 1,65536,16,128 (H200, forward+backward): 64 23.32 ms,
# 32 22.73, 16 23.47 (`kda-t65536-levers-h200-20261205T0233.json`); within runs' spread, 64 stays.
# Forward-only calls on an H100 (30 calls, `kda-fwd-blockv-h100-20261206T0605.json`): 2,16384,16,128
# 64 1.44 ms, 32 1.41, 16 2.12; 1,65536,16,128 (with its forward segments) 64 3.08, 32 3.44, 16 4.12.
# On an H200 (kda-fwd-stream-statebuf-h200-20261207T0609.json): 8,4096,16,128 64 0.86, 32 1.03;
# 2,16384,16,128 64 1.04, 32 1.03.
BLOCK_V_CHOICES = (64, 32, 16, "auto")
BLOCK_V = 64
# When the Mosaic reverse pass issues qg_n^T do_n, the one product of a step that does not wait on
# the carried dS: "in_order" (after dv'_n, beside w_n^T dv'_n) or "early" (first, so the tensor
# cores run it while dS is stored to SMEM; then only w_n^T dv'_n follows dv'_n). Same values. Set
# with `chunk.settings(grad_issue=...)`; read while tracing. Timed at 1,65536,16,128 with 16 columns:
# 23.58 ms against 23.47 in order, so "in_order" stays.
GRAD_ISSUES = ("in_order", "early")
GRAD_ISSUE = "in_order"
# Where the Mosaic reverse pass (delta rule, "wy" form) gets Aqk_n^T do_n, the part of dv'_n that
# does not depend on the carried dS: "input" (an XLA product written to HBM, read per chunk) or
# "kernel" (formed in the pass from Aqk_n and do_n, in dv'_n's accumulator beside kg_n dS: XLA's
# product and its [N, B, H, C, V] result go, the pass reads the [C, C] Aqk_n instead and rounds
# dv' once). XLA ops of a forward+backward at 8,4096,16,128 (`benchmarks/xla_bytes.py
# --deviceless`): 24.02 -> 23.69 GB, kernel operands 2.86 -> 2.79
# (xla-bytes-deviceless-grad-intra-8x4096-20261205.json). The three kernel-side levers together
# (this, `chunk_wy.WY_STATE` "kernel" and `chunk_output.FORWARD_STATE` "output") against none of
# them on an H100, forward+backward: 9.16 / 9.59 ms at 8,4096,16,128, 8.95 / 9.82 at
# 2,16384,16,128, 17.67 / 18.68 at 4,8192,32,128, 20.07 / 21.24 at 1,65536,16,128
# (kda-levers-fla-h100-20261206T0102.json, kda-levers-h100-20261206T010{5,6}.json; not timed one
# by one). "kernel" is the default. Set with `chunk.settings(grad_intra=...)`.
GRAD_INTRAS = ("input", "kernel")
GRAD_INTRA = "kernel"
# How the Mosaic delta-rule passes chain their steps: "wy" (`mosaic_scan`: v' = u - w S, then
# kg^T v', two dependent products a step) or "transition" (`mosaic_scan_transition`: one product
# with M = -kg^T w formed for all chunks first, v' and dv' formed from the states afterwards).
# Set with `chunk.settings(scan_form=...)`; read while tracing. Slower where it was meant to pay
# (1,65536,16,128: 24.97 ms forward+backward against 23.32), so "wy" stays.
SCAN_FORMS = ("wy", "transition")
SCAN_FORM = "wy"
# "auto" fills about two programs per SM of the plain pass's (batch * head, BLOCK_V columns) programs
# and keeps at least MIN_CHUNKS chunks per segment.
PROGRAMS_PER_SM = 2
MIN_CHUNKS = 16
_warned: set = set()


def block_v(value=None, programs64: int | None = None) -> int:
    """The Mosaic GPU passes' V columns per program: `value`, or BLOCK_V when None; checked.
    "auto" needs `programs64`, the pass's program count at 64 columns (`auto_block_v`)."""
    bv = BLOCK_V if value is None else value
    if bv not in BLOCK_V_CHOICES:
        raise ValueError(f"block_v={bv!r}; expected one of {BLOCK_V_CHOICES}")
    if bv == "auto":
        if programs64 is None:
            raise ValueError("block_v='auto' needs the pass's program count at 64 columns")
        return auto_block_v(programs64)
    return bv


def forward_segments():
    """FORWARD_SEGMENTS, checked (read while tracing)."""
    if FORWARD_SEGMENTS not in SEGMENT_CHOICES:
        raise ValueError(f"chunk_segments.FORWARD_SEGMENTS={FORWARD_SEGMENTS!r}; expected one of {SEGMENT_CHOICES}")
    return FORWARD_SEGMENTS


def grad_issue() -> str:
    """GRAD_ISSUE, checked (read while tracing)."""
    if GRAD_ISSUE not in GRAD_ISSUES:
        raise ValueError(f"chunk_segments.GRAD_ISSUE={GRAD_ISSUE!r}; expected one of {GRAD_ISSUES}")
    return GRAD_ISSUE


def grad_intra() -> str:
    """GRAD_INTRA, checked (read while tracing)."""
    if GRAD_INTRA not in GRAD_INTRAS:
        raise ValueError(f"chunk_segments.GRAD_INTRA={GRAD_INTRA!r}; expected one of {GRAD_INTRAS}")
    return GRAD_INTRA


def scan_form() -> str:
    """SCAN_FORM, checked (read while tracing)."""
    if SCAN_FORM not in SCAN_FORMS:
        raise ValueError(f"chunk_segments.SCAN_FORM={SCAN_FORM!r}; expected one of {SCAN_FORMS}")
    return SCAN_FORM


def pass_programs(BH: int, V: int) -> int:
    """Programs of a plain Mosaic pass over BH (batch * head) rows of V columns at BLOCK_V
    ("auto" resolved for them)."""
    return BH * max(1, V // block_v(programs64=BH * max(1, V // 64)))


def auto_block_v(programs64: int) -> int:
    """The widest of 64, 32, 16 columns whose programs (programs64 * 64 / width) cover every SM;
    16 when none does. At V = 128: 8 x 4096 x 16 heads keeps 64 (256 programs), 1 x 65536 x 16
    takes 16 (128 programs, from 32 at 64 columns)."""
    for bv in (64, 32):
        if programs64 * (64 // bv) >= _num_sms():
            return bv
    return 16


_num_sms = num_sms  # module seam the tests patch


def auto_segments(num_chunks: int, programs: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """The largest power of two s (up to 64) with programs * s <= per_sm * SMs and
    num_chunks / s >= MIN_CHUNKS; 1 when the plain pass already fills the GPU or is short."""
    s = 1
    while s < 64 and programs * 2 * s <= per_sm * _num_sms() and num_chunks // (2 * s) >= MIN_CHUNKS:
        s *= 2
    return s


# The forward-only state pass takes segments only when its plain programs fill at most a quarter of
# the SMs, and then up to FORWARD_WAVES programs per SM (the timings at FORWARD_SEGMENTS).
FORWARD_WAVES = 1


def auto_forward_segments(num_chunks: int, programs: int) -> int:
    """The forward-only state pass's "auto": 1 when its `programs` plain programs cover more than a
    quarter of the SMs, else the largest power of two s (up to 64) with programs * s <=
    FORWARD_WAVES * SMs and num_chunks / s >= MIN_CHUNKS. At V = 128 on 132 SMs: 1,65536,16,128
    (32 programs, 1024 chunks) 4; 2,16384,16,128 (64 programs) 1."""
    if 4 * programs > _num_sms():
        return 1
    return auto_segments(num_chunks, programs, per_sm=FORWARD_WAVES)


def effective_segments(num_chunks: int, segments, programs: int = 1, auto=auto_segments) -> int:
    """`segments` (one of SEGMENT_CHOICES; "auto" resolved by `auto(num_chunks, programs)` for
    `programs` plain-pass programs), halved until it divides the chunk count (logged once)."""
    if segments not in SEGMENT_CHOICES:
        raise ValueError(f"segments={segments!r}; expected one of {SEGMENT_CHOICES}")
    s = auto(num_chunks, programs) if segments == "auto" else segments
    while num_chunks % s:
        s //= 2
    if segments != "auto" and s != segments and (num_chunks, segments) not in _warned:
        _warned.add((num_chunks, segments))
        log.warning("KDA serial passes: %d chunks do not split into %d segments; using %d", num_chunks, segments, s)
    return s


def split(x, s: int):
    """[N, B, ...] -> [N / s, s * B, ...]: segment j's chunk l at [l, j * B + b] (None passes)."""
    if x is None:
        return None
    N, B = x.shape[:2]
    return x.reshape(s, N // s, B, *x.shape[2:]).swapaxes(0, 1).reshape(N // s, s * B, *x.shape[2:])


def join(x, s: int):
    """The inverse of `split`."""
    L, SB = x.shape[:2]
    return x.reshape(L, s, SB // s, *x.shape[2:]).swapaxes(0, 1).reshape(L * s, SB // s, *x.shape[2:])


def per_segment(scan, s: int, carried, *chunk_arrays):
    """`scan(carried, *chunk arrays)` run on every segment at once through copies into
    segment-major order (`split` / `join`): the segmented form of a plain pass without native
    segments (the XLA passes; the Mosaic GPU kernels index segments themselves). carried
    [s * B, H, K, V]; returns (per-chunk outputs in [N, B, ...] order, carried outputs [s * B, ...])."""
    a, b, last = scan(carried, *(split(x, s) for x in chunk_arrays))
    return join(a, s), join(b, s), last


def _identity_start(carry):
    """[B, H, K, V] -> [B, H, K, K + V] float32: [I | 0], the start that makes a pass return
    [transition | part from zero]."""
    B, H, K, V = carry.shape
    eye = jnp.broadcast_to(jnp.eye(K, dtype=carry.dtype), (B, H, K, K))
    return jnp.concatenate([eye, jnp.zeros((B, H, K, V), carry.dtype)], axis=-1)


def _widen(x, K: int):
    """Zeros before the last axis: the V-carrying inputs of the width-(K + V) pass."""
    return jnp.concatenate([jnp.zeros((*x.shape[:-1], K), x.dtype), x], axis=-1)


def _apply(T, S):
    return jnp.einsum("bhkm,bhmv->bhkv", T, S, precision=jax.lax.Precision.HIGHEST)


def segment_entries(pass1, h0, s: int):
    """Passes 1 and 2 for s segments: `pass1(start)` runs every segment from `start` = [I | 0]
    ([s * B, H, K, K + V], the V-carrying inputs widened by `_widen`) and returns its final tiles
    [T_j | S_j] (same shape); then the float32 scan over the segments. Returns (each segment's
    true starting state [s * B, H, K, V], the final state [B, H, K, V])."""
    B, H, K, V = h0.shape
    ends = pass1(_identity_start(jnp.zeros((s * B, H, K, V), h0.dtype))).reshape(s, B, H, K, K + V)

    def chain(S, seg):  # S: the state entering this segment
        return _apply(seg[..., :K], S) + seg[..., K:], S

    final, starts = jax.lax.scan(chain, h0, ends)
    return starts.reshape(s * B, H, K, V), final


def state_scan(scan, h0, w, u, kg, decay, segments: int):
    """The forward pass in segments. `scan(h0, w, u, kg, decay, final_only=False, segments=1) ->
    (states, v', final)` is the pass on chunk arrays ([N, B, H, ...]; `chunk._state_scan` with its
    numerics bound): with `segments` = s, h0 is [s * B, H, K, V] and each run of N / s chunks starts
    from its own row block (finals likewise); with final_only it may skip the per-chunk outputs,
    which pass 1 does not use. Returns the plain pass's triple."""
    B, H, K, V = h0.shape
    s = effective_segments(kg.shape[0], segments, pass_programs(B * H, V))
    if s == 1:
        return scan(h0, w, u, kg, decay)
    starts, final = segment_entries(
        lambda start: scan(start, w, _widen(u, K), kg, decay, final_only=True, segments=s)[2], h0, s)
    states, vn, _ = scan(starts, w, u, kg, decay, segments=s)
    return states, vn, final


def grad_scan(scan, dS_final, chunked, sources, segments: int):
    """The reverse pass in segments. `scan(dS_final, chunked, sources, final_only=False, segments=1)
    -> (dS per chunk, dv', dS initial)` is the pass on chunk arrays (final_only and segments as in
    `state_scan`); `chunked`: its inputs that do not carry V (None
    entries pass), `sources`: those that carry V in their last axis (they enter linearly: zeros
    before them make pass 1's [I | 0] columns a pure transition). Returns the same triple."""
    B, H, K, V = dS_final.shape
    s = effective_segments(next(x for x in chunked if x is not None).shape[0], segments, pass_programs(B * H, V))
    if s == 1:
        return scan(dS_final, chunked, sources)
    zero_end = jnp.zeros((s * B, H, K, V), dS_final.dtype)
    _, _, begins = scan(_identity_start(zero_end), chunked, tuple(_widen(x, K) for x in sources), final_only=True,
                        segments=s)
    begins = begins.reshape(s, B, H, K, K + V)

    def chain(dS, seg):  # dS: the gradient entering this segment from its end
        return _apply(seg[..., :K], dS) + seg[..., K:], dS

    dh0, ends = jax.lax.scan(chain, dS_final, begins, reverse=True)
    dhs, dvn, _ = scan(ends.reshape(s * B, H, K, V), chunked, sources, segments=s)
    return dhs, dvn, dh0

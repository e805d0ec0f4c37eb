"""impl="pallas_gpu": chunked KDA / Gated DeltaNet / DeltaNet with Mosaic GPU kernels (Hopper).

Forward, intra-chunk stage (decayed q k^T and k k^T, the unit-triangular inverse, w, u), by
`intra`: "chunk" (the default: `chunk.py`'s chunk-parallel XLA pieces, any gate, segment resets,
its all-matmul path when lower_bound >= -5), "xla" (`pallas_gpu_prep.prepare`, float32, exact
for any gate g <= 0 and with segment resets), or with `lower_bound >= -5` and no resets a
Mosaic GPU kernel on the tensor cores: "mosaic" (`mosaic_intra.intra_bounded`, split-bf16
products, one program per SM; slower than XLA on an H200) or "mosaic_bf16"
(`mosaic_intra_bf16.intra_bf16`: bf16 operands like flash-linear-attention's, ~110 KiB of SMEM
so two programs share an SM; on an H200 the fastest forward: 3.07 ms at (8, 4096, 16, 128)
against 3.42 for the default path, benchmarks/results/kda-intrabf16-h200-20261130T1551.json).
The inter-chunk stage (state
recurrence + output, the serial part) is a Mosaic GPU kernel (`mosaic_state.state_output`: TMA
double-buffering, three wgmma products per chunk, the state in f32 registers). The state
kernel's grid is (B*H, V/64) and it loops over chunks inside, so any T runs (1,048,576 tokens
and more; where B*H leaves most SMs idle the chunks run as segments from states that a first
pass forms, `chunk_segments.FORWARD_SEGMENTS`); the intra kernels' one program per (chunk, head) runs on one grid axis (CUDA's x, up
to 2^31 - 1 programs), not on y, whose 65535 would stop T at 4,194,240 tokens. B*H stays on y:
past 65535 sequence-heads the launch refuses with that reason.

Backward: impl="chunk"'s hand-written backward (`chunk._core_bwd`, on its bounded path when
lower_bound >= -5), whose reverse state pass, WY pull-back and (bounded gate, no resets) the
intra-chunk pieces' pull-back are Mosaic GPU kernels (`mosaic_scan`, `mosaic_wy_bwd`,
`mosaic_prep_bwd`); with train_forward="chunk" the forward keeps the pieces the backward reads
(`chunk.RESIDUALS`). The state kernel also
writes the incoming state of every chunk (bf16, O(T K V / 64) per head) and the backward runs
from those states, so the forward is not recomputed. With train_forward="chunk" (what
impl="chunk_mosaic" asks for) the forward under differentiation keeps the pieces: on the
bounded path without resets the bf16 intra kernel writes them beside the state kernel's operands
(`TRAIN_INTRA`), elsewhere chunk's own forward forms them in XLA (see TRAIN_FORWARDS); calls that
are not differentiated run the kernels' forward. Without `kernels.kda.chunk`, the backward recomputes
through this module's float32 plain-JAX chunked path (`prepare` + `scan_state_output`) under
`jax.vjp`.

Decode: `kda_step_impl` runs `mosaic_decode.decode_step_pipelined` (state read once, written
once; persistent programs keep several tile loads in flight).

Supported by the kernels: K, V in {64, 128}; bf16/fp16 q, k, v on a Hopper GPU (float32 gates,
states and accumulation). Anything else falls back to impl="chunk" with a logged reason.
On a machine without a GPU, `impl="pallas_gpu"` (explicitly requested, e.g. by tests) runs the
same kernels under the Mosaic GPU interpreter, where float32 inputs are also accepted.

Sharding: under a mesh (`jax.set_mesh`), inputs are split over the batch axes and the head
axis named by `kimi_jax.sharding`'s act_batch / act_heads rules and the kernels run per shard
inside `jax.shard_map` (XLA cannot partition a custom call). Sequence sharding is not supported.
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp

from kernels.kda import chunk_segments, hopper, mosaic_decode, mosaic_intra, mosaic_intra_bf16, mosaic_state
from kernels.kda.hopper import device_kind as _device_kind, per_shard
from kernels.kda.pallas_gpu_prep import chunked_reference, prepare

log = logging.getLogger(__name__)

BOUNDED_GATE = -5.0  # lower_bound at or above this may take the Mosaic GPU intra-chunk kernel
INTRA_STAGES = ("xla", "chunk", "mosaic", "mosaic_bf16")
# Measured on one H200 at (8, 4096, 16, 128) bf16, lower_bound=-5: chunk.py's intra pieces beat
# this module's exact XLA stage (6.0 ms) and the split-bf16 Mosaic GPU intra kernel (about 9 ms).
# The lean "mosaic_bf16" kernel gives the fastest forward (3.07 ms against 3.42), but its
# forward+backward (13.40 ms against 10.98) pays for a backward that recomputes chunk's XLA
# intra pieces alone; impl="chunk_mosaic" pairs it with train_forward="chunk" instead.
DEFAULT_INTRA = "chunk"
# The backward's reverse state pass: "mosaic" takes chunk's Mosaic GPU serial-pass kernels when
# `kernels.kda.chunk` offers them (its STATE_PASSES), "xla" its lax.scan.
BACKWARD_STATE_PASS = "mosaic"
_warned: set = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("kda impl='pallas_gpu' falls back to 'chunk': %s", reason)


def unsupported_reason(K: int, V: int, dtype, interpret: bool) -> str | None:
    """Why the kernels cannot take this call (None when they can); see `kernels.kda.hopper`."""
    return hopper.unsupported_reason(K, V, dtype, interpret, _device_kind())


def _fallback_impl():
    """The chunk impl, or this module's plain-JAX chunked path if `kernels.kda.chunk` is absent."""
    try:
        return importlib.import_module("kernels.kda.chunk").kda_impl
    except ImportError:
        return _plain_kda_impl


def _plain_kda_impl(q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, output_final_state=True):
    del lower_bound, output_final_state
    o, S = chunked_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids)
    return o.astype(v.dtype), S


def _exact_operands(q, k, v, g, beta, seg, scale, dt):
    """State-kernel operands from the exact XLA intra-chunk stage (any gate, segment resets)."""
    B, _, H, _ = q.shape
    p = prepare(q, k, v, g, beta, scale=scale, segment_ids=seg)
    NT = p["qg"].shape[2]
    flat = lambda x: x.reshape(B * H, NT, *x.shape[3:])
    op = lambda x: flat(x).astype(dt)
    return op(p["qg"]), op(-p["w"]), op(p["kg"]), op(p["u"]), op(p["a"]), flat(p["d"])


def _bounded_operands(q, k, v, g, beta, scale, interpret, kernel="mosaic", pieces=False):
    """State-kernel operands from a Mosaic GPU intra-chunk kernel (g >= -5, no resets):
    `mosaic_intra.intra_bounded` ("mosaic") or the lean `mosaic_intra_bf16.intra_bf16` (with
    `pieces`, its training form: chunk-major, and the backward's pieces after the operands)."""
    B, T, H, K = q.shape
    C = mosaic_state.C
    NT = -(-T // C)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, NT * C - T)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = (pad(x) for x in (q, k, v, g, beta))
    if kernel == "mosaic_bf16":  # the kernel takes the gates themselves and returns the chunk decays
        return mosaic_intra_bf16.intra_bf16(q, k, v, g, jnp.moveaxis(beta, 1, 2), scale=scale, interpret=interpret,
                                            pieces=pieces)
    G = jnp.cumsum(g.reshape(B, NT, C, H, K), axis=2)
    d = jnp.moveaxis(jnp.exp(G[:, :, -1]), 2, 1).reshape(B * H, NT, K)
    G = G.reshape(B, NT * C, H, K)
    outs = mosaic_intra.intra_bounded(q, k, v, G, jnp.moveaxis(beta, 1, 2), scale=scale, interpret=interpret)
    return (*outs, d)


def _chunked_inputs(q, k, v, g, beta, seg):
    """`chunk.py`'s layout: (q, k, v, g, beta as [N, B, H, C, ...], padded with zeros to a
    multiple of 64 tokens, and the segment counts [N, B, 1, C] or None)."""
    from kernels.kda.chunk_intra import CHUNK, segment_counts, to_chunks
    from kernels.kda.validate import segment_starts, state_dtype

    T = q.shape[1]
    sdt = state_dtype(q.dtype)
    pad = -(-T // CHUNK) * CHUNK - T

    def chunked(x, dtype):
        x = x.astype(dtype)
        return to_chunks(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x)

    starts = segment_starts(seg, T)
    counts = None if starts is None else segment_counts(jnp.pad(starts, [(0, 0), (0, pad)]))
    args = (chunked(q, q.dtype), chunked(k, q.dtype), chunked(v, q.dtype), chunked(g, sdt), chunked(beta, sdt))
    return args, counts, chunked


def _chunk_operands(q, k, v, g, beta, seg, scale, chunk_bounded, dt):
    """State-kernel operands ([N, BH, ...], chunk-major; W itself, not -W) from `chunk.py`'s XLA intra-chunk pieces
    (its prep and WY factors: any gate, segment resets, its bounded all-matmul path when
    `chunk_bounded`)."""
    ck = _chunk_module()
    B, _, H, _ = q.shape
    nm = ck._Numerics(q.dtype)
    args, counts, _ = _chunked_inputs(q, k, v, g, beta, seg)
    P = ck._prep(nm, *args, counts, scale, chunk_bounded, True, ck.default_scores())
    _, w, u = ck._wy(nm, P)
    flat = lambda x: x.reshape(x.shape[0], B * H, *x.shape[3:])
    op = lambda x: flat(x).astype(dt)
    return op(P["qg"]), op(w), op(P["kg"]), op(u), op(P["Aqk"]), flat(P["decay"]).astype(jnp.float32)


def resolve_intra(intra, lower_bound, segment_ids, dtype) -> str:
    """The intra-chunk stage that runs: `intra` (default DEFAULT_INTRA) when it can take the call.
    The Mosaic GPU kernels ("mosaic", "mosaic_bf16") need a bounded gate (lower_bound >= -5), no
    segment resets and q in bf16 or float32 (their anchored factors, up to e^75, overflow
    float16); otherwise, and for "chunk" without `kernels.kda.chunk`, the XLA stages take over
    ("chunk" when available, else "xla")."""
    intra = DEFAULT_INTRA if intra is None else intra
    if intra not in INTRA_STAGES:
        raise ValueError(f"Unknown intra={intra!r}; expected one of {list(INTRA_STAGES)}")
    bounded = lower_bound is not None and float(lower_bound) >= BOUNDED_GATE
    xla = "chunk" if _chunk_module() is not None else "xla"
    if intra in ("mosaic", "mosaic_bf16"):
        fits = bounded and segment_ids is None and jnp.dtype(dtype) != jnp.float16
        return intra if fits else xla
    return xla if intra == "chunk" else intra


def _kernel_forward(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret, with_states=False,
                    pieces=False):
    """Chunk operands (the intra-chunk stage named by `intra`), then the Mosaic GPU state kernel:
    (o [B,T,H,V], S [B,H,K,V]) and with `with_states` the incoming state of every chunk
    [NT, B, H, K, V] (operand dtype). `pieces` (intra "mosaic_bf16" only): (o, S, states, v'
    [NT, B, H, C, V], the pieces `chunk._core_bwd` reads, as `mosaic_intra_bf16` writes them)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype if jnp.dtype(q.dtype).itemsize == 2 else jnp.float32
    if pieces and intra != "mosaic_bf16":
        raise ValueError(f"the training pieces come from intra='mosaic_bf16', not {intra!r}")
    extra = ()
    if intra in ("mosaic", "mosaic_bf16"):
        ops = _bounded_operands(q.astype(dt), k.astype(dt), v.astype(dt), g, beta, scale, interpret, intra, pieces)
        ops, extra = ops[:6], ops[6:]
    elif intra == "chunk":
        ops = _chunk_operands(q, k, v, g, beta, seg, scale, chunk_bounded, dt)
    else:
        ops = _exact_operands(q, k, v, g, beta, seg, scale, dt)
    chunk_major = intra == "chunk" or pieces
    w_negated = intra != "chunk" and not pieces
    with_states = with_states or pieces
    NT = ops[0].shape[0 if chunk_major else 1]
    h0 = None if h0 is None else h0.reshape(B * H, K, V)  # None: zeros, formed in the state kernel
    asked = chunk_segments.forward_segments()
    segments = chunk_segments.effective_segments(NT, asked, chunk_segments.pass_programs(B * H, V),
                                                 auto=chunk_segments.auto_forward_segments)
    if segments > 1 and jnp.dtype(dt).itemsize != 2 and not interpret:  # pass 1's kernel takes bf16 / fp16
        if asked != "auto" and "forward_segments" not in _warned:
            _warned.add("forward_segments")
            log.warning("KDA forward segments: pass 1 takes bf16 / fp16 operands, not %s; one segment",
                        jnp.dtype(dt).name)
        segments = 1
    if segments > 1:  # each segment's starting state first, then o from it
        from kernels.kda import mosaic_scan

        _, wn, kg, u, _, d = ops
        h0 = jnp.zeros((B * H, K, V), jnp.float32) if h0 is None else h0
        h0, final = mosaic_scan.segment_starts(wn, u, kg, d, h0, segments, interpret=interpret,
                                               chunk_major=chunk_major, w_negated=w_negated)
    out = mosaic_state.state_output(*ops, h0, out_dtype=v.dtype, interpret=interpret,
                                    with_states=with_states, heads=H, chunk_major=chunk_major,
                                    a_transposed=intra == "mosaic_bf16", w_negated=w_negated,
                                    segments=segments, with_vn=pieces)
    o, S = out[:2]
    S = final if segments > 1 else S
    res = (o[:, :T], S.reshape(B, H, K, V))
    chunks = lambda x: x.reshape(NT, B, H, *x.shape[2:])  # noqa: E731 - [NT, BH, ...] -> chunk.py's
    res += (chunks(out[2]),) if with_states else ()
    if pieces:
        qg, w, kg, _, a_t, d = ops
        kept = dict(qg=qg, w=w, kg=kg, decay=d, AqkT=a_t, AiT=extra[0], kexp=extra[1])
        res += (chunks(out[3]), {key: chunks(x) for key, x in kept.items()})
    return res


# The forward that runs under differentiation (`train_forward`): "kernels", the primal's own
# kernels writing every chunk's state; or "chunk", `chunk.py`'s forward with its Mosaic serial
# pass (what impl="chunk_mosaic" runs): its XLA intra pieces equal the ones the backward
# recomputes, so XLA computes them once and the training step costs what chunk_mosaic's does,
# while calls that are not differentiated keep the faster kernel forward.
TRAIN_FORWARDS = ("kernels", "chunk")
# With train_forward="chunk", who forms the intra-chunk pieces that the forward keeps for the
# backward (`chunk.settings(train_intra=...)`): "kernel" (the bf16 intra kernel,
# `mosaic_intra_bf16.intra_bf16(pieces=True)`, writing Aqk^T, Ai^T and k exp(G) beside the
# state kernel's operands, chunk-major) wherever the call takes intra "mosaic_bf16" and
# `chunk.kept_pieces` holds and the state kernel forms o (`chunk_output.output_pass`); "xla"
# (`chunk.py`'s XLA pieces, as before).
TRAIN_INTRA_CHOICES = ("kernel", "xla")
TRAIN_INTRA = "kernel"


def train_intra_kernel(ck, dtype, K, intra, chunk_bounded, state_pass) -> bool:
    """Whether a differentiated call's forward takes its pieces from the intra kernel (TRAIN_INTRA)."""
    if TRAIN_INTRA not in TRAIN_INTRA_CHOICES:
        raise ValueError(f"pallas_gpu.TRAIN_INTRA={TRAIN_INTRA!r}; expected one of {TRAIN_INTRA_CHOICES}")
    from kernels.kda import chunk_output

    return (TRAIN_INTRA == "kernel" and intra == "mosaic_bf16" and chunk_bounded
            and ck.kept_pieces(dtype, K, chunk_bounded, True, None, state_pass)
            and chunk_output.output_pass(state_pass, True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _kda(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret, train_forward):
    return _kernel_forward(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret)


def _chunk_module():
    try:
        return importlib.import_module("kernels.kda.chunk")
    except ImportError:
        return None


def _core_defaults(ck, interpret=False) -> tuple:
    """`chunk.chunk_core`'s static arguments after (scale, bounded, delta), which its backward
    `_core_bwd` takes before (res, cts): their defaults, except that the serial pass
    (`state_pass`) runs on chunk's Mosaic GPU kernels when chunk offers them and
    BACKWARD_STATE_PASS asks for them, and the score formulation is chunk's current one
    (`chunk.settings(scores=...)`, read while tracing)."""
    import inspect

    params = list(inspect.signature(ck.chunk_core).parameters.values())
    names = [p.name for p in params]
    out = []
    for p in params[names.index("delta") + 1 :]:
        value = p.default
        if p.name == "state_pass" and BACKWARD_STATE_PASS == "mosaic":
            want = "mosaic_interpret" if interpret else "mosaic"
            value = want if want in getattr(ck, "STATE_PASSES", ()) else value
        if p.name == "scores":
            value = ck.default_scores()
        out.append(value)
    return tuple(out)


def _kda_fwd(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret, train_forward):
    ck = _chunk_module()
    if ck is None:
        o, S = _kernel_forward(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret)
        return (o, S), (q, k, v, g, beta, h0, seg, None, None, None)
    pieces = ()
    defaults = _core_defaults(ck, interpret)
    if train_forward == "chunk" and train_intra_kernel(ck, q.dtype, q.shape[-1], intra, chunk_bounded, defaults[0]):
        o, S, states, vn, kept = _kernel_forward(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret,
                                                 pieces=True)
        pieces = (kept,)
    elif train_forward == "chunk":
        from kernels.kda.chunk_intra import from_chunks

        args, counts, _ = _chunked_inputs(q, k, v, g, beta, seg)
        keep = ck.kept_pieces(q.dtype, q.shape[-1], chunk_bounded, True, counts, defaults[0])
        h0z = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32) if h0 is None else h0
        o, S, states, vn, *pieces = ck._forward(*args, h0z, counts, scale, chunk_bounded, True, *defaults, keep=keep)
        o = from_chunks(o)[:, : q.shape[1]].astype(v.dtype)
    else:  # the kernels do not write v': the backward recomputes it
        o, S, states = _kernel_forward(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret,
                                       with_states=True)
        vn = None
    # Named: saved, not recomputed, by a remat policy that keeps the names (kimi_jax.remat's dots16).
    states, vn, pieces = ck.named_residuals(states, vn, vn is not None, *pieces)
    return (o, S), (q, k, v, g, beta, h0, seg, states, vn, pieces)


def _kda_bwd(scale, intra, chunk_bounded, interpret, train_forward, res, cts):
    """impl="chunk"'s hand-written backward (`chunk._core_bwd`) fed with the per-chunk states
    that the forward kernel wrote, so no forward pass is recomputed; its bounded intra path
    when `chunk_bounded` (lower_bound >= -5). Without `kernels.kda.chunk`: recompute through this
    module's float32 plain-JAX path under `jax.vjp`."""
    del intra, train_forward
    q, k, v, g, beta, h0, seg, states, vn, pieces = res
    do, dS = cts
    ck = _chunk_module()
    if ck is None:
        def f(q, k, v, g, beta, h0):
            return _plain_kda_impl(q, k, v, g, beta, scale=scale, initial_state=h0, segment_ids=seg)

        (o, _), pull = jax.vjp(f, q, k, v, g, beta, h0)
        return (*pull((do.astype(o.dtype), dS.astype(jnp.float32))), None)
    from kernels.kda.chunk_intra import from_chunks
    from kernels.kda.validate import state_dtype

    T = q.shape[1]
    sdt = state_dtype(q.dtype)
    args, counts, chunked = _chunked_inputs(q, k, v, g, beta, seg)
    static = (scale, chunk_bounded, True, *_core_defaults(ck, interpret))
    grads = ck._core_bwd(*static, (*args, counts, states.astype(q.dtype), vn, pieces),
                         (chunked(do, sdt), dS.astype(sdt)))
    dq, dk, dv, dg, dbeta = (from_chunks(x)[:, :T] for x in grads[:5])
    dh0 = grads[5]
    cast = lambda x, ref: x.astype(ref.dtype)
    dh0 = None if h0 is None else cast(dh0, h0)  # no initial state: no cotangent for it
    return cast(dq, q), cast(dk, k), cast(dv, v), cast(dg, g), cast(dbeta, beta), dh0, None


_kda.defvjp(_kda_fwd, _kda_bwd)


def run(q, k, v, g, beta, h0, seg, *, scale, intra, interpret, chunk_bounded=False, train_forward="kernels"):
    """The kernels on one shard's canonical-form inputs (`intra` a resolved stage, see
    `resolve_intra`; `train_forward` in TRAIN_FORWARDS) -> (o [B, T, H, V], S [B, H, K, V])."""
    if train_forward not in TRAIN_FORWARDS:
        raise ValueError(f"train_forward={train_forward!r}; expected one of {TRAIN_FORWARDS}")
    # No initial state stays None: the state kernel starts from zeros in registers (no XLA op
    # writes a [B, H, K, V] zero state for it to read); the training forward forms zeros itself.
    h0 = None if h0 is None else h0.astype(jnp.float32)
    return _kda(q, k, v, g, beta, h0, seg, scale, intra, chunk_bounded, interpret, train_forward)


def kda_impl(
    q, k, v, g, beta, *, scale, initial_state, segment_ids, lower_bound=None, output_final_state=True, interpret=None,
    intra=None,
):
    """Canonical-form KDA on Mosaic GPU kernels; see `kernels.kda.kda` for the contract.

    `intra` picks the intra-chunk stage (see `resolve_intra`): "chunk" (default), "xla", or
    with `lower_bound` >= -5 (the caller guarantees g >= lower_bound) and no segment resets an
    all-tensor-core Mosaic GPU kernel, "mosaic" (split-bf16 products) or "mosaic_bf16"
    (bf16 operands, two programs per SM).
    `interpret` None means: the Mosaic GPU interpreter on a CPU-only machine, compiled on a GPU.
    """
    del output_final_state
    if interpret is None:
        interpret = _device_kind() == "cpu"
    reason = unsupported_reason(q.shape[-1], v.shape[-1], q.dtype, interpret)
    if reason is not None:
        _warn_once(reason)
        return _fallback_impl()(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids, lower_bound=lower_bound
        )
    stage = resolve_intra(intra, lower_bound, segment_ids, q.dtype)
    run_shard = functools.partial(run, scale=scale, intra=stage, interpret=interpret)
    ck = _chunk_module()
    if ck is not None and ck.use_bounded_path(lower_bound, q.dtype):
        run_shard = functools.partial(run_shard, chunk_bounded=True)
    return per_shard(run_shard, q, k, v, g, beta, initial_state, segment_ids)


def kda_step_impl(state, q, k, v, g, beta, scale, *, interpret=None):
    """One decoding step on the Mosaic GPU decode kernel.

    state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V]; beta [B, H] (all float; g, beta
    canonical as in `kernels.kda.kda_step`). Returns (o [B, H, V] in v's dtype for bf16 / f32 v,
    else float32; new state float32).
    Unsupported shapes or devices fall back to the plain-JAX step with a logged reason.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    if interpret is None:
        interpret = _device_kind() == "cpu"
    reason = unsupported_reason(K, V, jnp.bfloat16, interpret)
    f32 = lambda x: x.astype(jnp.float32)
    if reason is not None:
        _warn_once(f"kda_step: {reason}")
        from kernels.kda.naive import delta_step

        return delta_step(f32(state), f32(q), f32(k), f32(v), f32(g), f32(beta), scale)
    vecs = jnp.stack([f32(g), f32(k), f32(beta)[..., None] * f32(k), f32(q) * scale], axis=2)
    # v goes in and o comes out in v's dtype when the kernel takes it (bf16, f32): no conversion
    # kernels around the step (a decode step is short enough for each launch to show).
    io = v.dtype if v.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else jnp.dtype(jnp.float32)
    o, S = mosaic_decode.decode_step_pipelined(
        f32(state).reshape(B * H, K, V), vecs.reshape(B * H, 4, K), v.astype(io).reshape(B * H, V), o_dtype=io,
        interpret=interpret,
    )
    return o.reshape(B, H, V), S.reshape(B, H, K, V)

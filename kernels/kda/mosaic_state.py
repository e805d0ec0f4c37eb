"""Mosaic GPU kernel for the inter-chunk stage of chunked KDA: state recurrence + output.

One program per (batch*head, V-block of BV = `chunk_segments.BLOCK_V` columns, 64 by default)
walks the chunks in order with the state S [K, BV] in float32 registers (a wgmma accumulator).
Per chunk n, with the chunk tensors of `pallas_gpu_prep.prepare` (C = 64 rows):

    V' = U_n + Wneg_n S                     [C, BV]   (Wneg = -W; or U_n - W_n S from W itself)
    O_n = QG_n S + A_n V'                   [C, BV]   (scale folded into QG and A)
    S  <- Diag(d_n) S + KG_n^T V'           [K, BV]

All three products run on the tensor cores (wgmma, operands in SMEM, f32 accumulation).
The chunk tensors stream in by TMA, double-buffered: chunk n+1 loads while chunk n computes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import profiling
from kernels.kda import chunk_segments
from kernels.kda.hopper import num_sms
from kernels.lowering import lowered_once

C = 64  # chunk length (rows of every wgmma's M side except the state update)


# CUDA caps a grid's y and z axes at 65535 blocks (x at 2^31 - 1): a grid over the chunks on y
# would stop at 65535 chunks (4,194,240 tokens). Kernels with a program per chunk use one x axis.
MAX_PROGRAMS = 2**31 - 1
MAX_Y = 65535

# How `state_output` buffers its chunk operands (`chunk.settings(state_buffers=...)`; read while
# tracing): "double" (every operand double-buffered, chunk n + 1 loading while n computes: 193 KiB
# of SMEM at K = 128, BV = 64 in bf16, one program per SM) or "single" (only W and the decay
# double-buffered, the first operands a step reads; qg, kg, A and u single-buffered and loaded once
# the step's products have read them, the final state's tile over qg and kg, o's over v': 105 KiB,
# two programs per SM, so 256 programs run as one wave instead of two). On an H100 "single" was
# slower forward at 2,16384,16,128 and 4,8192,32,128 (1.78 / 2.92 ms against 1.56 / 2.69,
# kda-levers-both-h100-20261206T0529.json); on an H200 0.84 against 0.86 ms at 8,4096,16,128 and
# 1.15 against 1.04 at 2,16384,16,128 (kda-fwd-stream-statebuf-h200-20261207T0609.json): "double" stays.
BUFFERS_CHOICES = ("double", "single")
BUFFERS = "double"


def buffers() -> str:
    """BUFFERS, checked (read while tracing)."""
    if BUFFERS not in BUFFERS_CHOICES:
        raise ValueError(f"mosaic_state.BUFFERS={BUFFERS!r}; expected one of {BUFFERS_CHOICES}")
    return BUFFERS


# How a pass with no per-chunk outputs (the forward-only call's; `chunk.settings(state_chain=...)`,
# read while tracing) carries its state from chunk to chunk: "smem" (`_body`: S and v' stored to
# SMEM and fenced before the products that read them) or "regs" (`mosaic_state_regs`: S^T and v'^T
# as wgmma's register operands, no store or fence on the chain; 64 V columns per program, double
# buffers). "auto": "regs" where it applies (BV = 64, BUFFERS "double") and the pass has no more
# programs than the GPU has SMs, so each walks its chunks alone on an SM and the chain's latency is
# the pass's time; "smem" past that, where the passes overlap and bandwidth bounds them. The state
# pass alone on an H100 (`state-pass-chain-h100-20261207T1305.json`), smem / regs, us per chunk
# step: 1.66 / 1.52 at 2,16384,16,128 (64 programs); 4.11 / 4.21 at 8,4096,16,128 and 3.94 / 4.00
# at 4,8192,32,128 (256 and 512). Passes that write the chunk states or v' (a training forward's)
# run "smem" whatever this says.
CHAIN_CHOICES = ("auto", "smem", "regs")
CHAIN = "auto"


def chain(BV: int, per_chunk_outputs: bool, programs: int | None = None) -> str:
    """The form CHAIN gives a pass of BV columns per program and `programs` programs (see CHAIN;
    "auto" needs the count); raises where "regs" is asked for a pass it cannot run."""
    if CHAIN not in CHAIN_CHOICES:
        raise ValueError(f"mosaic_state.CHAIN={CHAIN!r}; expected one of {CHAIN_CHOICES}")
    if per_chunk_outputs or CHAIN == "smem":
        return "smem"
    fits = BV == 64 and buffers() == "double"
    if CHAIN == "regs":
        if not fits:
            raise ValueError(f"state_chain='regs' runs 64 V columns per program with double buffers; this pass has "
                             f"BV={BV}, state_buffers={buffers()!r} (use state_chain='auto' or 'smem')")
        return "regs"
    if programs is None:
        raise ValueError("state_chain='auto' needs the pass's program count")
    return "regs" if fits and programs <= _num_sms() else "smem"


_num_sms = num_sms  # module seam the tests patch


def launch_bh_v(body, out_type, scratch, args, *, BH, V, BV, interpret):
    """One program per (batch*head, V-block of BV): the chunk-walking kernels and the decode step.
    The body runs in one named scope (its function's name: a profiler range, `kernels.profiling`).
    batch*head is CUDA's y axis (the V blocks of one head launch side by side, sharing its K-wide
    inputs in L2), so it is capped at 65535."""
    if BH > MAX_Y:
        raise ValueError(f"{BH} (batch * head) programs exceed CUDA's {MAX_Y} on a grid's y axis; run the "
                         f"batch in parts of at most {MAX_Y} sequence-heads each")
    fn = body.func if isinstance(body, functools.partial) else body
    name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__.strip('_')}"  # e.g. "mosaic_scan.fwd_body"

    def scoped(*refs):
        with jax.named_scope(name):
            body(*refs)

    return plgpu.kernel(
        scoped,
        out_type=out_type,
        scratch_types=scratch,
        grid=(BH, V // BV),
        grid_names=("bh", "v"),
        kernel_name="kda_" + name.replace(".", "_"),  # e.g. "kda_mosaic_scan_fwd_body" in profiles
        compiler_params=profiling.compiler_params(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args)


def flat_grid(sizes: tuple[int, ...]) -> dict:
    """`plgpu.kernel` grid arguments for prod(sizes) programs on one axis ("t"); read the per-axis
    indices back with `grid_indices(sizes)`."""
    total = 1
    for size in sizes:
        total *= int(size)
    if total > MAX_PROGRAMS:
        raise ValueError(f"{total} programs ({' x '.join(map(str, sizes))}) exceed CUDA's {MAX_PROGRAMS} per grid")
    return dict(grid=(total,), grid_names=("t",))


def grid_indices(sizes: tuple[int, ...]) -> tuple:
    """This program's index along each of `sizes` in a `flat_grid(sizes)`, the last one fastest
    (the launch order a multi-axis grid has: its last axis is CUDA's x)."""
    t, out = lax.axis_index("t"), []
    for size in reversed(sizes[1:]):
        out.append(lax.rem(t, size))
        t = lax.div(t, size)
    return (t, *reversed(out))


def load_carried(first, issue, src, smem, bar, carried_first=False):
    """Start a double-buffered chunk loop: issue chunk `first`'s loads into slot 0, then bring the
    carried [K, BV] float32 tile `src` (HBM) into registers through `smem`. `carried_first`: the
    tile is read (by every warp) before the loads are issued, so `smem` may share memory with an
    input's buffers."""
    if not carried_first:
        issue(first, 0)
    plgpu.copy_gmem_to_smem(src, smem, bar)
    plgpu.barrier_wait(bar)
    x = plgpu.load(smem, layout=plgpu.Layout.WGMMA)
    if carried_first:
        plgpu.commit_smem()  # every warp has read smem before TMA writes over it
        issue(first, 0)
    return x


def check_segments(N, segments, carried, BH):
    """A pass over N chunks in `segments` runs needs N divisible by them and a carried tile per
    segment and batch * head ([segments * BH, K, V])."""
    if segments < 1 or N % segments or carried.shape[0] != segments * BH:
        raise ValueError(f"{segments} segments need N={N} divisible by them and a carried tile per segment "
                         f"and batch * head: [{segments * BH}, K, V], got {carried.shape}")


def smem_transforms(minor: int, dtype) -> tuple:
    """Tiling + swizzle for a 2D SMEM tile used as a wgmma operand or TMA target."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _smem(shape, dtype, BV=None):
    """A swizzled SMEM tile; with `BV`, swizzled as a BV-wide tile is (wgmma takes both SMEM
    operands with one swizzle, so narrow V blocks narrow every operand's swizzle)."""
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(min(shape[-1], BV or shape[-1]), dtype))


def _mm(fn, shape):
    """Run `fn(acc)` on a fresh zeroed f32 wgmma accumulator of `shape`; return its value."""
    return pl.run_scoped(fn, plgpu.ACC(shape, jnp.float32))


def _body(qg_ref, wn_ref, kg_ref, u_ref, a_ref, d_ref, *rest, NT, K, BV, dt, with_states, heads,
          chunk_major, a_transposed, with_vn=False, w_negated=True, single=False, BH=None, zero_h0=False):
    h0_ref, rest = (None, rest) if zero_h0 else (rest[0], rest[1:])
    o_ref, ht_ref, *rest = rest
    st_ref, rest = (rest[0], rest[1:]) if with_states else (None, rest)
    vn_ref, rest = (rest[0], rest[1:]) if with_vn else (None, rest)
    if single:  # BUFFERS "single": the scratch `_state_output` lays out
        wn_s, d_s, (h_s, (qg_s, kg_s)), a_s, u_s, s_s, (vn_s, o_s), bars, sbars, h_bar = rest
    else:
        qg_s, wn_s, kg_s, u_s, a_s, d_s, s_s, vn_s, o_s, h_s, bars, h_bar = rest
    p = lax.axis_index("bh")  # (segment, batch * head): segment p // BH runs chunks first .. first + NT - 1
    bh, first = lax.rem(p, BH), lax.div(p, BH) * NT
    vs = pl.ds(pl.multiple_of(lax.axis_index("v") * BV, BV), BV)
    ops = dict(qg=(qg_ref, qg_s, None), wn=(wn_ref, wn_s, None), kg=(kg_ref, kg_s, None), u=(u_ref, u_s, vs),
               a=(a_ref, a_s, None), d=(d_ref, d_s, None))
    # double-buffered: every operand, or with `single` the two a step reads first; the others are
    # loaded once this step's products have read them
    dbl = ("wn", "d") if single else tuple(ops)
    sgl = tuple(x for x in ops if x not in dbl)
    buf = lambda x, slot: ops[x][1] if x in sgl else ops[x][1].at[slot]  # noqa: E731

    def chunk_src(x, n):
        src, _, cols = ops[x]
        src = src.at[first + n, bh] if chunk_major else src.at[bh, first + n]
        return src if cols is None else src.at[:, cols]

    def issue(n, slot):
        for i, x in enumerate(dbl):
            plgpu.copy_gmem_to_smem(chunk_src(x, n), ops[x][1].at[slot], bars.at[2 * i + slot])

    def issue_sgl(n):
        for i, x in enumerate(sgl):
            plgpu.copy_gmem_to_smem(chunk_src(x, n), ops[x][1], sbars.at[i])

    # with `single` the carried tile first: its buffer is qg's and kg's
    if zero_h0:  # no initial state: zeros in registers, not a zero tile read from HBM
        issue(0, 0)
        S = plgpu.layout_cast(jnp.zeros((K, BV), jnp.float32), plgpu.Layout.WGMMA)
    else:
        S = load_carried(0, issue, h0_ref.at[p, :, vs], h_s, h_bar.at[0], carried_first=single)
    if single:
        issue_sgl(0)

    def step(n, S):
        slot = lax.rem(n, 2)

        @pl.when(n + 1 < NT)
        def _prefetch():
            issue(n + 1, 1 - slot)

        for i in range(len(dbl)):
            plgpu.barrier_wait(bars.at[2 * i + slot])
        for i in range(len(sgl)):
            plgpu.barrier_wait(sbars.at[i])
        s_s[...] = S.astype(dt)
        plgpu.commit_smem()
        if with_states:  # read by TMA before the next step rewrites s_s (the wait below covers it)
            plgpu.copy_smem_to_gmem(s_s, st_ref.at[first + n, bh, :, vs])

        u = plgpu.load(buf("u", slot), layout=plgpu.Layout.WGMMA).astype(jnp.float32)

        def vnew_mm(acc):
            plgpu.wgmma(acc, wn_s.at[slot], s_s)
            return acc[...]

        # A negated W costs XLA a pass over it; a subtraction here costs nothing
        vnew = u + _mm(vnew_mm, (C, BV)) if w_negated else u - _mm(vnew_mm, (C, BV))
        if single:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's o (over v') is read
        vn_s[...] = vnew.astype(dt)
        plgpu.commit_smem()
        if with_vn:  # like the states: read by TMA before the wait below, so before the next step's write
            plgpu.copy_smem_to_gmem(vn_s, vn_ref.at[first + n, bh, :, vs])

        def out_state_mm(acc_o, acc_s):
            # Both products are issued before either is read, so they overlap on the tensor cores.
            a_op = buf("a", slot)
            plgpu.wgmma(acc_o, buf("qg", slot), s_s)
            plgpu.wgmma(acc_o, a_op.transpose((1, 0)) if a_transposed else a_op, vn_s)
            plgpu.wgmma(acc_s, buf("kg", slot).transpose((1, 0)), vn_s)
            return acc_o[...], acc_s[...]

        d = plgpu.load(d_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
        S = S * lax.broadcast_in_dim(d, S.shape, [0])
        o, dS = pl.run_scoped(out_state_mm, plgpu.ACC((C, BV), jnp.float32), plgpu.ACC((K, BV), jnp.float32))
        if single:
            @pl.when(n + 1 < NT)
            def _load_next():  # the products have read qg, kg, A; u went to registers before a commit
                issue_sgl(n + 1)

        S = S + dS
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_s (with `single` v') free again
        o_s[...] = o.astype(o_s.dtype)
        plgpu.commit_smem()
        if heads is None:
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[bh, first + n, :, vs])
        else:  # straight into [B, T, H, V]: no transpose afterwards
            o_dst = o_ref.at[lax.div(bh, heads), pl.ds((first + n) * C, C), lax.rem(bh, heads), vs]
            plgpu.copy_smem_to_gmem(o_s, o_dst)
        return S

    S = lax.fori_loop(0, NT, step, S)
    h_s[...] = S  # with `single`, no load is in flight: the last step issued none
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_s, ht_ref.at[p, :, vs])
    plgpu.wait_smem_to_gmem(0)


def state_output(qg, wn, kg, u, a, d, h0, *, out_dtype, interpret=False, with_states=False, heads=None,
                 chunk_major=False, a_transposed=False, block_v=None, with_vn=False, w_negated=True, segments=1):
    """Run the inter-chunk kernel.

    qg, wn, kg [BH, NT, C, K]; u [BH, NT, C, V]; a [BH, NT, C, C] (one operand
    dtype, bf16 on GPU); d [BH, NT, K] f32; h0 [BH, K, V] f32, or None for zeros (no
    XLA op writes a zero state for the kernel to read; one segment only). wn holds -W, or W itself with
    `w_negated=False` (v' = u - W S either way).
    Returns (o [BH, NT, C, V] out_dtype, final state [BH, K, V] f32), and with `with_states`
    also the incoming state of every chunk [NT, BH, K, V] in the operand dtype (the rounding
    the products used), which the backward pass reuses instead of recomputing the forward, and
    with `with_vn` after those the corrected values v' [NT, BH, C, V] in that dtype.
    With `heads` = H (BH = B * H), o is [B, NT * C, H, V] instead (the layout of the inputs).
    `chunk_major`: the chunk operands (qg .. a, d) are [NT, BH, ...] instead (`chunk.py`'s layout).
    `a_transposed`: a holds A^T (as `mosaic_intra_bf16` writes it).
    `interpret`: run under the Mosaic GPU interpreter (CPU tests). `block_v`: V columns per
    program, 64, 32, 16 or "auto" (None: `chunk_segments.BLOCK_V`, read while tracing).
    `segments` = s > 1: the NT chunks run as s segments of NT / s side by side, segment j from
    h0[j * BH + bh] (h0 is [s * BH, K, V], its starting states, as `chunk_segments` forms them),
    and the final states are each segment's, [s * BH, K, V].
    """
    BH = qg.shape[1] if chunk_major else qg.shape[0]
    NT = qg.shape[0] if chunk_major else qg.shape[1]
    if h0 is None and segments != 1:
        raise ValueError(f"state_output with segments={segments} needs every segment's starting state h0, not None")
    if h0 is not None:
        check_segments(NT, segments, h0, BH)
    BV = chunk_segments.block_v(block_v, programs64=segments * BH * max(u.shape[-1] // 64, 1))  # read while tracing
    return _state_output(qg, wn, kg, u, a, d, h0, out_dtype=jnp.dtype(out_dtype), interpret=interpret,
                         with_states=with_states, heads=heads, chunk_major=chunk_major, a_transposed=a_transposed,
                         BV=BV, with_vn=with_vn, w_negated=bool(w_negated), single=buffers() == "single",
                         segments=int(segments),
                         form=chain(BV, with_states or with_vn, segments * BH * (u.shape[-1] // BV)))


@lowered_once("out_dtype", "interpret", "with_states", "heads", "chunk_major", "a_transposed", "BV", "with_vn",
              "w_negated", "single", "segments", "form")
def _state_output(qg, wn, kg, u, a, d, h0, *, out_dtype, interpret, with_states, heads, chunk_major, a_transposed,
                  BV, with_vn, w_negated, single, segments, form):
    NT, BH, Cc, K = qg.shape if chunk_major else (qg.shape[1], qg.shape[0], *qg.shape[2:])
    V = u.shape[-1]
    if Cc != C or K % 64 or V % 64:
        raise ValueError(f"state_output needs C={C} and K, V multiples of 64; got C={Cc}, K={K}, V={V}")
    if form == "regs":  # the starting and final states cross in transposed form ([P, V, K])
        from kernels.kda import mosaic_state_regs

        o, ht = mosaic_state_regs.state_output_regs(
            qg, wn, kg, u, a, d, None if h0 is None else jnp.swapaxes(h0, 1, 2), out_dtype=out_dtype,
            interpret=interpret, heads=heads, chunk_major=chunk_major, a_transposed=a_transposed,
            w_negated=w_negated, segments=segments)
        return o, jnp.swapaxes(ht, 1, 2)
    dt = qg.dtype
    _smem_ = functools.partial(_smem, BV=BV)
    if single:  # wn, d double; (h | qg, kg), A, u single; S's operand copy; (v' | o)
        scratch = [
            _smem_((2, C, K), dt),
            plgpu.SMEM((2, K), jnp.float32),
            plgpu.RefUnion(_smem_((K, BV), jnp.float32), (_smem_((C, K), dt), _smem_((C, K), dt))),
            _smem_((C, C), dt),
            _smem_((C, BV), dt),
            _smem_((K, BV), dt),
            plgpu.RefUnion(_smem_((C, BV), dt), _smem_((C, BV), out_dtype)),
            plgpu.Barrier(num_barriers=2 * 2, num_arrivals=1),
            plgpu.Barrier(num_barriers=4, num_arrivals=1),
            plgpu.Barrier(num_barriers=1),
        ]
    else:
        scratch = [
            _smem_((2, C, K), dt),
            _smem_((2, C, K), dt),
            _smem_((2, C, K), dt),
            _smem_((2, C, BV), dt),
            _smem_((2, C, C), dt),
            plgpu.SMEM((2, K), jnp.float32),
            _smem_((K, BV), dt),
            _smem_((C, BV), dt),
            _smem_((C, BV), out_dtype),  # swizzled: the register stores of o and h are bank-conflict free
            _smem_((K, BV), jnp.float32),
            plgpu.Barrier(num_barriers=6 * 2, num_arrivals=1),
            plgpu.Barrier(num_barriers=1),
        ]
    o_shape = (BH, NT, C, V) if heads is None else (BH // heads, NT * C, heads, V)
    out_type = (jax.ShapeDtypeStruct(o_shape, out_dtype), jax.ShapeDtypeStruct((segments * BH, K, V), jnp.float32))
    if with_states:
        out_type += (jax.ShapeDtypeStruct((NT, BH, K, V), dt),)
    if with_vn:
        out_type += (jax.ShapeDtypeStruct((NT, BH, C, V), dt),)
    body = functools.partial(_body, NT=NT // segments, K=K, BV=BV, dt=dt, with_states=with_states, heads=heads,
                             chunk_major=chunk_major, a_transposed=a_transposed, with_vn=with_vn,
                             w_negated=w_negated, single=single, BH=BH, zero_h0=h0 is None)
    args = (qg, wn, kg, u, a, d) + (() if h0 is None else (h0,))
    return launch_bh_v(body, out_type, scratch, args, BH=segments * BH, V=V, BV=BV, interpret=interpret)

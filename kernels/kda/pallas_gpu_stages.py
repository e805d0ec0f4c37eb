"""Stage-by-stage GPU timing of chunked KDA: where the forward and backward time goes.

Each stage of impl="chunk" (pure JAX) and impl="pallas_gpu" (Mosaic GPU) is jitted on its own,
fed with the real outputs of the stages before it, and timed (mean ms of `iters` calls after
`warmup`; the first call's compile+run seconds are recorded too). Stages:

  chunk.*       intra pieces (`chunk_intra.prep`, bounded and exact, with the "dense" scores and,
                as "chunk.prep (new)", the "tiled" ones), the WY inverse, the state scan, the
                output products; the whole backward (`chunk._core_bwd`) with the bounded and the
                exact intra path and either scores, and its pieces (prep's vjp for both scores,
                the reverse state scan, the WY pull-back as XLA ops and as `mosaic_wy_bwd`).
  pallas_gpu.*  the exact XLA intra stage (`pallas_gpu_prep.prepare`) and its cast to kernel
                operands, the Mosaic GPU state kernel alone, the Mosaic GPU intra kernels alone
                (`mosaic_intra`, `mosaic_intra_bf16`) and their XLA inputs (cumsum, pad).
  whole         kda(...) forward and forward+backward for both impls (pallas_gpu with each
                intra stage; chunk_mosaic with each score formulation and "diag=split", the
                bounded diagonal tiles by split bf16 products, `chunk_intra.DIAG_MODE`). A failing stage is recorded with its error; the others still run.

    python -m kernels.kda.pallas_gpu_bench --stages --out kda_stages.json
"""

from __future__ import annotations

import datetime
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import PEAK_TBPS, PEAK_TFLOPS
from kernels.kda import (chunk, chunk_intra, chunk_wy, kda, mosaic_intra, mosaic_intra_bf16, mosaic_scores_bwd,
                         mosaic_state, mosaic_wy_bwd, pallas_gpu, pallas_gpu_prep)
from kernels.kda.chunk_intra import SCORES, to_chunks

LOWER_BOUND = -5.0


def _time(f, args, warmup, iters):
    """(first call s, mean ms of `iters` calls after `warmup`)."""
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return first, (time.perf_counter() - t0) / iters * 1e3


def stage_bytes(args, out) -> int:
    """Bytes of a stage's inputs and outputs (arrays, or anything with shape and dtype)."""
    leaves = [x for x in jax.tree.leaves((args, out)) if hasattr(x, "shape") and hasattr(x, "dtype")]
    return int(sum(np.prod(x.shape, dtype=np.int64) * jnp.dtype(x.dtype).itemsize for x in leaves))


def roofline(nbytes: int, flops, ms: float) -> dict:
    """Achieved rates of a stage that moved `nbytes` (and ran `flops`, if given) in `ms`."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    out = dict(bytes=nbytes, gbps=gbps, pct_hbm=100 * gbps / (1e3 * PEAK_TBPS))
    if flops:
        tflops = flops / (ms * 1e-3) / 1e12
        out.update(flops=int(flops), tflops=tflops, pct_tensor=100 * tflops / PEAK_TFLOPS)
    return out


def intra_flops(B, T, H, K, V, C=64) -> int:
    """Products of the intra-chunk stage per chunk of C tokens: the scores Aqk and L (2 C K each
    per token), w = Ai kgam (2 C K) and u = Ai bv (2 C V); `benchmarks/kda.py`'s forward model
    less the state products and Aqk v'."""
    return B * (-(-T // C) * C) * H * (6 * C * K + 2 * C * V)


def state_flops(B, T, H, K, V, C=64) -> int:
    """Products of the state recurrence with its output, per token: v' = u - w S, the state
    update kg^T v' and q S (2 K V each), and Aqk v' (2 C V)."""
    return B * (-(-T // C) * C) * H * (6 * K * V + 2 * C * V)


INTRA_BF16_STAGE = "pallas_gpu.mosaic_intra_bf16 alone (with its XLA gate anchors)"
STATE_STAGE = "pallas_gpu.mosaic_state alone"


def kernel_stage_work(shape) -> dict:
    """{stage name: (bytes, flops)} of the two Mosaic forward kernels' stages at (B, T, H, D),
    from their shapes alone (`jax.eval_shape`, nothing runs): what `run_stages` records with
    their times, for rates of a stage JSON written before it did."""
    B, T, H, K = shape
    V, scale = K, K**-0.5
    sds = lambda s, dt: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    NT = -(-T // mosaic_state.C)
    q = sds((B, NT * mosaic_state.C, H, K), jnp.bfloat16)
    g = sds(q.shape, jnp.float32)
    bt = sds((B, H, q.shape[1]), jnp.float32)
    intra = jax.eval_shape(lambda *a: mosaic_intra_bf16.intra_bf16(*a, scale=scale, interpret=True), q, q, q, g, bt)
    qt, gt = sds((B, T, H, K), jnp.bfloat16), sds((B, T, H, K), jnp.float32)
    ops = jax.eval_shape(lambda *a: pallas_gpu._exact_operands(*a, None, scale, jnp.bfloat16),
                         qt, qt, qt, gt, sds((B, T, H), jnp.float32))
    h0 = sds((B * H, K, V), jnp.float32)
    state = jax.eval_shape(lambda *a: mosaic_state.state_output(*a, out_dtype=jnp.bfloat16, interpret=True), *ops, h0)
    return {INTRA_BF16_STAGE: (stage_bytes((q, q, q, g, bt), intra), intra_flops(B, T, H, K, V)),
            STATE_STAGE: (stage_bytes((ops, h0), state), state_flops(B, T, H, K, V))}


def _inputs(B, T, H, D):
    from kernels.kda.pallas_gpu_bench import inputs

    return inputs(B, T, H, D)


class _Recorder:
    def __init__(self, warmup, iters, only=None, on_row=None):
        self.warmup, self.iters, self.rows, self.only, self.on_row = warmup, iters, [], only, on_row

    def wants(self, name, optional=False):
        """Selected: no `only` and not optional, or a selector in `only` is a substring of the
        name (for optional stages, a selector that says "mosaic", e.g. "intra=mosaic ")."""
        if not self.only:
            return not optional
        return any(s in name and (not optional or "mosaic" in s) for s in self.only)

    def feed(self, name, f, *args):
        """A stage whose output later stages use: timed if selected, else run once untimed."""
        if not self.wants(name):
            try:
                return jax.jit(f)(*args)
            except Exception as e:  # noqa: BLE001 - recorded; the stages that need it are skipped
                err = traceback.format_exception_only(type(e), e)[-1].strip()[:300]
                self.rows.append(dict(stage=name + " (untimed input)", ms=None, first_call_s=None, error=err))
                print(f"{name:40s} failed: {err}", flush=True)
                return None
        return self(name, f, *args)

    def __call__(self, name, f, *args, optional=False, flops=None):
        """Time jit(f)(*args), record it, return its output (None on failure or when `only`
        (substrings of stage names) leaves it out; `optional` stages run only when named).
        The row also holds the stage's bytes (its inputs read once, its outputs written once:
        the HBM floor of a fused stage) as GB/s against the H200's 4.3 TB/s, and, given the
        stage's `flops` (its algorithm's products), TFLOP/s against 790."""
        if not self.wants(name, optional):
            return None
        fj = jax.jit(f)
        try:
            first, ms = _time(fj, args, self.warmup, self.iters)
            out = fj(*args)
            row = dict(stage=name, ms=ms, first_call_s=first, error=None) | roofline(stage_bytes(args, out), flops, ms)
            self.rows.append(row)
            rates = f"  {row['gbps']:7.0f} GB/s ({row['pct_hbm']:.1f}% of HBM)"
            if flops:
                rates += f"  {row['tflops']:6.1f} TFLOP/s ({row['pct_tensor']:.1f}%)"
            print(f"{name:40s} {ms:9.3f} ms   (first call {first:6.1f} s){rates}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing stage must not end the run
            err = traceback.format_exception_only(type(e), e)[-1].strip()[:300]
            self.rows.append(dict(stage=name, ms=None, first_call_s=None, error=err))
            print(f"{name:40s} failed: {err}", flush=True)
            out = None
        if self.on_row is not None:
            self.on_row(self.rows)
        return out


def _chunk_stages(rec, q, k, v, g, beta, scale):
    nm = chunk._Numerics(q.dtype)
    B, T, H, K = q.shape
    cq, ck, cv = (to_chunks(x) for x in (q, k, v))
    cg, cb = to_chunks(g.astype(nm.sdt)), to_chunks(beta.astype(nm.sdt))
    h0 = jnp.zeros((B, H, K, v.shape[-1]), nm.sdt)
    args = (cq, ck, cv, cg, cb)
    P = rec.feed("chunk.prep (intra scores, bounded)",
                 lambda *a: chunk._prep(nm, *a, None, scale, True, True, "dense"), *args)
    rec("chunk.prep (intra scores, exact)", lambda *a: chunk._prep(nm, *a, None, scale, False, True, "dense"), *args)
    for bounded, label in ((True, "bounded"), (False, "exact")):
        rec(f"chunk.prep (new) (tiled scores, {label})",
            lambda *a, b=bounded: chunk._prep(nm, *a, None, scale, b, True, "tiled"), *args)
    if P is None:
        return
    wy = rec.feed("chunk.wy (inverse, w, u)", lambda P: chunk._wy(nm, P), P)
    if wy is None:
        return
    _, w, u = wy
    sc = rec.feed("chunk.state_scan", lambda *a: chunk._state_scan(nm, *a), h0, w, u, P["kg"], P["decay"])
    if sc is None:
        return
    states, vn, _ = sc
    rec("chunk.output (qg S + Aqk v')",
        lambda qg, st, A, vn: nm.mm("nbhck,nbhkv->nbhcv", qg, st) + nm.mm("nbhrc,nbhcv->nbhrv", A, vn),
        P["qg"], states, P["Aqk"], vn)
    do = jnp.ones(cv.shape, jnp.float32)
    dS = jnp.ones(h0.shape, nm.sdt)
    state_pass = pallas_gpu._core_defaults(chunk, interpret=pallas_gpu._device_kind() == "cpu")[0]
    for bounded, scores in ((True, "dense"), (False, "dense"), (True, "tiled"), (False, "tiled")):
        name = f"chunk.bwd whole ({'bounded' if bounded else 'exact'} intra, {scores} scores)"
        if not rec.wants(name):
            continue
        extra = (state_pass, scores)
        res = rec.feed("chunk forward residuals (untimed)", lambda *a, b=bounded, e=extra: chunk._core_fwd(
            *a, None, scale, b, True, *e)[1], cq, ck, cv, cg, cb, h0)
        if res is None:
            continue
        rec(name, lambda res, do, dS, b=bounded, e=extra: chunk._core_bwd(scale, b, True, *e, res, (do, dS)),
            res, do, dS)

    def prep_vjp(*a, scores):
        Pb, pull = jax.vjp(lambda *x: chunk._prep(nm, *x, None, scale, True, True, scores), *a)
        return pull(jax.tree.map(jnp.ones_like, Pb))

    rec("chunk.bwd piece: prep recompute + vjp", lambda *a: prep_vjp(*a, scores="dense"), *args)
    kernel_mode = "interpret" if pallas_gpu._device_kind() == "cpu" else "mosaic"

    def prep_vjp_kernel(*a):
        with chunk.settings(scores_bwd=kernel_mode):
            return prep_vjp(*a, scores="dense")

    rec("chunk.bwd piece: prep recompute + vjp, scores_bwd kernel", prep_vjp_kernel, *args)
    flat = lambda x: x.reshape(x.shape[0], B * H, *x.shape[3:])
    C = cq.shape[-2]
    dA = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), jnp.bfloat16)), (cq.shape[0], B * H, 2, 2, C, C))
    G = flat(chunk_intra.chunk_cumsum(cg))
    anchors = mosaic_scores_bwd.tile_anchors(G)
    for operands in mosaic_scores_bwd.OPERANDS:
        rec(f"mosaic_scores_bwd kernel alone, {operands} operands",
            lambda *a, o=operands: mosaic_scores_bwd.scores_bwd_kernel(
                *a, scale=scale, operands=o, interpret=kernel_mode == "interpret"),
            flat(cq), flat(ck), G, anchors, dA, dA)
    rec("chunk.prep (new) recompute + vjp (tiled scores)", lambda *a: prep_vjp(*a, scores="tiled"), *args)
    dvi = jnp.ones(vn.shape, nm.sdt)
    rec("chunk.bwd piece: reverse state scan",
        lambda *a: chunk._grad_scan(nm, *a), dS, w, P["kg"], P["decay"], states.astype(nm.sdt), dvi)
    # The WY form's pull-back with compute-dtype cotangents: XLA's GEMMs, then the kernel (K, V in {64, 128}).
    wy_args = (vn.astype(nm.cd), states.astype(nm.cd), wy[0], cv, cb, P["kgam"])
    rec("chunk.bwd piece: WY pull-back (XLA)", lambda *a: chunk_wy.wy_bwd_reference(nm, *a, compact=True), *wy_args)
    for form in chunk_wy.WY_FORMS:
        rec(f"chunk.bwd piece: WY pull-back (mosaic_wy_bwd kernel, {form})",
            lambda *a, f=form: mosaic_wy_bwd.wy_bwd(*a, interpret=kernel_mode == "interpret", form=f), *wy_args)
    # With the state products dqg = do S^T, dkg = v' dhs^T, d decay = sum_v S dhs (stand-ins of
    # their shapes and dtypes for do, v', dhs): chunk's three XLA ops beside the WY ones, then the kernel.
    state_args = wy_args + (cv.astype(nm.cd), vn.astype(nm.cd), states.astype(nm.cd))

    def wy_and_state_xla(dvn, S, Ai, v, beta, kgam, do, vn_, dhs):
        products = tuple(chunk.state_products(nm, do, S, vn_, dhs).values())
        return chunk_wy.wy_bwd_reference(nm, dvn, S, Ai, v, beta, kgam, compact=True) + products

    rec("chunk.bwd piece: WY pull-back + state products (XLA)", wy_and_state_xla, *state_args)
    rec("chunk.bwd piece: WY pull-back + state products (mosaic_wy_bwd kernel)",
        lambda *a: mosaic_wy_bwd.wy_bwd(*a[:6], interpret=kernel_mode == "interpret", do=a[6], vn=a[7], dhs=a[8]),
        *state_args)


def _pallas_stages(rec, q, k, v, g, beta, scale):
    B, T, H, K = q.shape
    V = v.shape[-1]
    interpret = pallas_gpu._device_kind() == "cpu"
    C = mosaic_state.C
    NT = -(-T // C)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, NT * C - T)] + [(0, 0)] * (x.ndim - 2))
    qp, kp, vp, gp, bp = (pad(x) for x in (q, k, v, g, beta))
    Gp = jnp.cumsum(gp.reshape(B, NT, C, H, K), axis=2).reshape(B, NT * C, H, K)
    bt = jnp.moveaxis(bp, 1, 2)
    rec(INTRA_BF16_STAGE,
        lambda *a: mosaic_intra_bf16.intra_bf16(*a, scale=scale, interpret=interpret), qp, kp, vp, gp, bt,
        flops=intra_flops(B, T, H, K, V))
    rec("pallas_gpu.prepare (exact XLA intra)",
        lambda *a: pallas_gpu_prep.prepare(*a, scale=scale, segment_ids=None), q, k, v, g, beta)
    ops = rec.feed("pallas_gpu.prepare + cast to operands",
              lambda *a: pallas_gpu._exact_operands(*a, None, scale, q.dtype), q, k, v, g, beta)
    h0 = jnp.zeros((B * H, K, V), jnp.float32)
    if ops is not None:
        rec(STATE_STAGE,
            lambda *a: mosaic_state.state_output(*a, out_dtype=v.dtype, interpret=interpret), *ops, h0,
            flops=state_flops(B, T, H, K, V))
        rec("pallas_gpu.mosaic_state alone, with chunk states",
            lambda *a: mosaic_state.state_output(*a, out_dtype=v.dtype, interpret=interpret, with_states=True),
            *ops, h0, flops=state_flops(B, T, H, K, V))
    rec("pallas_gpu.cumsum + pad (bounded intra inputs)",
        lambda g, b: (jnp.cumsum(pad(g).reshape(B, NT, C, H, K), axis=2), jnp.moveaxis(pad(b), 1, 2)), g, beta)
    rec("pallas_gpu.mosaic_intra alone",
        lambda *a: mosaic_intra.intra_bounded(*a, scale=scale, interpret=interpret), qp, kp, vp, Gp, bt, optional=True)


def _whole(rec, args):
    def fwd(impl, intra=None):
        kw = {} if intra is None else dict(intra=intra)
        return lambda q, k, v, g, b: _kda(impl, kw)(q, k, v, g, b)[0]

    def fwd_bwd(impl, intra=None):
        f = fwd(impl, intra)
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))

    cases = (("pallas_gpu", "mosaic_bf16"), ("pallas_gpu", "chunk"), ("pallas_gpu", "xla"), ("chunk", None),
             ("chunk_mosaic", None), ("chunk", "tiled"), ("chunk_mosaic", "tiled"), ("chunk_mosaic", "diag=split"),
             ("pallas_gpu", "mosaic"))
    for impl, intra in cases:
        label = (impl if intra is None else f"{impl} scores={intra}" if intra in SCORES
                 else f"{impl} {intra}" if intra.startswith("diag=") else f"{impl} intra={intra}")
        optional = intra == "mosaic"  # the older intra kernel compiles for ~25 s: only when asked for
        rec(f"whole {label} fwd", fwd(impl, intra), *args, optional=optional)
        # The backward does not depend on the intra stage: the XLA-stage variants skip it (compiles cost seconds).
        rec(f"whole {label} fwd+bwd", fwd_bwd(impl, intra), *args, optional=optional or intra == "xla")


def _kda(impl, kw):
    intra = str(kw.get("intra"))
    if intra in SCORES or intra.startswith("diag="):  # chunk's module settings, read while tracing
        key, value = ("scores", intra) if intra in SCORES else ("diag", intra.partition("=")[2])

        def traced(*a):
            with chunk.settings(**{key: value}):
                return kda(*a, lower_bound=LOWER_BOUND, impl=impl)
        return traced
    if impl == "pallas_gpu":
        return lambda *a: pallas_gpu.kda_impl(*a, scale=a[0].shape[-1] ** -0.5, initial_state=None, segment_ids=None,
                                              lower_bound=LOWER_BOUND, **kw)
    return lambda *a: kda(*a, lower_bound=LOWER_BOUND, impl=impl)


def run_stages(shape, *, warmup=2, iters=5, only=None, out=None):
    """Time every stage at `shape` = (B, T, H, D), bf16, lower_bound=-5 (only those whose name
    contains one of the strings in `only`, if given). Returns a JSON-able dict, also written to
    `out` after every stage (a run cut short keeps what it measured)."""
    t0 = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    q, k, v, g, beta = _inputs(*shape)
    scale = shape[-1] ** -0.5
    d = jax.devices()[0]

    def result(rows):
        return dict(date=started, shape=list(shape), dtype="bfloat16", lower_bound=LOWER_BOUND, warmup=warmup, iters=iters,
                    device=getattr(d, "device_kind", str(d)), platform=d.platform, jax=jax.__version__,
                    wall_s=time.perf_counter() - t0, stages=rows)

    def write(rows):
        if out:
            with open(out, "w") as f:
                json.dump(result(rows), f, indent=2)

    rec = _Recorder(warmup, iters, only, write)
    print(f"# stages at {shape} bf16 lower_bound={LOWER_BOUND} on {jax.devices()[0].device_kind}", flush=True)
    _whole(rec, (q, k, v, g, beta))
    _pallas_stages(rec, q, k, v, g, beta, scale)
    _chunk_stages(rec, q, k, v, g, beta, scale)
    write(rec.rows)
    return result(rec.rows)

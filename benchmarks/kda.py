"""KDA forward and forward+backward: this project's impls against the installed peers, one GPU.

    python benchmarks/kda.py                      # H200: the four shapes below, every impl and peer
    python benchmarks/kda.py --quick              # a tiny shape, few iterations (runs on CPU too)
    python benchmarks/kda.py --shapes 8x4096x16x128 --impls chunk --peers fla,cudnn
    python benchmarks/kda.py --decode             # one decoding step, B=64, H=32, K=V=128
    python benchmarks/kda.py --decode --decode_blocks 132.2.128,264.3.32   # + pipelined-kernel settings
    python benchmarks/kda.py --impls chunk,pallas_gpu:mosaic_bf16 --peers fla   # a chosen intra stage
    python benchmarks/kda.py --impls chunk_mosaic:dense,chunk_mosaic:tiled --peers fla   # chunk's score formulations
    python benchmarks/kda.py --impls chunk_mosaic,chunk_mosaic:cumsum=matmul --peers none   # any chunk setting
    python benchmarks/kda.py --shapes 1x65536x16x128 --steps fwd --impls chunk_mosaic,chunk_mosaic:forward_segments=8
    python benchmarks/kda.py --shapes 8x4096x16x128 --impls chunk_mosaic,chunk_mosaic:state_buffers=single --rounds 5
    python benchmarks/kda.py --peers fla --triton_cache .cache/triton   # keep fla's autotuning for the next run
    python benchmarks/kda.py --peers fla --triton_cache /tmp/tc --autotune_archive fla-autotune.tgz   # ... in a file

Ours: `kda(..., impl=...)` for `naive` (only where its autodiff states fit, else skipped with the
reason), `chunk`, `chunk_mosaic` (chunk with Mosaic GPU serial passes) and `pallas_gpu` (when it
imports and takes the call; `pallas_gpu:<intra>` picks its intra-chunk stage), all with lower_bound=-5.
Peers: flash-linear-attention `chunk_kda` through PyTorch (`fla`; safe_gate, lower_bound=-5; its
first call per shape autotunes for minutes, so it is warmed up first), jax-linear-attention's KDA
(`jla` = its `mosaic_gpu` and `chunked` impls), and cuDNN causal softmax attention at the same
B, T, H, D (`jax.nn.dot_product_attention(implementation="cudnn")`).

fla's autotuning (minutes per new shape; on a fresh H200 it has outlasted 10-minute runs at
4,8192,32,128) is cached by Triton on disk (fla sets `cache_results`): `--triton_cache DIR` points
Triton's cache there, so a later run on the same GPU type and versions skips the tuning. The run
records how many autotuning results the folder held before and after. The results of an H200 run
(fla-core 0.6.0, torch 2.11; three of the four shapes, 4,8192,32,128 did not finish) are kept in
`benchmarks/results/fla-triton-autotune-h200-20261130.tgz`. `--autotune_archive FILE.tgz` (with
`--triton_cache`) extracts such an archive's autotuning results into the cache folder before the
run and, after every shape, rewrites the archive with all the folder holds (the `*.autotune.json`
files only, a few KB): a run on a fresh machine starts from the archive and leaves it extended.

Inputs (bf16 q, k, v): q and k l2-normalised, g = -5 * sigmoid(N(0, 1)) per channel (float32),
beta = sigmoid(N(0, 1)). Times: median of `--iters` calls after `--warmup` calls; with `--rounds R`
every row of a shape is timed R times, row after row, and keeps the median of its rounds (shared GPUs
drift by 5-10% over a run: rounds spread that over every row instead of the row that ran then).

FLOP and byte model (per head and token, chunk C = 64, key dim K, value dim V, bf16 = 2 bytes):
  KDA forward FLOPs    6CK (scores Aqk, L and w) + 4CV (u and Aqk v') + 6KV (w S, kg^T v', q S);
  forward+backward     3x the forward (the usual backward = 2x forward);
  KDA forward bytes    read q, k, v (bf16), g (f32), beta (f32), write o (bf16): the unavoidable HBM traffic;
  forward+backward     the forward, plus reading them again with do and writing dq, dk, dv, dg, dbeta.
  Attention FLOPs      causal forward 2 T D per query (half of QK^T and PV), backward 2.5x forward;
  attention bytes      q, k, v, o (+ do, dq, dk, dv for the backward) in bf16.
Achieved TFLOP/s and GB/s are set against one H200: 790 TFLOP/s dense bf16 and 4.3 TB/s.

Decode (`--decode`): `kda_step` with impl `pallas_gpu` (the Mosaic GPU decode kernel) and `naive`
(the plain-JAX step), and fla's `fused_recurrent_kda` at T = 1 when installed; bytes = the float32
state read once and written once, plus q, k, v, o (bf16), g (f32) and beta (f32). A step is timed
per call (dispatched and waited for, as a token-by-token loop sees it) and back to back (the mean
over calls dispatched without waiting: the device time, which the bandwidth columns use).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to PyTorch too
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (  # noqa: E402
    PEAK_TBPS,
    PEAK_TFLOPS,
    attempt,
    environment,
    time_jax,
    time_jax_stream,
    time_torch,
    time_torch_stream,
    write_json,
)
from benchmarks.kda_rows import ratio, table, table_row  # noqa: E402
from benchmarks.triton_cache import (  # noqa: E402,F401 - re-exported: the tests and callers use bench.<name>
    count_autotune_results,
    load_autotune_archive,
    save_autotune_archive,
    use_triton_cache,
)
from kernels.kda import kda  # noqa: E402
from kernels.kda.chunk_intra import SCORES  # noqa: E402
from kernels.testing import rel_rms  # noqa: E402

SHAPES = ((8, 4096, 16, 128), (2, 16384, 16, 128), (1, 65536, 16, 128), (4, 8192, 32, 128))
QUICK_SHAPES = ((1, 128, 2, 32),)
IMPLS = ("naive", "chunk", "chunk_mosaic", "pallas_gpu")
# pallas_gpu with a chosen intra-chunk stage ("pallas_gpu:mosaic_bf16"); plain "pallas_gpu" uses
# the module's DEFAULT_INTRA.
PALLAS_INTRA = ("chunk", "xla", "mosaic", "mosaic_bf16")
PEERS = ("fla", "jla", "cudnn")
LOWER_BOUND = -5.0
NAIVE_MAX_BYTES = 2 * 2**30  # the naive impl's autodiff keeps one float32 state per token
args_timing = dict(warmup=3, iters=10)  # set from the flags in `main`
STEPS = ("both", "fwd")
steps = dict(backward=True)  # --steps fwd: forward+backward not timed (set in `main`)
rounds = dict(n=1)  # --rounds: timing rounds over all rows of a shape, each row's median kept (set in `main`)
# --timing: "call" (each call dispatched and waited for: what a caller that reads every result
# sees, host round trip included) or "stream" (calls back to back, one wait per burst: the device
# time); both for ours and the peers alike (set in `main`)
TIMINGS = ("call", "stream")
timing = dict(mode="call")


def _time_jax(fn, *args):
    if timing["mode"] == "stream":
        return time_jax_stream(fn, *args, warmup=args_timing["warmup"], iters=args_timing["iters"])
    return time_jax(fn, *args, **args_timing)


def _time_torch(fn):
    if timing["mode"] == "stream":
        return time_torch_stream(fn, warmup=args_timing["warmup"], iters=args_timing["iters"])
    return time_torch(fn, **args_timing)


def make_inputs(shape, seed=0):
    """Host float32 arrays: q, k [B, T, H, D] unit rows, v, g = -5 sigmoid(N), beta = sigmoid(N)."""
    B, T, H, D = shape
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, dtype=np.float32)
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))
    q, k = normal(B, T, H, D), normal(B, T, H, D)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = normal(B, T, H, D)
    g = (LOWER_BOUND * sig(normal(B, T, H, D))).astype(np.float32)
    beta = sig(normal(B, T, H)).astype(np.float32)
    do = normal(B, T, H, D)
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do)


def _jax_timings(f, x, args):
    """Time jit(f) and jit(vjp of f) on JAX arrays; returns (fwd ms, fwd+bwd ms, o, again), with
    again() timing both once more (a later round). The forward+backward returns o with the
    gradients, as a training step needs it (and as the PyTorch peers compute it): a backward that
    does not read o would otherwise let XLA drop o's products."""
    do = jnp.asarray(x["do"], jnp.bfloat16)
    fwd = jax.jit(f)

    @jax.jit
    def fwd_bwd(*a):
        o, vjp = jax.vjp(f, *a)
        return o, vjp(do.astype(o.dtype))

    def again():
        fb = _time_jax(fwd_bwd, *args) if steps["backward"] else None
        return _time_jax(fwd, *args), fb

    o = fwd(*args)
    return (*again(), o, again)


def _within(context, res):
    """A timing result whose again() runs inside `context()`, the module settings the jitted
    functions were traced under: their compiled programs do not read them, but a retrace (say,
    after a compilation-cache eviction) would, and must see the same settings."""
    *times, again = res

    def again_within():
        with context():
            return again()

    return (*times, again_within)


@contextlib.contextmanager
def _default_intra(intra):
    from kernels.kda import pallas_gpu

    default = pallas_gpu.DEFAULT_INTRA
    pallas_gpu.DEFAULT_INTRA = intra  # read while the jitted functions trace (their first call)
    try:
        yield
    finally:
        pallas_gpu.DEFAULT_INTRA = default



def _ours(impl, x, shape):
    B, T, H, D = shape
    impl, _, intra = impl.partition(":")
    if impl == "naive" and B * T * H * D * D * 4 > NAIVE_MAX_BYTES:
        gb = B * T * H * D * D * 4 / 2**30
        return None, f"skipped: the token-serial reference keeps every state for autodiff ({gb:.0f} GiB)"
    if impl == "pallas_gpu":
        from kernels.kda.pallas_gpu import unsupported_reason

        reason = unsupported_reason(D, D, jnp.bfloat16, interpret=False)
        if reason is not None:
            return None, f"skipped: {reason}"
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    f = lambda q, k, v, g, beta: kda(q, k, v, g, beta, lower_bound=LOWER_BOUND, impl=impl)[0]
    if not intra:
        return attempt(lambda: _jax_timings(f, x, args))
    if impl in ("chunk", "chunk_mosaic"):  # chunk:<scores> or chunk:key=value/..., traced module settings
        from kernels.kda import chunk

        context = lambda: chunk.settings(**chunk_settings(intra))  # noqa: E731
    else:
        context = lambda: _default_intra(intra)  # noqa: E731
    with context():
        return attempt(lambda: _within(context, _jax_timings(f, x, args)))


def _jla(impl, x):
    from jla.ops import linear_attention as jla_linear_attention

    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    f = lambda q, k, v, g, beta: jla_linear_attention("kda", q, k, v, g=g, beta=beta, impl=impl)[0]
    return _jax_timings(f, x, args)


def _cudnn(x):
    if jax.devices()[0].platform != "gpu":
        raise RuntimeError("skipped: cuDNN attention needs an NVIDIA GPU")
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(x["q"]), bf(x["k"]), bf(x["v"]))
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    fwd_ms, fb_ms, _, again = _jax_timings(f, x, args)
    return fwd_ms, fb_ms, None, again


def _fla(x):
    import torch
    from fla.ops.kda import chunk_kda

    if not torch.cuda.is_available():
        raise RuntimeError("skipped: flash-linear-attention needs a CUDA device")
    dev = torch.device("cuda")
    t = lambda a, dt, grad=True: torch.from_numpy(a).to(dev).to(dt).requires_grad_(grad)
    q, k, v = (t(x[n], torch.bfloat16) for n in ("q", "k", "v"))
    g = t(x["g"], torch.float32)
    beta = t(x["beta"], torch.bfloat16)
    do = t(x["do"], torch.bfloat16, grad=False)
    kw = dict(safe_gate=True, lower_bound=LOWER_BOUND)

    def call():
        return chunk_kda(q, k, v, g, beta, **kw)[0]

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        return torch.autograd.grad(call(), (q, k, v, g, beta), do)

    fwd()  # the first call per shape autotunes (minutes)
    if steps["backward"]:
        fwd_bwd()
    o = fwd().float().cpu().numpy()

    def again():
        fb = _time_torch(fwd_bwd) if steps["backward"] else None
        return _time_torch(fwd), fb

    return (*again(), o, again)


def _peer(name, x):
    if name == "fla":
        return [("fla chunk_kda", attempt(lambda: _fla(x)))]
    if name == "jla":
        return [(f"jla {i}", attempt(lambda i=i: _jla(i, x))) for i in ("mosaic_gpu", "chunked")]
    if name == "cudnn":
        return [("cudnn attention", attempt(lambda: _cudnn(x)))]
    raise ValueError(f"Unknown peer {name!r}; expected one of {PEERS}")


def run_shape(shape, impls, peers, on_row=None):
    """All rows of one shape: dicts with name, kind, times, roofline figures, error or skip reason.

    `on_row(rows)` runs after every measured row (ratios are filled in at the end of the shape),
    so a run cut short by a time limit keeps what it measured. With rounds["n"] > 1 every row is
    timed again, row after row, that many times in all (each compiled once): a row's times are
    its rounds' medians, the rounds kept in row["rounds"], so that a drift of the machine over
    the run falls on every row alike."""
    B, T, H, D = shape
    x = make_inputs(shape)
    rows, outs, agains = [], {}, {}

    def add(row, res):
        rows.append(row)
        out = None if res is None else res[2]
        if out is not None:
            outs[row["name"]] = np.asarray(out, np.float32)
        if res is not None:
            agains[row["name"]] = res[3]
        fwd, fb = row["fwd_ms"], row["fwd_bwd_ms"]
        print(f"  {row['name']}: fwd {fwd if fwd is None else round(fwd, 3)} ms, "
              f"fwd+bwd {fb if fb is None else round(fb, 3)} ms{'  ' + str(row['error'])[:120] if row['error'] else ''}",
              flush=True)
        if on_row is not None:
            on_row(rows)

    for impl in impls:
        _check_impl(impl)
        res, err = _ours(impl, x, shape)
        row = table_row(f"{impl}", "ours", shape, res, err)
        name, _, opt = impl.partition(":")
        if name in ("chunk", "chunk_mosaic") and chunk_settings(opt).get("block_v") == "auto":
            from kernels.kda import chunk_segments  # the width "auto" resolves to at this shape

            row["block_v"] = chunk_segments.auto_block_v(B * H * max(D // 64, 1))
        add(row, res)
    for name in peers:
        for label, (res, err) in _peer(name, x):
            add(table_row(label, "peer", shape, res, err), res)
    _more_rounds(rows, agains, shape, on_row)
    ref = outs.get("chunk")
    for row in rows:
        if ref is not None and row["name"] in outs:
            row["o_rel_err_vs_chunk"] = rel_rms(ref, outs[row["name"]])
        row["ratios"] = {
            p["name"]: dict(fwd=ratio(row["fwd_ms"], p["fwd_ms"]), fwd_bwd=ratio(row["fwd_bwd_ms"], p["fwd_bwd_ms"]))
            for p in rows
            if p["kind"] == "peer" and p["fwd_ms"] is not None and row["kind"] == "ours"
        }
    return rows


def _more_rounds(rows, agains, shape, on_row=None):
    """Rounds 2.. of `run_shape` (rounds["n"] in all): each timed row once more per round, in
    order; then its times are the medians of its rounds."""
    timed = [r for r in rows if r["name"] in agains]
    if rounds["n"] <= 1 or not timed:
        return
    for r in timed:
        r["rounds"] = dict(fwd=[r["fwd_ms"]], fwd_bwd=[r["fwd_bwd_ms"]])
    for i in range(1, rounds["n"]):
        for r in timed:
            f, b = agains[r["name"]]()
            r["rounds"]["fwd"].append(f)
            r["rounds"]["fwd_bwd"].append(b)
        print(f"  round {i + 1} of {rounds['n']} done", flush=True)
    for r in timed:
        med = lambda ts: None if ts[0] is None else statistics.median(ts)  # noqa: E731
        r.update(table_row(r["name"], r["kind"], shape, (med(r["rounds"]["fwd"]), med(r["rounds"]["fwd_bwd"])),
                      r["error"]))
        fmt_ms = lambda ts: "-" if ts[0] is None else " ".join(f"{t:.3f}" for t in ts)  # noqa: E731
        print(f"  {r['name']}: rounds fwd {fmt_ms(r['rounds']['fwd'])}, fwd+bwd {fmt_ms(r['rounds']['fwd_bwd'])}",
              flush=True)
    if on_row is not None:
        on_row(rows)


def chunk_settings(opt: str) -> dict:
    """"tiled" -> {"scores": "tiled"}; "cumsum=matmul/diag=split" -> those `chunk.settings`."""
    from kernels.kda import chunk

    if not opt:
        return {}
    if "=" not in opt:
        opt = f"scores={opt}"
    out = {}
    for key, value in (item.split("=", 1) for item in opt.split("/")):
        choices = {str(c): c for c in chunk.setting_values(key)} if key in chunk.SETTINGS else {}
        if value not in choices:
            raise ValueError(f"chunk setting {key}={value!r}: expected a key of {chunk.SETTINGS} with one of its values")
        out[key] = choices[value]  # "segments=8" -> 8
    return out


def _check_impl(impl):
    name, sep, opt = impl.partition(":")
    ok = name in IMPLS
    if ok and sep:
        if name == "pallas_gpu":
            ok = opt in PALLAS_INTRA
        elif name in ("chunk", "chunk_mosaic"):
            try:
                chunk_settings(opt)
            except ValueError:
                ok = False
        else:
            ok = False
    if not ok:
        raise ValueError(f"Unknown impl {impl!r}; expected one of {IMPLS}, pallas_gpu:<{'|'.join(PALLAS_INTRA)}> "
                         f"or chunk[_mosaic]:<{'|'.join(SCORES)}> or chunk[_mosaic]:key=value/... (chunk.SETTINGS)")


def _parse_shapes(s):
    try:
        return [tuple(int(n) for n in item.lower().split("x")) for item in s.split(",") if item]
    except ValueError:
        raise ValueError(f"--shapes must look like 8x4096x16x128[,BxTxHxD...]; got {s!r}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help="comma-separated BxTxHxD (D = K = V)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"ours, from {IMPLS}; pallas_gpu:<intra> picks its intra stage from {PALLAS_INTRA}, "
                        f"chunk[_mosaic]:<scores> the score formulation from {SCORES}, "
                        "chunk[_mosaic]:key=value/... any traced KDA setting (kernels.kda.chunk.SETTINGS)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"from {PEERS}, or 'none'")
    p.add_argument("--out", help="JSON path (default benchmarks/results/kda-<time>.json)")
    p.add_argument("--quick", action="store_true", help="tiny shape, 1 warm-up and 3 timed calls")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every row of a shape this many times, row after row (compiled once), keeping medians")
    p.add_argument("--steps", default="both", choices=STEPS,
                   help="time the forward and the forward+backward, or the forward only (no backward compiled)")
    p.add_argument("--timing", default="call", choices=TIMINGS,
                   help="call: each call dispatched and waited for (the host round trip included); stream: calls "
                        "back to back, one wait per burst (the device time)")
    p.add_argument("--decode", action="store_true", help="time one decoding step (kda_step) instead")
    p.add_argument("--decode_blocks", default="",
                   help="with --decode: extra decode_step_pipelined settings programs.slots.block_v, comma-separated")
    p.add_argument("--triton_cache", default="",
                   help="Triton cache folder (TRITON_CACHE_DIR) that keeps fla's autotuning results between runs")
    p.add_argument("--autotune_archive", default="",
                   help="with --triton_cache: a .tgz of autotuning results, extracted before and rewritten after each shape")
    a = p.parse_args(argv)
    if a.autotune_archive and not a.triton_cache:
        p.error("--autotune_archive needs --triton_cache (the folder Triton reads and writes)")
    if a.autotune_archive:
        n = load_autotune_archive(a.autotune_archive, os.path.abspath(a.triton_cache))
        print(f"# {n} autotuning results from {a.autotune_archive}", flush=True)
    cache = use_triton_cache(a.triton_cache) if a.triton_cache else None
    shapes = _parse_shapes(a.shapes) if a.shapes else list(QUICK_SHAPES if a.quick else SHAPES)
    args_timing.update(warmup=1 if a.quick else a.warmup, iters=3 if a.quick else a.iters)
    steps.update(backward=a.steps == "both")
    timing.update(mode=a.timing)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    rounds.update(n=a.rounds)
    impls = [s for s in a.impls.split(",") if s]
    peers = [] if a.peers == "none" else [s for s in a.peers.split(",") if s]
    for name in peers:
        if name not in PEERS:
            raise ValueError(f"Unknown peer {name!r}; expected one of {PEERS}")
    env = environment()
    print(f"# KDA benchmark: {env['device']} ({env['platform']}), jax {env['jax']}, torch {env['torch']}, "
          f"fla {env['fla']}, jla {env['jla']}, {env['date']}", flush=True)  # fmt: skip
    if a.decode:
        from benchmarks.kda_decode import DECODE_SHAPE, QUICK_DECODE_SHAPE, decode_table, parse_decode_blocks, run_decode

        shape = QUICK_DECODE_SHAPE if a.quick else DECODE_SHAPE
        rows = run_decode(shape, peers, parse_decode_blocks(a.decode_blocks))
        report = decode_table(rows)
        print(report, flush=True)
        config = dict(decode_shape=list(shape), peers=peers, lower_bound=LOWER_BOUND, **args_timing)
        result = dict(env=env, config=config, peak=dict(tflops=PEAK_TFLOPS, tbps=PEAK_TBPS), rows=rows, table=report)
        path = write_json(result, a.out, "kda-decode")
        print(f"\nwrote {path}")
        return result
    rows, path = [], a.out
    config = dict(shapes=[list(s) for s in shapes], impls=impls, peers=peers, lower_bound=LOWER_BOUND, steps=a.steps,
                  rounds=a.rounds, timing=a.timing, **args_timing)
    if cache is not None:
        config["triton_cache"] = cache

    def save(all_rows):
        nonlocal path
        report = table(all_rows)
        result = dict(env=env, config=config, peak=dict(tflops=PEAK_TFLOPS, tbps=PEAK_TBPS), rows=all_rows, table=report)
        path = write_json(result, path, "kda")
        return report, result

    for shape in shapes:
        print(f"# shape {shape}", flush=True)
        done = list(rows)
        rows += run_shape(shape, impls, peers, on_row=lambda partial: save(done + partial))
        print(table([r for r in rows if r["shape"] == list(shape)]) + "\n", flush=True)
        if cache is not None:
            cache["autotune_results_after"] = count_autotune_results(os.environ["TRITON_CACHE_DIR"])
        if a.autotune_archive:
            save_autotune_archive(os.environ["TRITON_CACHE_DIR"], a.autotune_archive)
        report, result = save(rows)
    print(report)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()

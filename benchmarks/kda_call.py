"""Where a per-call KDA forward's wall time goes beyond its kernels: dispatch, kernels, the wait.

    python benchmarks/kda_call.py --shape 8x4096x16x128            # chunk_mosaic's forward
    python benchmarks/kda_call.py --impl chunk --out F.json
    python benchmarks/kda_call.py --quick                          # tiny shape (CPU: the plumbing)

`benchmarks/kda.py` times a call either dispatched and waited for ("call") or back to back
("stream": the device time). This script says what separates the two for one forward: it times
the forward both ways beside a trivial jitted op on the same inputs (JAX's own dispatch and wait,
the floor of any call), then traces `--calls` per-call iterations, each inside a named host
range, and keeps for two of them every event that starts inside the range (host events over
`--min_us`, all device kernels), at microseconds from the range's start. `host_top_us_per_call`
sums the host events by name per call. On a GPU the timeline shows when the first kernel starts
after the call and how long the host's wait returns after the last kernel ends.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import environment, time_jax, time_jax_stream, write_json  # noqa: E402
from benchmarks.kda import LOWER_BOUND, _check_impl, _parse_shapes, chunk_settings, make_inputs  # noqa: E402
from kernels.kda import chunk, kda  # noqa: E402

RANGE = "kda_call"  # the host range around each traced call


def _events(trace_dir: str):
    """(plane, line, name, start ns, duration ns) of every event of the newest trace."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}")
    data = ProfileData.from_file(files[-1])
    return [(p.name, ln.name, e.name, e.start_ns, e.duration_ns)
            for p in data.planes for ln in p.lines for e in ln.events]


def timeline(events, min_us: float, keep: int = 2):
    """Per traced call (the `keep` calls after the first two, the warm ones), the events starting
    inside its host range: (plane, line, name, start us from the range's start, duration us), host
    events of at least `min_us` and every device event; and the host events' total us per call."""
    calls = sorted((e for e in events if e[2].startswith(RANGE)), key=lambda e: e[3])
    if not calls:
        raise ValueError(f"no {RANGE!r} range in the trace")
    out = []
    for c in calls[2:2 + keep] or calls[-keep:]:
        t0, t1 = c[3], c[3] + c[4]
        rows = sorted((e for e in events if t0 <= e[3] <= t1 and e is not c), key=lambda e: e[3])
        out.append([(p[:40], ln[:40], n[:90], round((s - t0) / 1e3, 1), round(d / 1e3, 1)) for p, ln, n, s, d in rows
                    if d >= min_us * 1e3 or p.startswith("/device")])
    per_call = collections.Counter()
    for p, _, n, _, d in events:
        if not p.startswith("/device"):
            per_call[n] += d / 1e3 / len(calls)
    return out, per_call.most_common(40)


def summary(line) -> dict:
    """From one call's timeline: the call's span, the first device event's start and the last
    device event's end (us from the call's start); None where no device event was traced."""
    dev = [e for e in line if e[0].startswith("/device")]
    span = max((s + d for _, _, n, s, d in line if n.startswith(("$api.py", "PjitFunction"))), default=None)
    if not dev:
        return dict(first_kernel_us=None, last_kernel_end_us=None, span_us=span)
    return dict(first_kernel_us=min(e[3] for e in dev), last_kernel_end_us=max(e[3] + e[4] for e in dev),
                span_us=span)


def _context(impl: str):
    """The module settings an impl string names (chunk / chunk_mosaic:key=value/...), traced under."""
    name, _, opt = impl.partition(":")
    if not opt:
        return name, contextlib.nullcontext
    if name not in ("chunk", "chunk_mosaic"):
        raise ValueError(f"--impl {impl!r}: settings after ':' are taken for chunk and chunk_mosaic only")
    return name, lambda: chunk.settings(**chunk_settings(opt))


def measure(shape, impl: str, calls: int, min_us: float, iters: int) -> dict:
    name, context = _context(impl)
    with context():  # the jitted calls trace on their first call, inside
        return _measure(shape, name, impl, calls, min_us, iters)


def _measure(shape, name: str, impl: str, calls: int, min_us: float, iters: int) -> dict:
    x = make_inputs(shape)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    fwd = jax.jit(lambda q, k, v, g, beta: kda(q, k, v, g, beta, lower_bound=LOWER_BOUND, impl=name)[0])
    trivial = jax.jit(lambda q, k, v, g, beta: beta * 2)
    res = dict(shape=list(shape), impl=impl, flags=os.environ.get("XLA_FLAGS", ""),
               device=jax.devices()[0].device_kind)
    jax.block_until_ready(fwd(*args))
    for name, fn in (("fwd", fwd), ("trivial", trivial)):
        res[name + "_call_ms"] = time_jax(fn, *args, warmup=3, iters=iters)
        res[name + "_stream_ms"] = time_jax_stream(fn, *args, warmup=3, iters=iters)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for i in range(calls):
            with jax.profiler.TraceAnnotation(f"{RANGE}{i}"):
                jax.block_until_ready(fwd(*args))
        jax.profiler.stop_trace()
        events = _events(tmp)
    res["timeline"], res["host_top_us_per_call"] = timeline(events, min_us)
    res["summary"] = [summary(line) for line in res["timeline"]]
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x4096x16x128", help="BxTxHxD")
    p.add_argument("--impl", default="chunk_mosaic")
    p.add_argument("--calls", type=int, default=5, help="traced per-call iterations (the first two are not kept)")
    p.add_argument("--iters", type=int, default=30, help="timed calls each way")
    p.add_argument("--min_us", type=float, default=2.0, help="host events shorter than this are left out of the timeline")
    p.add_argument("--quick", action="store_true", help="1x128x2x64, impl chunk, 3 traced calls, 3 timed")
    p.add_argument("--out", help="JSON path (default benchmarks/results/kda-call-<time>.json)")
    a = p.parse_args(argv)
    if a.quick:
        a.shape, a.impl, a.calls, a.iters = "1x128x2x64", "chunk", 3, 3
    if a.calls < 1 or a.iters < 1:
        raise ValueError(f"--calls and --iters must be positive; got {a.calls}, {a.iters}")
    _check_impl(a.impl)
    res = measure(_parse_shapes(a.shape)[0], a.impl, a.calls, a.min_us, a.iters)
    print({k: v for k, v in res.items() if k.endswith("_ms")}, flush=True)
    for row in res["summary"]:
        print(row)
    path = write_json(dict(env=environment(), result=res), a.out, "kda-call")
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()

"""Timing, environment and reporting helpers shared by the benchmark scripts.

Times are medians in milliseconds over `iters` calls after `warmup` calls; JAX results are waited
for with `block_until_ready`, PyTorch with `torch.cuda.synchronize`. A failing case is recorded
with its error and never aborts a run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
import traceback

# Peak figures of one NVIDIA H200 (bf16 dense tensor cores, HBM3e) used for the roofline columns.
PEAK_TFLOPS = 790.0
PEAK_TBPS = 4.3


def time_jax(fn, *args, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of `fn(*args)` in ms (compiled and warmed up first)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _stream_ms(call, wait, warmup: int, iters: int, bursts: int) -> float:
    """Median over `bursts` of the mean ms per call of `iters` calls dispatched back to back, one
    `wait(last output)` at the end of each; an untimed burst runs first."""
    for _ in range(warmup):
        wait(call())

    def burst():
        t0 = time.perf_counter()
        for _ in range(iters):  # only the newest output is kept: one stream runs the calls in order
            out = call()
        wait(out)
        return 1e3 * (time.perf_counter() - t0) / iters

    burst()
    return statistics.median(burst() for _ in range(bursts))


def time_jax_stream(fn, *args, warmup: int = 3, iters: int = 50, bursts: int = 3) -> float:
    """Median over `bursts` of the mean ms per call of `iters` calls dispatched back to back, one
    wait at the end: the device time of a short kernel, which the per-call `time_jax` (dispatch +
    wait each call) overstates by the host's round trip (tens of microseconds). One untimed burst
    runs first: calls in flight each hold their own outputs, and the first burst grows the
    allocator's pool (synchronous device allocations) for whichever case is timed first."""
    import jax

    return _stream_ms(lambda: fn(*args), jax.block_until_ready, warmup, iters, bursts)


def time_torch_stream(fn, *, warmup: int = 3, iters: int = 50, bursts: int = 3) -> float:
    """`time_jax_stream` for a PyTorch callable on the current CUDA device."""
    import torch

    return _stream_ms(fn, lambda _: torch.cuda.synchronize(), warmup, iters, bursts)


def time_torch(fn, *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of `fn()` in ms on the current CUDA device."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def device_profile(compiled, args, calls: int, top: int = 25, folder: str | None = None, scopes=(),
                   hlo: str | None = None) -> dict:
    """Device kernels of `calls` back-to-back calls of a compiled JAX program (after two untraced
    ones), per call, by `kimi_jax.profile_summary.summarize` (`scopes`: named scopes to sum them
    by): where a measured time goes, and whether the device or the host's dispatch bounds it
    (kernel ms per call against the timed ms). The trace goes to `folder` (default: a temporary one);
    `hlo`: the program's text if the caller has it already (else `compiled.as_text()`)."""
    import tempfile

    import jax

    from kimi_jax import profile_summary

    with tempfile.TemporaryDirectory() as tmp:
        folder = folder or tmp
        jax.block_until_ready(compiled(*args))
        jax.block_until_ready(compiled(*args))
        jax.profiler.start_trace(folder)
        for _ in range(calls):
            out = compiled(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        del out
        hlo = compiled.as_text() if hlo is None else hlo
        return profile_summary.summarize(folder, hlo, calls, top, scopes_in_part=scopes)


def attempt(fn):
    """(value, None) or (None, one-line error) so that one failure does not end the run."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any failure of a peer or impl is reported, not raised
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return None, last[:300]


def module_version(name: str) -> str | None:
    try:
        mod = __import__(name)
    except Exception:  # noqa: BLE001 - an absent or broken package has no version
        return None
    return getattr(mod, "__version__", "unknown")


def environment() -> dict:
    """Date, host, device and package versions for the results file."""
    import jax

    dev = jax.devices()[0]
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(),
        python=platform.python_version(),
        jax=jax.__version__,
        platform=dev.platform,
        device=getattr(dev, "device_kind", str(dev)),
        torch=module_version("torch"),
        fla=module_version("fla"),
        jla=module_version("jla"),
    )
    return env


def roofline(ms: float | None, flops: float, nbytes: float) -> tuple[float | None, float | None]:
    """Achieved (TFLOP/s, GB/s) for a time in ms."""
    if not ms:
        return None, None
    s = ms * 1e-3
    return flops / s / 1e12, nbytes / s / 1e9


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(obj: dict, out: str | None, stem: str) -> str:
    """Write `obj` to `out`, or to benchmarks/results/<stem>-<UTC time>.json; returns the path."""
    if out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{stem}-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    return out

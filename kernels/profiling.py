"""In-kernel timelines of the Mosaic GPU kernels: Mosaic GPU's profiler records, per warpgroup, the
global timer at the entry and exit of every `jax.named_scope` inside a kernel body and writes
them as a Chrome trace, `<kernel>-<ns>-trace.json`. Pallas fixes that name when it lowers the
kernel, so a compiled program writes its traces on its first call only (later calls find the
files there and skip them, with a warning).

Kernels opt in by building their compiler parameters with `compiler_params(...)`; the profiler is
off (no cost, no extra SMEM) unless a caller traces them inside `profiled(folder)`. Read while
tracing, so a jitted function must be traced afresh inside the block.
`benchmarks/mosaic_phases.py` summarises the traces: the time per named phase of a kernel.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

# (folder, events per warpgroup) while `profiled` is active.
_PROFILE: tuple[str, int] | None = None


@contextlib.contextmanager
def profiled(folder: str, space: int = 64):
    """Within the block, kernels traced with `compiler_params` record up to `space` scope
    entries and exits per warpgroup and dump their traces to `folder`."""
    global _PROFILE
    if space < 1:
        raise ValueError(f"profiler space must be positive, got {space}")
    _require_cpu_backend()
    os.makedirs(folder, exist_ok=True)
    old, _PROFILE = _PROFILE, (folder, int(space))
    try:
        yield folder
    finally:
        _PROFILE = old


def _require_cpu_backend():
    """Mosaic GPU writes its traces from a host callback, which needs JAX's CPU backend; without
    it the kernel runs and the dump fails only at the end, after the whole run."""
    import jax

    try:
        jax.devices("cpu")
    except RuntimeError as e:
        raise RuntimeError("the Mosaic GPU profiler writes its traces through a host callback, which "
                           "needs the CPU backend: add cpu to JAX_PLATFORMS (e.g. JAX_PLATFORMS=cuda,cpu)") from e


def phases():
    """`phase(name)` ends the current phase's named scope and starts `name`'s (None: just ends
    it): a kernel body's consecutive phases as profiler ranges, without re-indenting it."""
    import jax

    stack = contextlib.ExitStack()

    def phase(name: str | None):
        stack.close()
        if name is not None:
            stack.enter_context(jax.named_scope(name))

    return phase


def active() -> tuple[str, int] | None:
    """The profiler's (folder, space) inside `profiled`, else None: a static argument of the
    launchers that are jits (`kernels.lowering`), so a trace inside the block is a trace of its own."""
    return _PROFILE


def compiler_params(**kwargs) -> plgpu.CompilerParams:
    """plgpu.CompilerParams(**kwargs), with the profiler's fields inside `profiled`."""
    if _PROFILE is not None:
        folder, space = _PROFILE
        kwargs.update(profile_dir=folder, profile_space=space, profile_bounds_check=True)
    return plgpu.CompilerParams(**kwargs)


def phase_times(trace: dict) -> dict:
    """One Chrome trace of one kernel call -> {"programs": warpgroup timelines, "kernel_us": first
    entry to last exit over all of them, "phases": {name: {"count", "mean_us", "total_us",
    "share"}}}: per named scope, its ranges' mean duration on a warpgroup and the share of the
    warpgroups' summed busy time (first entry to last exit of each) it takes. Nested scopes count
    in their own and their parents' rows."""
    stacks: dict[int, list] = {}
    spans: dict[int, list[float]] = {}
    durations: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        tid, ts = e["tid"], float(e["ts"])
        span = spans.setdefault(tid, [ts, ts])
        span[0], span[1] = min(span[0], ts), max(span[1], ts)
        if e["ph"] == "B":
            stacks.setdefault(tid, []).append((e["name"], ts))
        elif e["ph"] == "E":
            if not stacks.get(tid) or stacks[tid][-1][0] != e["name"]:
                raise ValueError(f"unbalanced trace: exit of {e['name']!r} on timeline {tid} without its entry")
            name, start = stacks[tid].pop()
            durations.setdefault(name, []).append(ts - start)
    if any(stacks.values()):
        raise ValueError("unbalanced trace: scopes entered but never exited")
    busy = sum(b - a for a, b in spans.values())
    phases = {name: dict(count=len(d), mean_us=float(np.mean(d)), total_us=float(np.sum(d)),
                         share=float(np.sum(d) / busy) if busy else 0.0) for name, d in durations.items()}
    starts = [a for a, _ in spans.values()]
    ends = [b for _, b in spans.values()]
    return dict(programs=len(spans), kernel_us=(max(ends) - min(starts)) if spans else 0.0,
                mean_program_us=busy / len(spans) if spans else 0.0, phases=phases)


def read_traces(folder: str) -> list[dict]:
    """`phase_times` of every `<kernel>-<ns>-trace.json` in `folder` (also `<ns>-trace.json`, the
    name of Mosaic GPU's own kernels), in the order they were named, each with its kernel's name."""
    found = []
    for name in os.listdir(folder):
        if name.endswith("-trace.json"):
            kernel, _, ns = name[: -len("-trace.json")].rpartition("-")
            found.append((int(ns), kernel, name))
    out = []
    for _, kernel, name in sorted(found):
        with open(os.path.join(folder, name)) as f:
            out.append(dict(file=name, kernel=kernel, **phase_times(json.load(f))))
    return out

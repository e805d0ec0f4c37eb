"""Why our Mosaic GPU kernels wait: Nsight Compute's warp stall reasons, per kernel.

    JAX_PLATFORMS=cuda python benchmarks/ncu_stalls.py [--cases kda_intra_bf16,kda_fwd] [--out J]

Each case of `benchmarks/mosaic_ptxas.py` (same ops, same shapes) runs in a child process under
`ncu` (Nsight Compute, from the CUDA toolkit): the call once to compile, then once measured; only
the measured call's Mosaic GPU launches (`*_mosaic_gpu_kernel`) are kept. Per kernel: its duration,
instructions issued, and for each stall reason the cycles a warp spends in it per issued
instruction (`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`; they sum to the
cycles between a warp's instructions). "no_instruction" is instruction fetch: a kernel whose
straight-line code outgrows the instruction cache stalls there (`mosaic_ptxas.py` gives each
kernel's code size); "long_scoreboard" is local / global memory (spills among it), "barrier" the
warpgroup barriers, "wait" fixed latencies, "gmma" the tensor cores.

Needs a Hopper GPU and `ncu` on PATH or under MOSAIC_GPU_CUDA_ROOT / /usr/local/cuda, with access to
the GPU's performance counters.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STALL = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
# What each pipe is busy with, as a share of its peak while the SM is active: "tensor_op_gmma" is
# wgmma (a kernel near 100% there is bound by the tensor cores, not by its chains), "xu" the
# special functions (ex2), "issue_active" the schedulers' issue slots.
PIPES = (r"regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active",
         r"regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active",
         "smsp__issue_active.avg.pct_of_peak_sustained_active")
PIPE_PREFIXES = ("sm__pipe_", "sm__inst_executed_pipe_", "smsp__issue_active")
METRICS = ("gpu__time_duration.sum", "smsp__inst_executed.sum", f"regex:{STALL}.*{STALL_SUFFIX}", *PIPES)
KERNELS = "regex:mosaic_gpu_kernel"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_csv(text: str) -> list[dict]:
    """`ncu --csv` output -> one dict per profiled launch, in launch order: kernel, duration_ms,
    instructions, stalls {reason: cycles per issued instruction} (reasons with a value)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line and '"Metric Name"' in line), None)
    if start is None:
        return []
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID") or row.get("Metric Name") is None:
            continue
        launch = launches.setdefault(row["ID"], dict(kernel=row["Kernel Name"].split("(")[0].strip(), duration_ms=None,
                                                     instructions=None, stalls={}, pipes={}))
        name, unit, value = row["Metric Name"], (row.get("Metric Unit") or "").strip(), _number(row["Metric Value"])
        if name == "gpu__time_duration.sum" and value is not None:
            launch["duration_ms"] = value * {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6, "ms": 1.0,
                                              "msecond": 1.0, "s": 1e3, "second": 1e3}.get(unit, float("nan"))
        elif name == "smsp__inst_executed.sum":
            launch["instructions"] = value
        elif name.startswith(STALL) and name.endswith(STALL_SUFFIX) and value is not None:
            launch["stalls"][name[len(STALL):-len(STALL_SUFFIX)]] = value
        elif name.startswith(PIPE_PREFIXES) and value is not None:
            short = name.split(".avg.")[0].replace("sm__pipe_", "").replace("sm__inst_executed_pipe_", "inst_")
            launch["pipes"][short.replace("_cycles_active", "").replace("smsp__", "")] = value
    return list(launches.values())


def summary(launch: dict) -> dict:
    """The launch with its stalls sorted (largest first), their total, and each one's share."""
    stalls = dict(sorted(launch["stalls"].items(), key=lambda kv: -kv[1]))
    total = sum(v for k, v in stalls.items() if k != "selected")  # "selected" is the issue cycle itself
    pipes = dict(sorted(launch.get("pipes", {}).items(), key=lambda kv: -kv[1]))
    return dict(launch, stalls=stalls, pipes=pipes, stall_cycles=total,
                shares={k: v / total for k, v in stalls.items() if total and k != "selected"})


def markdown(results: list[dict]) -> str:
    from benchmarks.common import markdown_table

    rows = []
    for r in results:
        for k in r.get("kernels", []):
            top = ", ".join(f"{name} {v:.2f} ({k['shares'].get(name, 0):.0%})" for name, v in list(k["stalls"].items())[:4])
            busy = ", ".join(f"{name} {v:.0f}%" for name, v in list(k.get("pipes", {}).items())[:4])
            rows.append([r["case"], k["kernel"], f"{k['duration_ms']:.3f}" if k["duration_ms"] is not None else "–",
                         f"{k['instructions']:.3g}" if k["instructions"] else "–", f"{k['stall_cycles']:.1f}", top, busy or "–"])
        if not r.get("kernels"):
            rows.append([r["case"], r.get("error", "no Mosaic GPU launch profiled"), "", "", "", "", ""])
    return markdown_table(["case", "kernel", "ms", "instructions", "stall cycles / instruction", "top stalls",
                           "busiest pipes (% of peak)"], rows)


def _child(case: str) -> None:
    """Run in the ncu child: the case compiled and run once, then once more (the measured call)."""
    import jax

    from benchmarks.mosaic_ptxas import CASES

    fn, args = CASES[case]()
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*args))


def run_case(case: str, ncu: str, timeout: int) -> dict:
    cmd = [ncu, "--csv", "--print-units", "base", "--target-processes", "all", "-k", KERNELS, "--metrics", ",".join(METRICS),
           sys.executable, os.path.abspath(__file__), "--child", case]
    # kda_train ran past 300 s under ncu (ncu-stalls-intra-h100-20261205T1921.json). XLA's GEMM
    # autotuning launches many candidate kernels while compiling, each intercepted by ncu, so the
    # child compiles without it; the Mosaic kernels measured here are not autotuned.
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    launches = [summary(x) for x in parse_csv(proc.stdout)]
    if proc.returncode or not launches:
        tail = (proc.stderr or proc.stdout)[-800:]
        return dict(case=case, kernels=[], error=f"ncu exited {proc.returncode}, {len(launches)} launches: {tail}")
    # Both calls launch the same kernels in the same order: keep the second half (the measured call).
    if len(launches) % 2:
        return dict(case=case, kernels=[], error=f"{len(launches)} launches: not two equal calls")
    return dict(case=case, kernels=launches[len(launches) // 2:])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="kda_intra_bf16", help="comma-separated cases of benchmarks/mosaic_ptxas.py")
    p.add_argument("--timeout", type=int, default=300, help="seconds per case")
    p.add_argument("--out", help="JSON path (default benchmarks/results/ncu-stalls-<time>.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child)
        return []
    from benchmarks.common import environment, write_json
    from benchmarks.mosaic_ptxas import cuda_tool, run_cases

    def run(name):
        ncu = cuda_tool("ncu")
        if ncu is None:
            raise SystemExit("ncu_stalls needs Nsight Compute's ncu (on PATH, or under MOSAIC_GPU_CUDA_ROOT/bin)")
        try:
            return run_case(name, ncu, a.timeout)
        except subprocess.TimeoutExpired:
            return dict(case=name, kernels=[], error=f"ncu took more than {a.timeout} s")

    results = run_cases(p, a.cases, run, markdown, "ncu_stalls", "the kernels run nowhere else")
    path = write_json(dict(env=environment(), metrics=list(METRICS), results=results), a.out, "ncu-stalls")
    print(f"wrote {path}", flush=True)
    return results


if __name__ == "__main__":
    main()

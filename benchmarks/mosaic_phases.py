"""Where the time goes inside our Mosaic GPU kernels: per named phase, from Mosaic GPU's profiler.

    JAX_PLATFORMS=cuda,cpu python benchmarks/mosaic_phases.py [--cases kda_fwd,kda_train] [--out J]

Each case of `benchmarks/mosaic_ptxas.py` (same ops, same shapes) is traced inside
`kernels.profiling.profiled`, so the kernels that opt in (the bf16 intra kernel with its phases
load, cumsum, row_side, scores, inverse, wy, store; the chunk-walking kernels of
`mosaic_state.launch_bh_v` as one range each) record every warpgroup's entry and exit of each
phase. The case runs once as a warm-up, then once compiled with the profiler; its traces (one per
kernel launch) are summarised by `kernels.profiling.phase_times`: the kernel's span, the mean busy time of one program, and per
phase its mean duration and share of the programs' busy time. A kernel that is slow as a whole
(the intra kernel: 10% of its memory roofline) shows here which phase to rewrite. The profiler
costs a few cycles per recorded event.

Needs a Hopper GPU (the interpreter records nothing) and JAX's CPU backend (the traces are written
by host callbacks); a JAX_PLATFORMS without cpu gets it appended.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.environ.get("JAX_PLATFORMS") and "cpu" not in os.environ["JAX_PLATFORMS"].split(","):
    os.environ["JAX_PLATFORMS"] += ",cpu"

import jax  # noqa: E402

from benchmarks.common import environment, markdown_table, write_json  # noqa: E402
from benchmarks.mosaic_ptxas import CASES, run_cases  # noqa: E402
from kernels import profiling  # noqa: E402


def run_case(name: str, space: int) -> dict:
    """Case `name` run once without the profiler (warm-up), then compiled with it and run once:
    its kernel launches' summaries (a profiled program writes its traces on its first call only)."""
    fn, args = CASES[name]()
    jax.block_until_ready(jax.jit(fn)(*args))
    with tempfile.TemporaryDirectory() as folder:
        with profiling.profiled(folder, space):
            profiled = jax.jit(lambda *a: fn(*a))  # a new function: traced with the profiler's parameters
            jax.block_until_ready(profiled(*args))
            jax.effects_barrier()  # the trace dumps run as host callbacks
        kernels = profiling.read_traces(folder)
    return dict(case=name, doc=CASES[name].__doc__, kernels=kernels)


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        if not r["kernels"]:
            rows.append([r["case"], "-", "no trace (" + (r.get("error") or "no kernel opted in") + ")", "", "", "", ""])
        for i, k in enumerate(r["kernels"]):
            for name, p in sorted(k["phases"].items(), key=lambda kv: -kv[1]["total_us"]):
                rows.append([r["case"], f"{i} {k.get('kernel', '')}: {k['kernel_us']:.1f} us, {k['programs']} programs of "
                             f"{k['mean_program_us']:.1f} us", name, str(p["count"]), f"{p['mean_us']:.2f}",
                             f"{100 * p['share']:.1f}%", ""])
    return markdown_table(["case", "kernel launch", "phase", "ranges", "mean us", "share of busy time", ""], rows)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="kda_fwd,kda_train", help=f"comma-separated subset of {list(CASES)}")
    p.add_argument("--space", type=int, default=64, help="profiler events per warpgroup")
    p.add_argument("--out", help="JSON path (default benchmarks/results/mosaic-phases-<time>.json)")
    a = p.parse_args(argv)
    results = run_cases(p, a.cases, lambda n: run_case(n, a.space), markdown, "mosaic_phases",
                        "the interpreter records no profile")
    path = write_json(dict(env=environment(), space=a.space, results=results), a.out, "mosaic-phases")
    print(f"wrote {path}", flush=True)
    return results


if __name__ == "__main__":
    main()

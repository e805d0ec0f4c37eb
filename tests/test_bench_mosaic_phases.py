"""benchmarks/mosaic_phases.py: the second call's traces are the ones summarised, the table, and
the refusal to run where nothing is recorded."""

import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "mosaic_phases", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "mosaic_phases.py"))
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_profiled_call_traces_are_summarised(monkeypatch):
    """A stand-in case writes a trace whenever it runs under the profiler, as a profiled kernel's
    dump does: the warm-up call writes none, the profiled call one, which is summarised."""
    from kernels import profiling

    calls = []

    def write_trace(x):
        calls.append(profiling._PROFILE is not None)
        if profiling._PROFILE is None:
            return
        events = [{"name": "load", "ph": "B", "ts": 0, "pid": 1, "tid": 1},
                  {"name": "load", "ph": "E", "ts": 2.0, "pid": 1, "tid": 1}]
        with open(os.path.join(profiling._PROFILE[0], f"stand_in-{time.time_ns()}-trace.json"), "x") as f:
            json.dump({"traceEvents": events}, f)

    def case():
        def fn(x):
            jax.debug.callback(write_trace, x)
            return x + 1

        return fn, (jnp.ones(2),)

    monkeypatch.setitem(bench.CASES, "stand_in", case)
    out = bench.run_case("stand_in", space=8)
    assert calls == [False, True] and len(out["kernels"]) == 1 and out["kernels"][0]["kernel"] == "stand_in"
    assert out["kernels"][0]["phases"]["load"]["mean_us"] == 2.0
    md = bench.markdown([out, dict(case="gmm", kernels=[], error="boom")])
    assert "| stand_in | 0 stand_in: 2.0 us, 1 programs of 2.0 us | load | 1 | 2.00 | 100.0% |" in md and "boom" in md


def test_refuses_without_a_hopper_gpu():
    with pytest.raises(SystemExit, match="Hopper GPU"):
        bench.main(["--cases", "kda_fwd"])
    with pytest.raises(SystemExit):
        bench.main(["--cases", "nothing"])

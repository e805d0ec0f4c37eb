"""kernels.profiling: compiler parameters on and off, phase scopes in the traced program, and the
phase summary of a Chrome trace against hand-worked numbers."""

import json

import jax
import jax.numpy as jnp
import pytest

from kernels import profiling


def _ev(name, ph, ts, tid):
    return {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}


def test_compiler_params_carry_the_profiler_only_inside_profiled(tmp_path):
    off = profiling.compiler_params(approx_math=True)
    assert off.approx_math and off.profile_space == 0 and off.profile_dir == ""
    with profiling.profiled(str(tmp_path / "p"), space=32):
        on = profiling.compiler_params(approx_math=True)
        assert on.profile_space == 32 and on.profile_dir == str(tmp_path / "p") and on.approx_math
    assert profiling.compiler_params().profile_space == 0
    with pytest.raises(ValueError, match="positive"):
        with profiling.profiled(str(tmp_path), space=0):
            pass


def test_profiled_refuses_without_a_cpu_backend(tmp_path, monkeypatch):
    def no_cpu(backend=None):
        raise RuntimeError(f"Unknown backend {backend}")

    monkeypatch.setattr(jax, "devices", no_cpu)
    with pytest.raises(RuntimeError, match="JAX_PLATFORMS"):
        with profiling.profiled(str(tmp_path / "p")):
            pass
    assert profiling.compiler_params().profile_space == 0


def test_phases_name_consecutive_parts_of_a_program():
    def f(x):
        phase = profiling.phases()
        phase("first")
        y = jnp.sin(x)
        phase("second")
        z = jnp.cos(y)
        phase(None)
        return z * 2

    eqns = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
    scopes = [str(e.source_info.name_stack) for e in eqns]
    assert scopes == ["first", "second", ""]


def test_phase_times_hand_worked(tmp_path):
    """Two warpgroups: A (tid 1) load 0-2, math 2-7 with a nested mma 3-5; B (tid 2) load 1-4,
    math 4-6. Busy: 7 + 5 = 12 us; kernel 0-7 us."""
    trace = {"traceEvents": [
        _ev("load", "B", 0, 1), _ev("load", "E", 2, 1), _ev("math", "B", 2, 1), _ev("mma", "B", 3, 1),
        _ev("mma", "E", 5, 1), _ev("math", "E", 7, 1),
        _ev("load", "B", 1, 2), _ev("load", "E", 4, 2), _ev("math", "B", 4, 2), _ev("math", "E", 6, 2)]}
    out = profiling.phase_times(trace)
    assert out["programs"] == 2 and out["kernel_us"] == 7 and out["mean_program_us"] == 6
    ph = out["phases"]
    assert ph["load"] == dict(count=2, mean_us=2.5, total_us=5.0, share=5 / 12)
    assert ph["math"] == dict(count=2, mean_us=3.5, total_us=7.0, share=7 / 12)
    assert ph["mma"] == dict(count=1, mean_us=2.0, total_us=2.0, share=2 / 12)
    # Pallas names a trace <kernel>-<ns>-trace.json (kernel names may hold "-" too), Mosaic GPU <ns>-trace.json
    (tmp_path / "intra_body-300-trace.json").write_text(json.dumps(trace))
    (tmp_path / "state-kernel-200-trace.json").write_text(json.dumps({"traceEvents": trace["traceEvents"][:2]}))
    (tmp_path / "100-trace.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "notes.txt").write_text("not a trace")
    files = profiling.read_traces(str(tmp_path))
    assert [(f["file"], f["kernel"]) for f in files] == [
        ("100-trace.json", ""), ("state-kernel-200-trace.json", "state-kernel"), ("intra_body-300-trace.json", "intra_body")]
    assert files[1]["phases"] == {"load": dict(count=1, mean_us=2.0, total_us=2.0, share=1.0)}
    assert files[0]["programs"] == 0 and files[2]["programs"] == 2


def test_unbalanced_traces_are_refused():
    with pytest.raises(ValueError, match="without its entry"):
        profiling.phase_times({"traceEvents": [_ev("a", "E", 1, 1)]})
    with pytest.raises(ValueError, match="never exited"):
        profiling.phase_times({"traceEvents": [_ev("a", "B", 1, 1)]})

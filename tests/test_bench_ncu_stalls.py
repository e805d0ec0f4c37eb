"""benchmarks/ncu_stalls.py: parsing Nsight Compute's CSV into per-kernel stall reasons, the
table, and the refusal to run without a Hopper GPU."""

import importlib.util
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ncu_stalls", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "ncu_stalls.py"))
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(i, kernel, metric, unit, value):
    return (f'"{i}","7","python","vm","{kernel}","1","13","(128, 1, 1)","(8192, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def _stall(reason):
    return f"{bench.STALL}{reason}{bench.STALL_SUFFIX}"


CSV = "\n".join([
    "==PROF== Connected to process 7",
    "ran",  # the program's own output comes first
    HEAD,
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", "gpu__time_duration.sum", "nsecond", "2520000"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", "smsp__inst_executed.sum", "inst", "302,940,355"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", _stall("no_instruction"), "inst", "6.72"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", _stall("long_scoreboard"), "inst", "2.08"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", _stall("selected"), "inst", "1.00"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", _stall("imc_miss"), "inst", "n/a"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
         "%", "41.5"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "%", "12"),
    _row(0, "kda_intra_bf16_mosaic_gpu_kernel", "smsp__issue_active.avg.pct_of_peak_sustained_active", "%", "55.25"),
    _row(1, "kda_mosaic_state_body_mosaic_gpu_kernel", "gpu__time_duration.sum", "usecond", "260.5"),
    _row(1, "kda_mosaic_state_body_mosaic_gpu_kernel", _stall("wait"), "inst", "3.0"),
])


def test_parse_csv_one_entry_per_launch_in_order():
    launches = bench.parse_csv(CSV)
    assert [x["kernel"] for x in launches] == ["kda_intra_bf16_mosaic_gpu_kernel", "kda_mosaic_state_body_mosaic_gpu_kernel"]
    intra, state = launches
    assert intra["duration_ms"] == pytest.approx(2.52) and intra["instructions"] == 302940355
    assert intra["stalls"] == {"no_instruction": 6.72, "long_scoreboard": 2.08, "selected": 1.0}
    assert intra["pipes"] == {"tensor_op_gmma": 41.5, "inst_xu": 12.0, "issue_active": 55.25}
    assert state["pipes"] == {}
    assert state["duration_ms"] == pytest.approx(0.2605) and state["instructions"] is None
    assert bench.parse_csv("no table here\n") == []


def test_summary_orders_stalls_and_leaves_out_the_issue_cycle():
    s = bench.summary(bench.parse_csv(CSV)[0])
    assert list(s["stalls"]) == ["no_instruction", "long_scoreboard", "selected"]
    assert s["stall_cycles"] == pytest.approx(8.8)
    assert s["shares"]["no_instruction"] == pytest.approx(6.72 / 8.8) and "selected" not in s["shares"]
    md = bench.markdown([dict(case="kda_intra_bf16", kernels=[s]), dict(case="gmm", kernels=[], error="boom")])
    assert "| kda_intra_bf16 | kda_intra_bf16_mosaic_gpu_kernel | 2.520 | 3.03e+08 | 8.8 | no_instruction 6.72 (76%)" in md
    assert "| issue_active 55%, tensor_op_gmma 42%, inst_xu 12% |" in md
    assert list(s["pipes"]) == ["issue_active", "tensor_op_gmma", "inst_xu"]
    assert "boom" in md


def test_refuses_without_a_hopper_gpu_and_unknown_cases():
    with pytest.raises(SystemExit, match="Hopper GPU"):
        bench.main(["--cases", "kda_intra_bf16"])
    with pytest.raises(SystemExit):
        bench.main(["--cases", "kda_everything"])


def test_run_case_keeps_the_measured_call(monkeypatch):
    """The child runs the case twice; of each kernel's launches only the second call's are kept, and
    an odd count or a failing ncu is recorded as the case's error."""
    import subprocess

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        assert "--xla_gpu_autotune_level=0" in kwargs["env"]["XLA_FLAGS"]  # no GEMM autotuning under ncu
        return subprocess.CompletedProcess(cmd, 0, stdout=fake_run.stdout, stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    rows = [HEAD]
    for i, (kernel, ms) in enumerate([("a_mosaic_gpu_kernel", 9.0), ("b_mosaic_gpu_kernel", 8.0),
                                      ("a_mosaic_gpu_kernel", 2.0), ("b_mosaic_gpu_kernel", 1.0)]):
        rows.append(_row(i, kernel, "gpu__time_duration.sum", "msecond", str(ms)))
        rows.append(_row(i, kernel, _stall("no_instruction"), "inst", "3.0"))
    fake_run.stdout = "\n".join(rows)
    out = bench.run_case("kda_intra_bf16", "ncu", timeout=10)
    assert [(k["kernel"], k["duration_ms"]) for k in out["kernels"]] == [("a_mosaic_gpu_kernel", 2.0),
                                                                        ("b_mosaic_gpu_kernel", 1.0)]
    cmd = calls[0]
    assert cmd[0] == "ncu" and "--csv" in cmd and cmd[-2:] == ["--child", "kda_intra_bf16"]
    fake_run.stdout = "\n".join(rows[:-2])
    assert "not two equal calls" in bench.run_case("kda_intra_bf16", "ncu", timeout=10)["error"]
    fake_run.stdout = "==ERROR== profiling is not supported"
    assert "0 launches" in bench.run_case("kda_intra_bf16", "ncu", timeout=10)["error"]

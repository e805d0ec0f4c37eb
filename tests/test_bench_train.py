"""benchmarks/train.py beyond the quick run (tests/test_train.py): the compile-only path reports
compile times and the step's memory for each remat policy, and a failing row is recorded while
the next row runs."""

import importlib.util
import json
import os

import numpy as np
import pytest

from kimi_jax import profile_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train", os.path.join(ROOT, "benchmarks", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compile_only_reports_memory(bench, tmp_path):
    out = tmp_path / "c.json"
    result = bench.main(["--quick", "--devices", "2", "--compile_only", "--remat", "dots", "--out", str(out)])
    (row,) = result["rows"]
    assert row["remat"] == "dots" and row["step_compile_s"] > 0 and "step_ms" not in row
    assert row["memory"]["argument_gib"] > 0 and row["memory"]["temp_gib"] >= 0
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert "remat recomputation not counted" in result["flops_counting"]


def test_failing_row_is_recorded_and_the_next_runs(bench, tmp_path, monkeypatch):
    """Two data-parallel devices (64 asked for too: more than present, skipped), batch 1 and 2
    per device; the first row fails to compile, the second runs and is measured (the program
    test_compile_only_reports_memory compiled: a compilation cache hit)."""
    real = bench.compile_row

    def compile_row(row, ctx):
        if row["batch"] == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
        return real(row, ctx)
    monkeypatch.setattr(bench, "compile_row", compile_row)
    out = tmp_path / "r.json"
    result = bench.main(["--quick", "--devices", "2,64", "--batch_size", "1,2", "--remat", "dots", "--steps", "1",
                         "--out", str(out)])
    first, second = result["rows"]
    assert first["error"].startswith("OOM: RESOURCE_EXHAUSTED") and first["batch"] == 2
    assert second["devices"] == 2 and second["batch"] == 2 * 2 and "error" not in second
    assert second["tokens_per_sec"] > 0 and np.isfinite(second["loss"]) and second["flops_per_token"] > 0
    assert second["mfu"] is None  # no peak for a CPU
    assert "OOM" in result["markdown"]
    assert json.loads(out.read_text())["rows"] == result["rows"]


def test_scaling_pairs_rows_of_the_same_policy_and_per_device_batch(bench):
    rows = [dict(devices=1, batch=4, remat="dots", tokens_per_sec=100.0),
            dict(devices=2, batch=8, remat="dots", tokens_per_sec=190.0),
            dict(devices=1, batch=4, remat="dots16", tokens_per_sec=120.0),
            dict(devices=2, batch=8, remat="dots16", tokens_per_sec=200.0),
            dict(devices=2, batch=16, remat="dots", tokens_per_sec=300.0)]  # no 1-device row of 8
    assert bench.scaling(rows) == {"2x4/dots": 0.95, "2x4/dots16": 200.0 / 240.0}


def test_scale_best_runs_the_fastest_one_device_setting_only(bench):
    rows = [dict(devices=1, batch=4, remat="dots", tokens_per_sec=100.0),
            dict(devices=1, batch=8, remat="dots", tokens_per_sec=110.0),
            dict(devices=1, batch=4, remat="full", error="OOM: ...")]
    assert bench.is_best_setting(dict(devices=2, batch=16, remat="dots"), rows)
    assert not bench.is_best_setting(dict(devices=2, batch=8, remat="dots"), rows)
    assert bench.is_best_setting(dict(devices=2, batch=8, remat="dots"), [])  # nothing measured: run it


def test_scale_best_and_deadline_skip_rows_in_the_json(bench, tmp_path, monkeypatch):
    """Two (fake CPU) devices: the two-device row of another setting than the fastest one-device
    row is skipped; past the deadline the one-device rows are skipped and the two-device row
    still runs. Skipped rows say why in the JSON. Rows are not compiled or timed here (the real
    rows run in the other tests): the one-device row without remat is made the fastest."""
    import jax

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")

    def prepare_row(cfg, n, b, seq_len, settings, devices=None):
        return dict(devices=n, batch=b * n, seq_len=seq_len, remat=cfg.remat, settings=settings,
                    device_kind="cpu", params=1e6), None

    def run_row(row, ctx, step, *args):
        assert step == "compiled"
        tps = 100.0 * row["devices"] * (2.0 if row["remat"] == "none" else 1.0)
        row.update(step_ms=1.0, tokens_per_sec=tps, tokens_per_sec_per_device=tps / row["devices"], mfu=None,
                   mfu_vendor=None)

    monkeypatch.setattr(bench, "prepare_row", prepare_row)
    monkeypatch.setattr(bench, "compile_row", lambda row, ctx: row.update(step_compile_s=0.0) or "compiled")
    monkeypatch.setattr(bench, "run_row", run_row)
    for argv, expect in (
            (["--rows", "1:none:1,1:full:1,2:none:1,2:full:1", "--scale_best"],
             {(1, 1, "none"): None, (1, 1, "full"): None, (2, 2, "none"): None, (2, 2, "full"): "fastest"}),
            (["--rows", "1:none:1,2:none:1", "--deadline_s", "1e-9", "--reserve_s", "0"],
             {(1, 1, "none"): "deadline", (2, 2, "none"): None})):
        out = tmp_path / "s.json"
        bench.main(["--quick", *argv, "--out", str(out)])
        rows = {(r["devices"], r["batch"], r["remat"]): r for r in json.loads(out.read_text())["rows"]}
        assert rows.keys() == expect.keys()
        for key, why in expect.items():
            if why is None:
                assert rows[key]["tokens_per_sec"] > 0 and "skipped" not in rows[key], key
            else:
                assert why in rows[key]["skipped"] and "tokens_per_sec" not in rows[key], key


def test_one_step_behind_timing_runs_the_same_steps_as_synchronous_and_profiles(bench, tmp_path):
    """Two devices, remat "dots": the program test_compile_only_reports_memory compiled."""
    rows = {}
    for sync in (False, True):
        argv = ["--quick", "--devices", "2", "--remat", "dots", "--steps", "2", "--out", str(tmp_path / f"{sync}.json")]
        rows[sync] = bench.main(argv + (["--sync"] if sync else ["--profile_steps", "1"]))["rows"][0]
    assert rows[True]["timing"] == "synchronous" and "one step behind" in rows[False]["timing"]
    assert rows[True]["loss"] == rows[False]["loss"]  # the last step's loss, same steps in the same order
    assert all(r["step_ms"] > 0 for r in rows.values())
    # --profile_steps: the traced step's device time by model part, also written beside the trace
    prof = rows[False]["profile"]
    assert {"optimizer", "head", "ffn_mlp"} <= set(prof["by_part"])
    assert any(p.startswith("mixer_") for p in prof["by_part"])
    folder = tmp_path / "False-profile" / "2dev-dots-b4"
    assert json.loads((folder / "summary.json").read_text()) == prof
    assert profile_summary.op_scopes(profile_summary.read_hlo(str(folder / "step.hlo.txt.gz")))


def test_rows_carry_kda_settings_into_tracing_and_keys(bench):
    from kernels.kda import chunk, chunk_intra

    assert bench.parse_row("1:dots16:4") == (1, "dots16", 4, {})
    assert bench.parse_row("2:dots16:4:diag=split/scores=tiled/mesh=fsdp") == (
        2, "dots16", 4, {"diag": "split", "scores": "tiled", "mesh": "fsdp"})
    for bad in ("1:dots16", "1:dots16:4:diag", "1:dots16:4:diag=bf16", "1:dots16:4:tile=16", "2:dots16:4:mesh=tp"):
        with pytest.raises(ValueError):
            bench.parse_row(bad)
    from kimi_jax import layers

    assert bench.parse_row("1:none:4:conv_dw=per_tap") == (1, "none", 4, {"conv_dw": "per_tap"})
    with pytest.raises(ValueError):
        bench.parse_row("1:none:4:conv_dw=tree")
    assert bench.parse_row("1:none:4:layout=row_major")[3] == {"layout": "row_major"}
    with pytest.raises(ValueError):
        bench.parse_row("1:none:4:layout=T_minor")
    from kimi_jax.attention import common

    from kimi_jax import ffn

    assert bench.parse_row("1:none:4:glu_vjp=recompute")[3] == {"glu_vjp": "recompute"}
    with pytest.raises(ValueError):
        bench.parse_row("1:none:4:glu_vjp=fused")
    now = lambda: (chunk_intra.DIAG_MODE, chunk.DEFAULT_SCORES, layers.CONV_DW, common.ACTIVATION_LAYOUT,  # noqa: E731
                   ffn.GLU_VJP, layers.NORM_VJP)
    before = now()
    seen = bench.traced_with({"diag": "split", "scores": "tiled", "mesh": "fsdp", "conv_dw": "per_tap",
                              "layout": "row_major", "glu_vjp": "recompute", "norm_vjp": "recompute"}, now)
    assert seen == ("split", "tiled", "per_tap", "row_major", "recompute", "recompute")
    assert now() == before  # restored
    rows = [dict(devices=1, batch=4, remat="dots16", tokens_per_sec=100.0),
            dict(devices=1, batch=4, remat="dots16", settings={"diag": "split"}, tokens_per_sec=120.0),
            dict(devices=2, batch=8, remat="dots16", settings={"diag": "split"}, tokens_per_sec=216.0),
            dict(devices=2, batch=8, remat="dots16", settings={"mesh": "fsdp"}, tokens_per_sec=190.0)]
    assert bench.scaling(rows) == {"2x4/dots16 diag=split": 0.9, "2x4/dots16 mesh=fsdp": 0.95}
    assert bench.is_best_setting(rows[2], rows)
    assert not bench.is_best_setting(dict(devices=2, batch=8, remat="dots16"), rows)


def test_rows_run_one_device_first_then_largest_temporaries_first(bench):
    rows = [dict(devices=2, memory={"temp_gib": 60.0}), dict(devices=1, memory={"temp_gib": 50.8}),
            dict(devices=1, error="lowering failed"), dict(devices=1, memory={"temp_gib": 88.0}),
            dict(devices=2, memory={"temp_gib": 56.9})]
    assert bench.run_order(rows) == [3, 1, 2, 0, 4]


def test_xla_options_reach_the_compiler(bench, tmp_path):
    from kimi_jax import train_lib

    assert train_lib.xla_options("") == {}
    assert train_lib.xla_options("xla_allow_excess_precision=false, xla_a=3,xla_b=0.5,xla_c=x") == {
        "xla_allow_excess_precision": False, "xla_a": 3, "xla_b": 0.5, "xla_c": "x"}
    for bad in ("allow_excess_precision=false", "xla_allow_excess_precision"):
        with pytest.raises(ValueError, match="xla_options entry"):
            train_lib.xla_options(bad)
    # an option XLA does not know fails the row's compile: the options are passed, not dropped
    (row,) = bench.main(["--quick", "--devices", "1", "--compile_only", "--remat", "none", "--xla_options",
                         "xla_no_such_option=true", "--out", str(tmp_path / "b.json")])["rows"]
    assert row["xla_options"] == {"xla_no_such_option": True} and "No such compile option" in row["error"]


def test_row_dispatch_builds_the_model_with_it(bench, monkeypatch):
    """A row's `dispatch=` is the MoE dispatch its model is traced with (the other rows keep the
    config's); a model without MoE refuses it."""
    import copy

    from kimi_jax import moe_dispatch

    assert bench.parse_row("1:none:2:dispatch=gmm")[3] == {"dispatch": "gmm"}
    with pytest.raises(ValueError, match="expected one of"):
        bench.parse_row("1:none:2:dispatch=fast")
    traced = []
    for name in ("ragged", "gmm"):
        fn = moe_dispatch.DISPATCH[name]
        monkeypatch.setitem(moe_dispatch.DISPATCH, name, lambda *a, _f=fn, _n=name, **k: traced.append(_n) or _f(*a, **k))
    config = bench.load_config(os.path.join(ROOT, "configs", "tiny.py"))
    assert config.model.moe.dispatch == "auto"  # ragged on the CPU (moe_ep.resolve_auto)
    row, _ = bench.prepare_row(copy.deepcopy(config), 1, 1, 16, {"dispatch": "gmm"})
    assert row["settings"] == {"dispatch": "gmm"} and set(traced) == {"gmm"}
    traced.clear()
    bench.prepare_row(copy.deepcopy(config), 1, 1, 16, {})
    assert set(traced) == {"ragged"}
    dense = bench.load_config(os.path.join(ROOT, "configs", "k3_1b3_dense.py") + ":d_model=256,num_layers=1,vocab_size=256")
    with pytest.raises(ValueError, match="has no MoE"):
        bench.prepare_row(dense, 1, 1, 16, {"dispatch": "gmm"})


def test_deviceless_compiles_for_h200s_or_names_the_plugin(bench, tmp_path):
    """--deviceless N: compile only, for N H200s described ahead of time (the CUDA PJRT plugin's
    topology); without the plugin it stops and says what to install."""
    with pytest.raises(ValueError, match="--deviceless"):
        bench.main(["--quick", "--deviceless", "-1"])
    try:
        from benchmarks.mosaic_ptxas import deviceless_devices

        deviceless_devices(2)
    except SystemExit as e:
        assert "CUDA PJRT plugin" in str(e)
        return
    rows = bench.main(["--quick", "--deviceless", "2", "--rows", "2:none:1,1:none:1", "--out", str(tmp_path / "d.json")])["rows"]
    assert [r["devices"] for r in rows] == [2, 1]
    for row in rows:
        assert row["device_kind"] == "NVIDIA H200" and row["memory"]["temp_gib"] > 0, row
        assert "step_ms" not in row  # compiled, never run

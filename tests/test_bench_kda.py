"""benchmarks/kda.py (quick runs on CPU: the op and decode tables, bad arguments) and its Triton cache
handling for fla: the cache folder, the autotuning-result counts and the autotune archive."""

import os

import jax.numpy as jnp
import pytest


def test_benchmark_script_quick(tmp_path):
    """benchmarks/kda.py runs on CPU at a tiny shape, reports skipped peers, and writes its JSON."""
    import json

    from benchmarks import kda as bench

    out = tmp_path / "kda.json"
    bench.main(["--quick", "--shapes", "1x70x1x16", "--impls",
                "chunk,pallas_gpu,chunk:cumsum=matmul/scores=tiled,chunk:block_v=auto", "--peers", "cudnn",
                "--out", str(out)])
    res = json.loads(out.read_text())
    assert {"date", "device", "jax", "torch", "fla"} <= set(res["env"])
    assert res["config"]["shapes"] == [[1, 70, 1, 16]]
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["chunk"]["fwd_ms"] > 0 and rows["chunk"]["fwd_bwd_ms"] > 0 and rows["chunk"]["error"] is None
    assert rows["chunk"]["flops"]["fwd_bwd"] == 3 * rows["chunk"]["flops"]["fwd"]
    assert rows["pallas_gpu"]["fwd_ms"] is None and "skipped" in rows["pallas_gpu"]["error"]
    assert rows["cudnn attention"]["error"]  # no GPU here: reported in the table, not raised
    assert "| 1,70,1,16 | chunk |" in res["table"]
    variant = rows["chunk:cumsum=matmul/scores=tiled"]  # traced under those settings: chunk's values
    assert variant["error"] is None and variant["o_rel_err_vs_chunk"] < 1e-5
    auto = rows["chunk:block_v=auto"]
    assert auto["error"] is None and auto["o_rel_err_vs_chunk"] < 1e-5
    assert auto["block_v"] == 16 and "block_v" not in rows["chunk"]  # one program of 64
    assert bench.chunk_settings("tiled") == {"scores": "tiled"}
    assert bench.chunk_settings("forward_only=chunk") == {"forward_only": "chunk"}
    assert bench.chunk_settings("segments=8/inverse=doubling") == {"segments": 8, "inverse": "doubling"}
    for bad in ("cumsum=prefix", "tile=16", "chunk:nope", "forward_only=pallas", "segments=3"):
        with pytest.raises(ValueError, match="Unknown impl"):
            bench._check_impl(bad if bad.startswith("chunk:") else f"chunk_mosaic:{bad}")


def test_benchmark_forward_only_steps(tmp_path):
    """--steps fwd times the forward alone: no forward+backward time, and the step in the config."""
    import json

    from benchmarks import kda as bench

    out = tmp_path / "kda.json"
    try:
        bench.main(["--quick", "--shapes", "1x70x1x16", "--impls", "chunk", "--peers", "none", "--steps", "fwd",
                    "--out", str(out)])
    finally:
        bench.steps.update(backward=True)
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["config"]["steps"] == "fwd"
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] is None and row["error"] is None
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--steps", "bwd"])


def test_benchmark_stream_timing(tmp_path, monkeypatch):
    """--timing stream times calls dispatched back to back (common.time_jax_stream), not one by one,
    and records the mode in the config."""
    import json

    from benchmarks import kda as bench

    used = []
    real = bench.time_jax_stream
    monkeypatch.setattr(bench, "time_jax_stream", lambda *a, **kw: used.append(kw) or real(*a, **kw))
    monkeypatch.setattr(bench, "time_jax", lambda *a, **kw: pytest.fail("per-call timing under --timing stream"))
    out = tmp_path / "kda.json"
    try:
        bench.main(["--quick", "--shapes", "1x70x1x16", "--impls", "chunk", "--peers", "none", "--timing", "stream",
                    "--out", str(out)])
    finally:
        bench.timing.update(mode="call")
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["config"]["timing"] == "stream"
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["error"] is None
    assert len(used) == 2 and all(kw["iters"] == 3 for kw in used)  # forward and forward+backward, --quick's 3
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--timing", "async"])


def test_benchmark_rounds_time_every_row_again_without_retracing(tmp_path, monkeypatch):
    """--rounds 3: every row timed three times (its times the medians of its rounds), the impls
    traced no more often than with one round, and a settings variant still runs its settings."""
    import json
    import statistics

    from benchmarks import kda as bench

    traces = []

    def counted(*a, **kw):
        traces.append(kw.get("impl"))
        return bench_kda(*a, **kw)

    bench_kda = bench.kda
    monkeypatch.setattr(bench, "kda", counted)
    argv = ["--quick", "--shapes", "1x70x1x16", "--impls", "chunk,chunk:cumsum=matmul", "--peers", "none"]
    counts = []
    try:
        for n in (1, 3):
            traces.clear()
            bench.main(argv + ["--rounds", str(n), "--out", str(tmp_path / f"kda{n}.json")])
            counts.append(len(traces))
    finally:
        bench.rounds.update(n=1)
    assert counts[0] == counts[1] > 0
    res = json.loads((tmp_path / "kda3.json").read_text())
    assert res["config"]["rounds"] == 3
    for row in res["rows"]:
        assert len(row["rounds"]["fwd"]) == len(row["rounds"]["fwd_bwd"]) == 3
        assert row["fwd_ms"] == statistics.median(row["rounds"]["fwd"])
        assert row["fwd_bwd_ms"] == statistics.median(row["rounds"]["fwd_bwd"])
    assert res["rows"][1]["o_rel_err_vs_chunk"] < 1e-5
    with pytest.raises(SystemExit):
        bench.main(argv + ["--rounds", "0"])


def test_benchmark_decode_quick(tmp_path):
    """--decode on CPU: the plain-JAX step is timed per call and back to back; the kernel rows
    say why they are skipped; the table shows both timings."""
    import json

    from benchmarks import common
    from benchmarks import kda as bench
    from benchmarks import kda_decode

    calls = []
    ms = common.time_jax_stream(lambda x: calls.append(1) or x + 1, jnp.ones(3), warmup=2, iters=5, bursts=3)
    assert ms > 0 and len(calls) == 2 + 5 + 3 * 5  # warm-up calls, the untimed burst, the timed bursts
    out = tmp_path / "dec.json"
    bench.main(["--quick", "--decode", "--peers", "none", "--decode_blocks", "8.2.32", "--out", str(out)])
    res = json.loads(out.read_text())
    rows = {r["name"]: r for r in res["rows"]}
    naive = rows["kda_step naive"]
    assert naive["error"] is None and naive["us"] > 0 and naive["us_stream"] > 0
    assert naive["gbps_stream"] == pytest.approx(naive["bytes"] / (naive["us_stream"] * 1e-6) / 1e9)
    kernel = rows["kernel only: mosaic_decode.decode_step_pipelined"]
    assert kernel["us"] is None and kernel["us_stream"] is None and "skipped" in kernel["error"]
    assert "| us per call | us back to back |" in res["table"]
    assert "skipped" in rows["kernel only: decode_step_pipelined programs=8 slots=2 block_v=32"]["error"]
    assert kda_decode.parse_decode_blocks("132.4.64,264.2.32") == [dict(programs=132, slots=4, block_v=64),
                                                              dict(programs=264, slots=2, block_v=32)]
    with pytest.raises(ValueError, match="programs.slots.block_v"):
        kda_decode.parse_decode_blocks("132.4")


def test_benchmark_triton_cache(tmp_path, monkeypatch):
    """--triton_cache points Triton's cache at the folder and records the autotuning results in it."""
    import json
    import os

    from benchmarks import kda as bench

    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")  # restored after the test
    monkeypatch.delenv("FLA_CACHE_RESULTS", raising=False)
    cache = tmp_path / "triton"
    (cache / "ab12").mkdir(parents=True)
    (cache / "ab12" / "chunk_kda_fwd_kernel.autotune.json").write_text("{}")
    (cache / "ab12" / "chunk_kda_fwd_kernel.cubin").write_text("")
    out = tmp_path / "kda.json"
    monkeypatch.chdir(tmp_path)  # a folder under the working directory is recorded relative to it
    bench.main(["--quick", "--shapes", "1x16x1x16", "--impls", "chunk", "--peers", "none",
                "--triton_cache", "triton", "--out", str(out)])
    assert os.environ["TRITON_CACHE_DIR"] == str(cache) and os.environ["FLA_CACHE_RESULTS"] == "1"
    tc = json.loads(out.read_text())["config"]["triton_cache"]
    assert tc == {"dir": "triton", "autotune_results_before": 1, "autotune_results_after": 1}


def test_benchmark_triton_cache_records_no_host_path(tmp_path, monkeypatch):
    """--triton_cache points Triton at the folder, counts fla's autotuning results there, and
    records the folder by name only when it lies outside the repository."""
    import sys

    from benchmarks import kda as bench

    folder = tmp_path / "tc"
    (folder / "HASH").mkdir(parents=True)
    (folder / "HASH" / "chunk_kda_fwd.autotune.json").write_text("{}")
    (folder / "HASH" / "chunk_kda_fwd.cubin").write_text("")
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_RESULTS", raising=False)
    rec = bench.use_triton_cache(str(folder))
    assert rec == {"dir": "tc", "autotune_results_before": 1, "autotune_results_after": 1}
    assert os.environ["TRITON_CACHE_DIR"] == str(folder)
    monkeypatch.setitem(sys.modules, "triton", object())
    with pytest.raises(RuntimeError, match="before triton is imported"):
        bench.use_triton_cache(str(folder))


def test_benchmark_autotune_archive_round_trip(tmp_path, monkeypatch):
    """--autotune_archive seeds the Triton cache from a .tgz of autotuning results and rewrites it
    with all the folder holds after the run (only *.autotune.json); the after-run count reads the
    cache folder itself, also when it lies outside the working directory."""
    import json
    import sys
    import tarfile

    from benchmarks import kda as bench

    src = tmp_path / "old"
    for h in ("A1", "B2"):
        (src / h).mkdir(parents=True)
        (src / h / f"kernel_{h}.autotune.json").write_text(json.dumps({"h": h}))
        (src / h / "kernel.cubin").write_text("binary")
    archive = tmp_path / "archives" / "fla.tgz"
    assert bench.save_autotune_archive(str(src), str(archive)) == 2
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["A1/kernel_A1.autotune.json", "B2/kernel_B2.autotune.json"]
    assert bench.load_autotune_archive(str(tmp_path / "missing.tgz"), str(tmp_path / "x")) == 0

    cache = tmp_path / "cache"  # outside the working directory below
    (cache / "C3").mkdir(parents=True)
    (cache / "C3" / "kernel_C3.autotune.json").write_text("{}")  # tuned by an earlier run here
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")
    monkeypatch.delenv("FLA_CACHE_RESULTS", raising=False)
    out = tmp_path / "kda.json"
    bench.main(["--quick", "--shapes", "1x16x1x16", "--impls", "chunk", "--peers", "none", "--triton_cache",
                str(cache), "--autotune_archive", str(archive), "--out", str(out)])
    assert json.loads((cache / "A1" / "kernel_A1.autotune.json").read_text()) == {"h": "A1"}
    assert json.loads(out.read_text())["config"]["triton_cache"] == {
        "dir": "cache", "autotune_results_before": 3, "autotune_results_after": 3}
    with tarfile.open(archive) as tar:
        assert len(tar.getnames()) == 3 and "C3/kernel_C3.autotune.json" in tar.getnames()

    bad = tmp_path / "bad.tgz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(src / "A1" / "kernel_A1.autotune.json", arcname="../escape.autotune.json")
    with pytest.raises(ValueError, match="unsafe"):
        bench.load_autotune_archive(str(bad), str(tmp_path / "y"))
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--peers", "none", "--autotune_archive", str(archive)])

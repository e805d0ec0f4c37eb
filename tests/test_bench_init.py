"""benchmarks/init_compile.py: both seed variants compile and run, give the same state (checked
inside the benchmark), and the JSON records their times; a bad variant name is refused."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_init", os.path.join(ROOT, "benchmarks", "init_compile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_init_compile_benchmark_quick(tmp_path):
    bench = _bench()
    out = tmp_path / "i.json"
    result = bench.main(["--quick", "--out", str(out)])
    assert [r["variant"] for r in result["rows"]] == ["constant", "array"]
    assert all(r["compile_s"] > 0 and r["run_s"] >= 0 for r in result["rows"])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--variants", "constant,rbg"])

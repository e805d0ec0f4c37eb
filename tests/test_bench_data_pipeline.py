"""benchmarks/data_pipeline.py: both paths build the same batches, and the rows and JSON it writes."""

import importlib.util
import json
import os

import numpy as np
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "data_pipeline", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data_pipeline.py"))
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_both_paths_give_the_same_batches():
    (_, a), (_, b) = bench._iterators(bench._config(64, 4, 8))
    for _ in range(3):
        x, y = next(a), next(b)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_rows_and_json(tmp_path):
    out = tmp_path / "d.json"
    rows = bench.main(["--settings", "64x4x8", "--batches", "2", "--out", str(out)])
    assert [r["path"] for r in rows] == ["make_iterator", "grain per-example"] and all(r["ms"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
    with pytest.raises(SystemExit):
        bench.main(["--settings", "64x4", "--out", str(out)])

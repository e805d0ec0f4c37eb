"""benchmarks/state_pass.py: the state pass alone under two forms in the interpreter (--quick),
their outputs compared and the JSON written; bad forms refused."""

import importlib.util
import json
import os

import pytest

spec = importlib.util.spec_from_file_location(
    "state_pass", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "state_pass.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_two_forms_agree_and_are_written(tmp_path):
    out = bench.main(["--quick", "--out", str(tmp_path / "s.json")])
    assert [r["form"] for r in out["rows"]] == ["state_chain=smem", "state_chain=regs"]
    assert all(r["ms"] > 0 and r["us_per_step"] == pytest.approx(1e3 * r["ms"] / 4) for r in out["rows"])
    assert max(out["rows"][1]["rel_max_diff"].values()) < 1e-5  # the same products, float32 sums aside
    assert json.loads((tmp_path / "s.json").read_text())["rows"][1]["form"] == "state_chain=regs"


def test_bad_forms_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--forms", "state_chain=registers", "--out", str(tmp_path / "s.json")])

"""benchmarks/intra_revisions.py: the intra kernel at git revisions (and from a file) loaded side by
side, run in the interpreter (--quick), compared and timed; bad revisions refused."""

import importlib.util
import os

import pytest

spec = importlib.util.spec_from_file_location(
    "intra_revisions", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "intra_revisions.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_two_loads_of_one_revision_agree(tmp_path):
    out = bench.main(["--revs", "HEAD,HEAD", "--quick", "--out", str(tmp_path / "r.json")])
    assert [r["rev"] for r in out["rows"]] == ["HEAD", "HEAD"]
    assert set(out["rows"][1]["diffs"]) == set(bench.OUTPUTS)
    assert max(out["rows"][1]["diffs"].values()) == 0.0
    assert all(len(r["ms"]) == 1 and r["ms"][0] > 0 for r in out["rows"])
    assert (tmp_path / "r.json").exists()
    # a file not committed loads as its own module beside them
    m = bench.load("file:kernels/kda/mosaic_intra_bf16.py", str(tmp_path))
    assert callable(m.intra_bf16) and m.__name__.startswith("intra_rev_")


def test_bad_revisions_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="cannot read"):
        bench.main(["--revs", "no-such-revision", "--quick", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="has no intra_bf16"):
        bench.main(["--revs", "file:kernels/kda/naive.py", "--quick", "--out", str(tmp_path / "r.json")])


def test_rel_rms_ignores_padding():
    import numpy as np

    a = np.array([1.0, 2.0, np.nan])
    assert bench.rel_rms(a, np.array([1.0, 2.0, 5.0])) == 0.0
    assert bench.rel_rms(np.array([2.0]), np.array([1.0])) == pytest.approx(1.0)

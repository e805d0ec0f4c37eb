"""benchmarks/short_conv.py on CPU: every mode's backward and the kernel rows are measured."""

import json

from benchmarks import short_conv


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "sc.json"
    short_conv.main(["--quick", "--slots", "2,3", "--block_c", "32,64", "--modes", "stacked,pallas_gpu", "--out",
                     str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["name"]) for r in rows] == [
        ("backward", "conv_dw=stacked"), ("backward", "conv_dw=pallas_gpu"), ("kernel", "reference (XLA)"),
        ("kernel", "pallas_gpu"), ("kernel", "pallas_gpu"), ("kernel", "pallas_gpu"), ("kernel", "pallas_gpu")]
    assert all(r["ms"] and r["ms"] > 0 and r["error"] is None for r in rows)
    assert [(r["block_c"], r["slots"]) for r in rows[3:]] == [(32, 2), (32, 3), (64, 2), (64, 3)]
    assert [r["default"] for r in rows[3:]] == [True, False, False, False]
    assert rows[0]["bytes"] == 3 * 256 * 64 * 2  # x, dy read and dx written, bf16


def test_bad_shape_and_mode_raise():
    import pytest

    with pytest.raises(ValueError, match="BxTxHxD"):
        short_conv.parse_shape("4x4096")
    with pytest.raises(ValueError, match="--modes"):
        short_conv.main(["--quick", "--modes", "fast"])

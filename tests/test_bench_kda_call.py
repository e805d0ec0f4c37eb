"""benchmarks/kda_call.py: the per-call timeline's arithmetic on a made-up trace, and the script
end to end at its quick shape on CPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import kda_call


def _ev(plane, name, start_us, dur_us, line="l"):
    return (plane, line, name, int(start_us * 1e3), int(dur_us * 1e3))


def test_timeline_offsets_from_each_call_and_summary():
    host, dev = "/host:CPU", "/device:GPU:0"
    events = []
    for i, t in enumerate((0, 2000, 4000, 6000)):  # four calls 2 ms apart; the first two are warm-up
        events += [_ev(host, f"{kda_call.RANGE}{i}", t, 1100), _ev(host, "PjitFunction(f)", t + 2, 120),
                   _ev(host, "tiny", t + 5, 1.0), _ev(dev, "intra", t + 90, 670), _ev(dev, "state", t + 760, 250),
                   _ev(host, "$api.py:2757 block_until_ready", t + 130, 960)]
    lines, per_call = kda_call.timeline(events, min_us=2.0)
    assert len(lines) == 2  # calls 2 and 3
    names = [e[2] for e in lines[0]]
    assert "tiny" not in names and "intra" in names and "state" in names  # short host events dropped
    assert [e[3] for e in lines[0] if e[2] == "intra"] == [90.0]  # offsets from the call's own start
    s = kda_call.summary(lines[1])
    assert s == dict(first_kernel_us=90.0, last_kernel_end_us=1010.0, span_us=1090.0)
    assert dict(per_call)["PjitFunction(f)"] == pytest.approx(120.0)  # summed over four calls, per call


def test_timeline_without_ranges_raises():
    with pytest.raises(ValueError, match="kda_call"):
        kda_call.timeline([_ev("/host:CPU", "x", 0, 5)], min_us=1.0)


def test_settings_only_for_the_chunked_impls():
    with pytest.raises(ValueError, match="chunk and chunk_mosaic only"):
        kda_call._context("naive:block_v=32")
    assert kda_call._context("chunk")[0] == "chunk"


def test_quick_run_writes_the_timeline(tmp_path):
    out = tmp_path / "call.json"
    res = kda_call.main(["--quick", "--out", str(out)])
    saved = json.loads(out.read_text())["result"]
    assert saved["impl"] == "chunk" and saved["shape"] == [1, 128, 2, 64]
    assert res["fwd_call_ms"] > 0 and res["trivial_stream_ms"] > 0
    assert len(saved["timeline"]) == len(saved["summary"]) >= 1
    assert any(name == "PjitFunction(f)" or name.startswith("$api.py") for name, _ in saved["host_top_us_per_call"])

"""benchmarks/xla_bytes.py: the launched ops of an HLO module with their bytes, and the CLI on CPU."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HLO = """HloModule m

%fused_computation (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %inner = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%other
  ROOT %add = f32[4,8]{1,0} add(%p0, %inner)
}

ENTRY %main (a: f32[4,8], b: bf16[4,8]) -> (f32[4,8], bf16[2,8]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  %fusion = f32[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation
  %cc = bf16[2,8]{1,0} custom-call(%fusion, %b), custom_call_target="kernel"
  ROOT %t = (f32[4,8]{1,0}, bf16[2,8]{1,0}) tuple(%fusion, %cc)
}
"""


def _module():
    spec = importlib.util.spec_from_file_location("xla_bytes", os.path.join(ROOT, "benchmarks", "xla_bytes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_launched_ops_count_operands_and_results_outside_fused_computations():
    ops = _module().launched_ops(HLO)
    # The custom call reads f32[4,8] and bf16[4,8] and writes bf16[2,8]; the fusion reads and writes
    # f32[4,8]; the fusion inside the fused computation is not launched.
    assert [(o["op"], o["kind"], o["bytes"]) for o in ops] == [("fusion", "fusion", 256),
                                                               ("cc", "custom-call", 128 + 64 + 32)]


def test_cli_on_cpu(tmp_path):
    out = tmp_path / "x.json"
    results = _module().main(["--shape", "1x128x2x64", "--impls", "chunk,chunk:diag=f32", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["impl"] for r in data["results"]] == ["chunk", "chunk:diag=f32"] == [r["impl"] for r in results]
    for r in results:
        fusions = [o for o in r["ops"] if o["kind"] == "fusion"]
        assert r["fusions"] == len(fusions) > 0
        assert abs(r["fusion_gb"] - sum(o["bytes"] for o in fusions) / 1e9) < 1e-3
        assert [o["bytes"] for o in r["ops"]] == sorted((o["bytes"] for o in r["ops"]), reverse=True)


def test_forward_step_counts_fewer_bytes_than_forward_backward(tmp_path):
    """--step fwd compiles the undifferentiated call: fewer launched bytes than the training step
    at the same shape, and the record says which step it counted."""
    mod = _module()
    fwd = mod.main(["--shape", "1x128x2x64", "--impls", "chunk", "--step", "fwd", "--out", str(tmp_path / "f.json")])
    both = mod.main(["--shape", "1x128x2x64", "--impls", "chunk", "--out", str(tmp_path / "b.json")])
    assert fwd[0]["step"] == "fwd" and both[0]["step"] == "fwd_bwd"
    assert 0 < fwd[0]["fusion_gb"] < both[0]["fusion_gb"]
    import pytest

    with pytest.raises(ValueError, match="step_kind"):
        mod.compile_text((1, 128, 2, 64), "chunk", step_kind="bwd")

"""kernels/kda/pallas_gpu_stages.py: the bytes and FLOPs a timed stage is set against (its rates
against the H200's HBM bandwidth and tensor-core peak), recorded by `run_stages` and recomputed for
an older stages JSON by `pallas_gpu_bench --roofline`."""

import json

import pytest

from kernels.kda import pallas_gpu_bench
from kernels.kda import pallas_gpu_stages as st


def test_roofline_against_the_h200_limits():
    r = st.roofline(nbytes=43 * 10**8, flops=790 * 10**12, ms=1000.0)
    assert r["gbps"] == pytest.approx(4.3) and r["pct_hbm"] == pytest.approx(0.1)
    assert r["tflops"] == pytest.approx(790.0) and r["pct_tensor"] == pytest.approx(100.0)
    assert "tflops" not in st.roofline(10, None, 1.0)


def test_flop_models_count_the_padded_chunks():
    # T = 100 runs as two chunks of 64 tokens.
    assert st.intra_flops(1, 100, 1, 128, 64) == 128 * (6 * 64 * 128 + 2 * 64 * 64)
    assert st.state_flops(2, 64, 3, 128, 128) == 2 * 64 * 3 * (6 * 128 * 128 + 2 * 64 * 128)


def test_recorded_bytes_match_the_shape_model(tmp_path):
    """The intra kernel's stage, run in the interpreter: the bytes the recorder takes from its
    arrays equal the model from shapes alone, and --roofline recomputes its rates from a JSON."""
    shape = (1, 128, 2, 64)
    run = st.run_stages(shape, warmup=0, iters=1, only=[st.INTRA_BF16_STAGE])
    (row,) = [r for r in run["stages"] if r["stage"] == st.INTRA_BF16_STAGE]
    nbytes, flops = st.kernel_stage_work(shape)[st.INTRA_BF16_STAGE]
    assert row["bytes"] == nbytes and row["flops"] == flops
    # q, k, v (bf16), g (f32), beta (f32) in; qg, wn, kg, u (bf16), the transposed Aqk (bf16 64 x 64
    # per chunk and head) and the chunk decays (f32) out.
    n = 128 * 2 * 64
    assert nbytes == 3 * 2 * n + 4 * n + 4 * 128 * 2 + 4 * 2 * n + 2 * 2 * 2 * 64 * 64 + 4 * 2 * 2 * 64
    path = tmp_path / "stages.json"
    path.write_text(json.dumps(dict(shape=list(shape), stages=[dict(stage=st.INTRA_BF16_STAGE, ms=2.0),
                                                              dict(stage=st.STATE_STAGE, ms=None)])))
    rates = pallas_gpu_bench.roofline_of(str(path))
    assert list(rates) == [st.INTRA_BF16_STAGE]
    assert rates[st.INTRA_BF16_STAGE]["gbps"] == pytest.approx(nbytes / 2e-3 / 1e9)

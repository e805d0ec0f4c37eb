"""`chunk.settings(forward_segments=s)`: the forward-only `pallas_gpu` call runs its state pass as s
segments side by side (pass 1 `mosaic_scan.state_scan` from [I | 0] on the intra stage's operands,
the float32 scan over segments, then `mosaic_state.state_output` from each segment's start). Same
o and final state as one segment, up to the roundings of pass 1's bf16 states; the interpreter on
CPU, the compiled kernels on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_segments, kda, mosaic_scan, mosaic_state, pallas_gpu
from kernels.testing import assert_close, rel_rms
from tests.kernels.test_kda_chunk import BF16_TOL
from tests.kernels.test_kda_pallas_gpu import _inputs


def _forward(inputs, lower_bound, segments):
    q, k, v, g, beta, h0, seg = inputs
    with chunk.settings(forward_segments=segments):
        return jax.jit(lambda *a: kda(*a, initial_state=h0, segment_ids=seg, output_final_state=True,
                                      lower_bound=lower_bound, impl="pallas_gpu"))(q, k, v, g, beta)


@pytest.mark.parametrize("intra, K, V, T, segments, n_docs", [
    ("mosaic_bf16", 64, 64, 512, 4, 0),   # [BH, N] operands, -W, A^T
    ("chunk", 128, 64, 500, 2, 0),        # chunk-major operands, W itself; T padded
    ("chunk", 64, 64, 384, 2, 3),         # packed documents: the chunks' transitions carry the resets
    ("xla", 64, 128, 256, 4, 0),          # the exact XLA stage's operands
])
def test_segments_match_one_pass(rng, monkeypatch, intra, K, V, T, segments, n_docs):
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", intra)
    calls = []
    pass1 = mosaic_scan.state_scan
    monkeypatch.setattr(mosaic_scan, "state_scan", lambda *a, **kw: calls.append(kw["segments"]) or pass1(*a, **kw))
    inputs = _inputs(rng, 1, T, 2, K, V, "channel", jnp.bfloat16, n_docs=n_docs)
    o1, S1 = _forward(inputs, -5.0, 1)
    assert calls == []
    o, S = _forward(inputs, -5.0, segments)
    assert calls == [segments]
    assert o.shape == o1.shape and o.dtype == o1.dtype and S.shape == S1.shape
    assert rel_rms(o1, o) < 2e-3 and rel_rms(S1, S) < 2e-3
    ref = jax.jit(lambda *a: kda(*a, initial_state=inputs[5], segment_ids=inputs[6], output_final_state=True,
                                 impl="naive"))(*inputs[:5])
    assert_close("o", ref[0], o, BF16_TOL["o"])
    assert_close("S", ref[1], S, BF16_TOL["S"])


def test_float32_operands_keep_one_segment_when_compiled(rng, monkeypatch, caplog):
    """Pass 1's kernel takes bf16 / fp16 only: float32 operands (compiled) run one segment, logged."""
    calls = []
    monkeypatch.setattr(mosaic_scan, "state_scan", lambda *a, **kw: calls.append(1))
    monkeypatch.setattr(mosaic_state, "state_output", lambda *a, **kw: calls.append(kw["segments"]) or (
        jnp.zeros((1, 256, 1, 64), a[3].dtype), jnp.zeros((1, 64, 64), jnp.float32)))
    q, k, v, g, beta, h0, _ = _inputs(rng, 1, 256, 1, 64, 64, "channel", jnp.float32)
    pallas_gpu._warned.discard("forward_segments")
    with chunk.settings(forward_segments=4), caplog.at_level("WARNING"):
        pallas_gpu._kernel_forward(q, k, v, g, beta, h0, None, 0.125, "chunk", True, interpret=False)
    assert calls == [1] and "pass 1 takes bf16" in caplog.text


def test_segments_that_do_not_divide_are_halved(rng, caplog):
    """8 segments of 4 chunks: halved until they divide (4, logged once); the same values."""
    inputs = _inputs(rng, 1, 256, 1, 64, 64, "channel", jnp.bfloat16)
    o1, S1 = _forward(inputs, -5.0, 1)
    with caplog.at_level("WARNING"):
        chunk_segments._warned.discard((4, 8))
        o, S = _forward(inputs, -5.0, 8)
    assert "do not split into 8" in caplog.text
    assert rel_rms(o1, o) < 2e-3 and rel_rms(S1, S) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [4, "auto"])
def test_gpu_segments_match_one_pass(rng, segments):
    """1 x 65536 x 4 heads: compiled kernels, segmented against one pass and the reference."""
    inputs = _inputs(rng, 1, 65536, 4, 128, 128, "channel", jnp.bfloat16)
    o1, S1 = _forward(inputs, -5.0, 1)
    o, S = _forward(inputs, -5.0, segments)
    assert rel_rms(o1, o) < 2e-3 and rel_rms(S1, S) < 2e-3
    ref = jax.jit(lambda *a: kda(*a, initial_state=inputs[5], output_final_state=True, impl="naive"))(*inputs[:5])
    assert_close("o", ref[0], o, BF16_TOL["o"])
    assert_close("S", ref[1], S, BF16_TOL["S"])
    assert np.isfinite(np.asarray(S)).all()

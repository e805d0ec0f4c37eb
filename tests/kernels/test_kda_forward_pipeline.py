"""`chunk.settings(forward_pipeline=p)`: the forward-only bounded `pallas_gpu` call as p runs of
chunks, the intra kernel of run i + 1 beside the state pass of run i (`forward_pipeline`). The
intra programs are the single launch's, and the state passes carry the float32 state the single
pass carries in registers: o and the final state equal one launch's exactly. The interpreter on
CPU, the compiled kernels (on two streams) on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_segments, forward_pipeline, kda, mosaic_intra_bf16, pallas_gpu
from kernels.testing import assert_close
from tests.kernels.test_kda_chunk import BF16_TOL
from tests.kernels.test_kda_pallas_gpu import _inputs


def _forward(inputs, pieces, **settings):
    q, k, v, g, beta, h0, seg = inputs
    with chunk.settings(forward_pipeline=pieces, **settings):
        return jax.jit(lambda *a: kda(*a, initial_state=h0, segment_ids=seg, output_final_state=True,
                                      lower_bound=-5.0, impl="pallas_gpu"))(q, k, v, g, beta)


def test_piece_bounds():
    assert forward_pipeline.piece_bounds(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert forward_pipeline.piece_bounds(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert forward_pipeline.piece_bounds(2, 4) == [(0, 1), (1, 1)]


@pytest.mark.parametrize("T, pieces, h0, K, V", [
    (320, 3, True, 128, 128),   # 5 chunks in runs of 2, 2, 1, from an initial state
    (250, 2, False, 64, 128),   # T padded to 256, no initial state
])
def test_pipeline_equals_one_launch(rng, monkeypatch, T, pieces, h0, K, V):
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", "mosaic_bf16")
    calls, intra = [], mosaic_intra_bf16.intra_bf16
    monkeypatch.setattr(mosaic_intra_bf16, "intra_bf16", lambda *a, **kw: calls.append(kw.get("chunks")) or intra(*a, **kw))
    inputs = list(_inputs(rng, 2, T, 2, K, V, "channel", jnp.bfloat16))
    if not h0:
        inputs[5] = None
    o1, S1 = _forward(inputs, 1)
    assert calls == [None]
    o, S = _forward(inputs, pieces)
    NT = -(-T // 64)
    assert calls[1:] == forward_pipeline.piece_bounds(NT, pieces)
    assert o.shape == o1.shape and o.dtype == o1.dtype and S.shape == S1.shape
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S1))
    ref = jax.jit(lambda *a: kda(*a, initial_state=inputs[5], output_final_state=True, impl="naive"))(*inputs[:5])
    assert_close("o", ref[0], o, BF16_TOL["o"])


def test_pipeline_refuses_explicit_segments(rng, monkeypatch):
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", "mosaic_bf16")
    inputs = _inputs(rng, 1, 256, 1, 64, 64, "channel", jnp.bfloat16)
    with pytest.raises(ValueError, match="forward_segments=2"):
        _forward(inputs, 2, forward_segments=2)


def test_auto_segments_take_precedence(rng, monkeypatch, caplog):
    """Where forward_segments="auto" splits the state pass, the call runs segments, not the
    pipeline, and says so."""
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", "mosaic_bf16")
    monkeypatch.setattr(chunk_segments, "auto_forward_segments", lambda num_chunks, programs: 2)
    calls, intra = [], mosaic_intra_bf16.intra_bf16
    monkeypatch.setattr(mosaic_intra_bf16, "intra_bf16", lambda *a, **kw: calls.append(kw.get("chunks")) or intra(*a, **kw))
    inputs = _inputs(rng, 1, 256, 1, 64, 64, "channel", jnp.bfloat16)
    with caplog.at_level("WARNING"):
        _forward(inputs, 2)
    assert calls == [None]
    assert "forward_pipeline=2 is not used" in caplog.text


def test_intra_chunks_out_of_range(rng):
    x = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="outside the 4 chunks"):
        mosaic_intra_bf16.intra_bf16(x, x, x, x.astype(jnp.float32), jnp.zeros((1, 1, 256)), scale=1.0,
                                     interpret=True, chunks=(3, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [2, 4])
def test_gpu_pipeline_equals_one_launch(rng, pieces):
    """Compiled, the state passes on the second stream: o and the final state equal one launch's at
    (2, 4096, 16, 128), from an initial state."""
    inputs = _inputs(rng, 2, 4096, 16, 128, 128, "channel", jnp.bfloat16)
    o1, S1 = _forward(inputs, 1)
    o, S = _forward(inputs, pieces)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S1))

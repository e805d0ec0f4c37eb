"""`chunk.settings(state_wgs=2)` (`kernels/kda/mosaic_state_pair.py`): the state kernel with two
64-column warpgroups per program sharing the K-wide operands. The same products in the same order
as one warpgroup per program, so every output is equal bit for bit, in each layout the kernel takes:
the interpreter on CPU, the compiled kernels on the GPU (where a missing wait would show)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, mosaic_state
from tests.kernels.test_kda_mosaic_scan import cuda_train_module


def _both(rng, N, BH, K, V, interpret, out_dtype=jnp.float32, h0="random", segments=1, **layout):
    """state_output's outputs with one and with two warpgroups per program, on one set of inputs."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    lead = (N, BH) if layout.get("chunk_major") else (BH, N)
    qg, wn, kg, u, a = f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, V), f(*lead, 64, 64)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (*lead, K)), jnp.float32)
    S0 = None if h0 is None else jnp.asarray(rng.standard_normal((segments * BH, K, V)), jnp.float32)
    outs = []
    for wgs in (1, 2):
        with chunk.settings(state_wgs=wgs):
            run = jax.jit(lambda *x: mosaic_state.state_output(*x, S0, out_dtype=out_dtype, interpret=interpret,
                                                               segments=segments, **layout))
            outs.append(run(qg, wn, kg, u, a, d))
    return outs


def _assert_equal(outs, n_out):
    one, two = outs
    assert len(one) == len(two) == n_out
    for x, y in zip(one, two):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert np.any(np.asarray(one[1]) != 0)


@pytest.mark.parametrize("N, K, V, out_dtype, layout", [
    (3, 64, 128, jnp.float32, dict(chunk_major=True, with_states=True, with_vn=True, w_negated=False)),
    (3, 128, 128, jnp.bfloat16, dict(heads=2, a_transposed=True)),
    (1, 64, 256, jnp.bfloat16, dict(chunk_major=True, with_vn=True)),
    (2, 64, 128, jnp.bfloat16, dict(with_states=True)),
])
def test_two_warpgroups_match_one(rng, N, K, V, out_dtype, layout):
    """o over v' (bf16 o) and o apart (float32 o); one chunk and several; two programs per head at V=256."""
    outs = _both(rng, N, 2, K, V, True, out_dtype=out_dtype, **layout)
    _assert_equal(outs, 2 + layout.get("with_states", False) + layout.get("with_vn", False))


def test_two_warpgroups_without_initial_state_and_with_segments(rng):
    _assert_equal(_both(rng, 3, 2, 64, 128, True, h0=None, heads=1, a_transposed=True), 2)
    _assert_equal(_both(rng, 4, 2, 64, 128, True, segments=2, chunk_major=True), 2)


def test_two_warpgroups_refuse_what_they_do_not_take():
    x = jnp.zeros((2, 1, 64, 64), jnp.bfloat16)
    d = jnp.ones((2, 1, 64), jnp.float32)
    with chunk.settings(state_wgs=2), pytest.raises(ValueError, match="V a multiple of 128"):
        mosaic_state.state_output(x, x, x, x, x, d, None, out_dtype=jnp.bfloat16, interpret=True)
    with chunk.settings(state_wgs=2, state_buffers="single"), pytest.raises(ValueError, match="double buffers"):
        mosaic_state.state_output(x, x, x, jnp.zeros((2, 1, 64, 128), jnp.bfloat16), x, d, None,
                                  out_dtype=jnp.bfloat16, interpret=True)
    y = jnp.zeros((2, 1, 64, 96), jnp.bfloat16)
    with chunk.settings(state_wgs=2), pytest.raises(ValueError, match="K a multiple of 64"):
        mosaic_state.state_output(y, y, y, jnp.zeros((2, 1, 64, 128), jnp.bfloat16), x, jnp.ones((2, 1, 96)), None,
                                  out_dtype=jnp.bfloat16, interpret=True)


def test_auto_pairs_only_past_one_wave(monkeypatch):
    """"auto": two warpgroups where the one-warpgroup programs exceed the SMs and the paired kernel
    applies; one elsewhere (one wave already, single buffers, narrow blocks, V not a multiple of 128)."""
    from kernels.kda import chunk_segments

    monkeypatch.setattr(chunk_segments, "_num_sms", lambda: 132)
    with chunk.settings(state_wgs="auto"):
        assert mosaic_state.resolve_wgs(256, 64, 128) == 2  # 8,4096,16,128: two waves at one warpgroup
        assert mosaic_state.resolve_wgs(132, 64, 128) == 1  # one wave already
        assert mosaic_state.resolve_wgs(256, 32, 128) == 1
        assert mosaic_state.resolve_wgs(512, 64, 64) == 1
    with chunk.settings(state_wgs="auto", state_buffers="single"):
        assert mosaic_state.resolve_wgs(256, 64, 128) == 1
    for fixed in (1, 2):
        with chunk.settings(state_wgs=fixed):
            assert mosaic_state.resolve_wgs(256, 32, 64) == fixed
    # the traced choice: the paired kernel in the program only where "auto" resolves to 2
    monkeypatch.setattr(chunk_segments, "_num_sms", lambda: 1)
    assert "kda_mosaic_state_pair" in cuda_train_module(2, 256, 2, 128, forward_state="output", state_wgs="auto")
    jax.clear_caches()  # the traced settings key the cached launchers, the SM count (fixed per process) does not
    monkeypatch.setattr(chunk_segments, "_num_sms", lambda: 10_000)
    assert "kda_mosaic_state_pair" not in cuda_train_module(2, 256, 2, 128, forward_state="output",
                                                            state_wgs="auto")


def test_two_warpgroups_lower_for_cuda():
    text = cuda_train_module(2, 256, 2, 128, forward_state="output", state_wgs=2)
    assert "kda_mosaic_state_pair" in text


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [
    dict(heads=16, a_transposed=True),
    dict(chunk_major=True, with_states=True, with_vn=True, w_negated=False),
])
def test_gpu_two_warpgroups_match_one(rng, layout):
    """The compiled kernels, 64 chunks of 64 heads, the forward's and the training forward's layouts."""
    outs = _both(rng, 64, 64, 128, 128, False, out_dtype=jnp.bfloat16, **layout)
    _assert_equal(outs, 2 + layout.get("with_states", False) + layout.get("with_vn", False))

"""`chunk.settings(forward_state="output")` (`kernels/kda/chunk_output.py`): the Mosaic forward pass
of a differentiated call runs `mosaic_state.state_output`, which forms o itself and writes the
chunk states and v' for the backward, in place of the state pass plus XLA's two o products. Same
o, final state and gradients as "scan" (float32 summation order and o's one rounding aside); the
interpreter on CPU, the compiled kernel on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, kda, mosaic_state
from tests.kernels.test_kda_chunk import BF16_TOL, make_inputs
from tests.kernels.test_kda_mosaic_scan import _compare, cuda_train_module
from tests.kernels.test_kda_residuals import _dots


def _run(inputs, seg, **settings):
    """(o, final state, gradients of a loss of both, jaxpr of those gradients): bf16 chunk_mosaic."""
    q, k, v, g, beta, h0, ids = inputs
    args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)) + (g, beta)

    def f(*a):
        return kda(*a, initial_state=h0, segment_ids=jnp.asarray(ids) if seg else None, lower_bound=-5.0,
                   output_final_state=True, impl="chunk_mosaic")

    def loss(*a):
        o, S = f(*a)
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.shape[-1]))) + jnp.sum(S[..., 0, :])

    with chunk.settings(**settings):
        (o, S), _ = jax.vjp(f, *args)  # the custom VJP's forward: the pass under test
        grads = jax.grad(loss, argnums=range(5))(*args)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=range(5)))(*args)
    return o, S, grads, jaxpr


@pytest.mark.parametrize("seg", [False, True])
def test_output_pass_matches_the_scan_pass(rng, seg):
    inputs = make_inputs(rng, 1, 130, 2, 64, 64, "channel", lower=-5.0, seg="random")
    o0, S0, g0, j0 = _run(inputs, seg, forward_state="scan")
    o1, S1, g1, j1 = _run(inputs, seg, forward_state="output")
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    # o: one float32 accumulator rounded to bf16 against two float32 products summed, then rounded
    assert np.max(np.abs(f64(o0) - f64(o1))) <= 2 ** -7 * np.max(np.abs(f64(o0)))
    np.testing.assert_allclose(f64(S1), f64(S0), rtol=1e-5, atol=1e-5 * np.max(np.abs(f64(S0))))
    for a, b in zip(g0, g1):
        assert np.max(np.abs(f64(a) - f64(b))) <= 1e-2 * np.max(np.abs(f64(a)))
    assert _dots(j1.jaxpr) == _dots(j0.jaxpr) - 2  # o's two products are the kernel's now


def test_state_output_writes_the_corrected_values(rng):
    """`state_output(with_vn=True)`: v' = u + wn S_n per chunk, as the XLA recurrence forms it."""
    N, BH, K, V = 3, 2, 64, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    qg, wn, kg, u, a = f(N, BH, 64, K), f(N, BH, 64, K), f(N, BH, 64, K), f(N, BH, 64, V), f(N, BH, 64, 64)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (N, BH, K)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32)
    o, S, states, vn = mosaic_state.state_output(qg, wn, kg, u, a, d, h0, out_dtype=jnp.float32, interpret=True,
                                                 with_states=True, with_vn=True, chunk_major=True)
    up = lambda x: np.asarray(x, np.float64)  # noqa: E731
    for n in range(N):
        want = up(u[n]) + np.einsum("bck,bkv->bcv", up(wn[n]), up(states[n]))
        np.testing.assert_allclose(up(vn[n]), want, rtol=2e-2, atol=2e-2)
    assert vn.shape == (N, BH, 64, V) and vn.dtype == jnp.bfloat16


@pytest.mark.parametrize("layout", [
    dict(chunk_major=True, with_states=True, with_vn=True, w_negated=False),
    dict(heads=2, a_transposed=True),
    dict(chunk_major=True, heads=2, with_states=True),
])
def test_single_buffers_match_double(rng, layout):
    """BUFFERS "single" (qg, kg, A, u single-buffered, the carried tile and o over other buffers)
    runs the same products in the same order as "double": equal outputs, bit for bit."""
    N, BH, K, V = 3, 4, 64, 128
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    lead = (N, BH) if layout.get("chunk_major") else (BH, N)
    qg, wn, kg, u, a = f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, V), f(*lead, 64, 64)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (*lead, K)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32)
    outs = {}
    for buffers in mosaic_state.BUFFERS_CHOICES:
        with chunk.settings(state_buffers=buffers):
            outs[buffers] = mosaic_state.state_output(qg, wn, kg, u, a, d, h0, out_dtype=jnp.bfloat16,
                                                      interpret=True, **layout)
    assert len(outs["single"]) == 2 + layout.get("with_states", False) + layout.get("with_vn", False)
    for x, y in zip(outs["double"], outs["single"]):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _zero_state_pairs(rng, N, BH, interpret, **layout):
    """state_output with h0=None and with a zero h0 (double and single buffers): both outputs."""
    K = V = 128
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    lead = (N, BH) if layout.get("chunk_major") else (BH, N)
    qg, wn, kg, u, a = f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, V), f(*lead, 64, 64)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (*lead, K)), jnp.float32)
    outs = []
    for buffers in mosaic_state.BUFFERS_CHOICES:
        with chunk.settings(state_buffers=buffers):
            for h0 in (None, jnp.zeros((BH, K, V), jnp.float32)):
                run = jax.jit(lambda *x, h0=h0: mosaic_state.state_output(
                    *x, h0, out_dtype=jnp.bfloat16, interpret=interpret, **layout))
                outs.append(run(qg, wn, kg, u, a, d))
    return outs


def _assert_zero_state_pairs_equal(outs, n_out):
    for none, zero in zip(outs[::2], outs[1::2]):
        assert len(none) == len(zero) == n_out
        for x, y in zip(none, zero):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert np.any(np.asarray(outs[0][1]) != 0)  # the final state moved away from the zeros it started at


@pytest.mark.parametrize("layout", [
    dict(chunk_major=True, with_states=True, with_vn=True, w_negated=False),
    dict(heads=2, a_transposed=True),
])
def test_no_initial_state_starts_from_zeros(rng, layout):
    """h0=None: the kernel's state starts as zeros in registers, no zero tile read from HBM; every
    output equals the zero h0's bit for bit, with either buffer layout."""
    outs = _zero_state_pairs(rng, 3, 4, True, **layout)
    _assert_zero_state_pairs_equal(outs, 2 + layout.get("with_states", False) + layout.get("with_vn", False))


def test_no_initial_state_needs_one_segment(rng):
    x = jnp.zeros((4, 2, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="segments=2 needs every segment's starting state"):
        mosaic_state.state_output(x, x, x, x, x, jnp.ones((4, 2, 64), jnp.float32), None, out_dtype=jnp.bfloat16,
                                  interpret=True, chunk_major=True, segments=2)


@pytest.mark.gpu
def test_gpu_no_initial_state_starts_from_zeros(rng):
    """The compiled kernels (both buffer layouts) at the forward's layout, 64 chunks of 64 heads."""
    outs = _zero_state_pairs(rng, 64, 64, False, heads=16, a_transposed=True)
    _assert_zero_state_pairs_equal(outs, 2)


def test_single_buffers_lower_for_cuda():
    text = cuda_train_module(2, 256, 2, 128, forward_state="output", state_buffers="single")
    assert text.count("mosaic_gpu") >= 2


def test_output_pass_lowers_for_cuda():
    text = cuda_train_module(2, 256, 2, 128, forward_state="output")
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("seg,buffers", [(None, "double"), ("random", "double"), (None, "single")])
def test_gpu_output_pass_matches_naive(rng, seg, buffers):
    """Compiled kernels at a training shape: every output and gradient within the bf16 tolerances."""
    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0, seg=seg)
    with chunk.settings(forward_state="output", state_buffers=buffers):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)

"""`chunk.settings(state_order="pipelined")` (`mosaic_state._pipelined_body`): the state kernel keeps
S in a wgmma accumulator and issues chunk n + 1's first product before it reads O_n. Same values as
"plain" up to float32 summation order (V' and S accumulate in place), in every layout the kernel
takes: the interpreter on CPU, the compiled kernels on the GPU (where a missing wait would show)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, mosaic_state
from kernels.testing import assert_close
from tests.kernels.test_kda_chunk import BF16_TOL, make_inputs
from tests.kernels.test_kda_mosaic_scan import _compare, cuda_train_module


def _both_orders(rng, N, BH, K, V, interpret, h0="random", segments=1, block_v=None, **layout):
    """state_output's outputs under each order, on one set of random chunk tensors."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    lead = (N, BH) if layout.get("chunk_major") else (BH, N)
    qg, wn, kg, u, a = f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, K), f(*lead, 64, V), f(*lead, 64, 64)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (*lead, K)), jnp.float32)
    S0 = None if h0 is None else jnp.asarray(rng.standard_normal((segments * BH, K, V)), jnp.float32)
    outs = {}
    for order in mosaic_state.ORDER_CHOICES:
        with chunk.settings(state_order=order):
            run = jax.jit(lambda *x: mosaic_state.state_output(*x, S0, out_dtype=jnp.float32, interpret=interpret,
                                                               segments=segments, block_v=block_v, **layout))
            outs[order] = run(qg, wn, kg, u, a, d)
    return outs


def _assert_orders_agree(outs, n_out):
    plain, piped = outs["plain"], outs["pipelined"]
    assert len(plain) == len(piped) == n_out
    for i, (x, y) in enumerate(zip(plain, piped)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape and np.all(np.isfinite(y))
        # float32 outputs (o, final state): summation order only; bf16 ones (states, v'): one rounding
        tol = 2**-7 if plain[i].dtype == jnp.bfloat16 else 1e-5
        assert np.max(np.abs(x - y)) <= tol * np.max(np.abs(x)), i


@pytest.mark.parametrize("N, layout", [
    (3, dict(chunk_major=True, with_states=True, with_vn=True, w_negated=False)),
    (3, dict(heads=2, a_transposed=True)),
    (2, dict(chunk_major=True, with_vn=True)),
    (1, dict(with_states=True)),
])
def test_pipelined_matches_plain(rng, N, layout):
    outs = _both_orders(rng, N, 4, 64, 128, True, **layout)
    _assert_orders_agree(outs, 2 + layout.get("with_states", False) + layout.get("with_vn", False))


def test_pipelined_without_initial_state_segments_and_narrow_blocks(rng):
    """h0=None (zeros in registers), then two segments from their own starting states at 32 columns."""
    _assert_orders_agree(_both_orders(rng, 3, 2, 128, 64, True, h0=None, heads=1, a_transposed=True), 2)
    _assert_orders_agree(_both_orders(rng, 4, 2, 64, 64, True, segments=2, block_v=32, chunk_major=True), 2)


def test_order_is_checked():
    with pytest.raises(ValueError, match="state_order=.eager."), chunk.settings(state_order="eager"):
        pass


def test_pipelined_lowers_for_cuda():
    text = cuda_train_module(2, 256, 2, 128, forward_state="output", state_order="pipelined")
    assert "pipelined_body" in text


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [
    dict(heads=16, a_transposed=True),
    dict(chunk_major=True, with_states=True, with_vn=True, w_negated=False),
])
def test_gpu_pipelined_matches_plain(rng, layout):
    """The compiled kernels, 64 chunks of 64 heads, the forward's and the training forward's layouts."""
    outs = _both_orders(rng, 64, 64, 128, 128, False, **layout)
    _assert_orders_agree(outs, 2 + layout.get("with_states", False) + layout.get("with_vn", False))


@pytest.mark.gpu
def test_gpu_pipelined_forward_and_training_match_naive(rng):
    """Both routes through the pipelined kernel at a training shape: the forward-only call and the
    training forward with every gradient, within the bf16 tolerances of naive."""
    from kernels.kda import kda

    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0)
    q, k, v, g, beta, h0, _ = inputs
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta))
    run = lambda impl: jax.jit(lambda: kda(*args, initial_state=jnp.asarray(h0), output_final_state=True,  # noqa: E731
                                           lower_bound=-5.0, impl=impl))()
    with chunk.settings(state_order="pipelined"):
        (o_ref, S_ref), (o, S) = run("naive"), run("chunk_mosaic")
        assert_close("o", o_ref.astype(jnp.float32), o.astype(jnp.float32), BF16_TOL["o"])
        assert_close("S", S_ref, S, BF16_TOL["S"])
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)

"""`chunk.settings(cotangents="compute")`: the cotangents of the intra-chunk pieces that are only
bf16 matmul operands are rounded to bf16 before the pull-back (half the bytes on the GPU). The
gradients must stay within the bf16 tolerances and near the float32-cotangent errors; float32
inputs are untouched."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk
from tests.kernels.test_kda_chunk import make_inputs, relative_errors
from tests.kernels.test_kda_residuals import _grads


def test_compute_cotangents_keep_bf16_accuracy(rng):
    """bf16, K = V = 128, resets: every gradient within the bf16 tolerances (`relative_errors`
    asserts them) and at most 30% above its error with float32 cotangents (measured: about 10%),
    and the rounding does take effect (the gradients differ)."""
    inputs = make_inputs(rng, 1, 256, 2, 128, 128, "channel", lower=-5.0, seg="random")
    base = relative_errors(inputs, cotangents="state")
    got = relative_errors(inputs, cotangents="compute")
    assert base[:2] == got[:2]  # o and S: the forward is unchanged
    for b, x in zip(base, got):
        assert x <= 1.3 * b + 2e-4, (base, got)
    assert got[2:] != base[2:]


def test_float32_inputs_are_untouched(rng):
    """For float32 inputs the compute dtype is the state dtype: nothing is rounded."""
    inputs = make_inputs(rng, 1, 130, 2, 64, 64, "channel", lower=-5.0, seg="random")
    state, compute = (_grads(inputs, jnp.float32, cotangents=c)[0] for c in ("state", "compute"))
    for a, b in zip(state, compute):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_cotangents_value_is_an_error():
    with pytest.raises(ValueError, match="cotangents='bf16'"):
        with chunk.settings(cotangents="bf16"):
            pass
    assert chunk.COTANGENTS in chunk.COTANGENT_CHOICES and "cotangents" in chunk.SETTINGS


@pytest.mark.gpu
def test_gpu_compute_cotangents_keep_bf16_accuracy(rng):
    """On a GPU (bf16x3 diagonal tiles on the tensor cores), T = 1024, K = V = 128, resets: the
    same bounds as on the CPU."""
    inputs = make_inputs(rng, 1, 1024, 4, 128, 128, "channel", lower=-5.0, seg="random")
    base = relative_errors(inputs, cotangents="state")
    got = relative_errors(inputs, cotangents="compute")
    for b, x in zip(base, got):
        assert x <= 1.3 * b + 2e-4, (base, got)

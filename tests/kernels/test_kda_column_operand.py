"""`chunk_intra.column_operand` (the off-diagonal tiles' column side with a recomputing VJP) against
autodiff of its plain expression, in float64 and in the compute dtype bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk_intra
from kernels.kda.chunk_intra import TILE


def _plain(k, G, Ga):
    Cm, nt = G.shape[-2] - TILE, Ga.shape[-3] + 1
    keep = (jnp.arange(Cm)[None, :] < TILE * jnp.arange(1, nt)[:, None])[:, :, None]
    return k[..., None, :Cm, :] * jnp.exp(jnp.where(keep, Ga - G[..., None, :Cm, :], -jnp.inf))


def _inputs(rng, dtype):
    G = np.cumsum(-0.5 * rng.uniform(size=(2, 3, 64, 16)), axis=-2)  # no underflow to 0 in float32
    Ga = G[..., TILE::TILE, :][..., :, None, :]  # the anchors of row tiles 1..3: [2, 3, 3, 1, 16]
    k = rng.standard_normal((2, 3, 64, 16))
    return (jnp.asarray(x, dtype) for x in (k, G, Ga))


def test_values_and_gradients_match_autodiff_float64(rng):
    with jax.enable_x64(True):
        k, G, Ga = _inputs(rng, jnp.float64)
        ct = jnp.asarray(rng.standard_normal((2, 3, 3, 48, 16)))
        want, pull = jax.vjp(_plain, k, G, Ga)
        got, pull_got = jax.vjp(lambda *a: chunk_intra.column_operand(*a, jnp.dtype(jnp.float64)), k, G, Ga)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
        for a, b in zip(pull(ct), pull_got(ct)):
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * float(jnp.max(jnp.abs(a))))


def test_compute_dtype_output_and_float32_gradients(rng):
    """bf16 output (the rounded float32 operand); gradients from the bf16 cotangent in float32, as
    autodiff of the rounded plain expression gives them."""
    k, G, Ga = _inputs(rng, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((2, 3, 3, 48, 16)), jnp.bfloat16)
    got, pull_got = jax.vjp(lambda *a: chunk_intra.column_operand(*a, jnp.dtype(jnp.bfloat16)), k, G, Ga)
    want, pull = jax.vjp(lambda *a: _plain(*a).astype(jnp.bfloat16), k, G, Ga)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for a, b in zip(pull(ct), pull_got(ct)):
        assert b.dtype == jnp.float32
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))


@pytest.mark.parametrize("C", [64, 32])
def test_masked_entries_are_zero(rng, C):
    k, G, Ga = _inputs(rng, jnp.float32)
    k, G, Ga = k[..., :C, :], G[..., :C, :], Ga[..., : C // TILE - 1, :, :]
    out = np.asarray(chunk_intra.column_operand(k, G, Ga, jnp.dtype(jnp.float32)))
    for i in range(C // TILE - 1):
        assert np.all(out[..., i, TILE * (i + 1):, :] == 0) and np.all(out[..., i, : TILE * (i + 1), :] != 0)

"""`chunk.settings(residuals="states_vn")`: the forward keeps v' (the corrected values its state
pass writes) beside the chunk states, so the backward skips u = Ai bv and the w S_n product. Same
gradients as recomputing v'; the products are gone from the backward; remat's "dots16" keeps it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, kda
from tests.jaxprs import equations
from tests.kernels.test_kda_chunk import make_inputs


def _loss(impl, h0, seg):
    def loss(q, k, v, g, beta):
        o, S = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, lower_bound=-5.0, output_final_state=True,
                   impl=impl)
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.shape[-1]))) + jnp.sum(S[..., 0, :])

    return loss


def _grads(inputs, dtype, impl="chunk", **settings):
    q, k, v, g, beta, h0, seg = inputs
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), g, beta)
    with chunk.settings(**settings):
        f = jax.grad(_loss(impl, h0, jnp.asarray(seg)), argnums=range(5))
        return f(*args), jax.make_jaxpr(f)(*args)


def _dots(jaxpr) -> int:
    """dot_general equations, nested jaxprs included."""
    return sum(e.primitive.name == "dot_general" for e in equations(jaxpr))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-6)])
def test_kept_vn_gives_the_recomputed_gradients_with_two_products_fewer(rng, dtype, tol):
    inputs = make_inputs(rng, 2, 130, 2, 64, 64, "channel", lower=-5.0, seg="random")
    base, base_jaxpr = _grads(inputs, dtype, residuals="states")
    kept, kept_jaxpr = _grads(inputs, dtype, residuals="states_vn")
    for a, b in zip(base, kept):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(a))
    assert _dots(kept_jaxpr.jaxpr) == _dots(base_jaxpr.jaxpr) - 2


def test_linear_attention_keeps_no_vn(rng):
    """Linear attention has no v' (its values are v): the setting changes nothing there."""
    from kernels.kda import linear_attention

    q, k, v, g, *_ = make_inputs(rng, 1, 70, 2, 32, 32, "channel", lower=-5.0)
    f = lambda *a: jnp.sum(linear_attention(*a, impl="chunk")[0])  # noqa: E731
    with chunk.settings(residuals="states"):
        base = jax.grad(f, argnums=range(3))(q, k, v, g)
    with chunk.settings(residuals="states_vn"):
        kept = jax.grad(f, argnums=range(3))(q, k, v, g)
    for a, b in zip(base, kept):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dots16_saves_the_kept_vn():
    from kimi_jax import remat

    assert chunk.VN_NAME in remat.SAVED_NAMES and chunk.STATES_NAME in remat.SAVED_NAMES


def test_unknown_residuals_value_is_an_error():
    with pytest.raises(ValueError, match="residuals='vn'"):
        with chunk.settings(residuals="vn"):
            pass

"""kimi_jax.attn_res.read (per-source fusions, hand-written VJP) against the stacked reference
read_reference differentiated by autodiff: outputs and gradients of every source and of w."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.attn_res import AttnResRead, read, read_reference


def _inputs(S, shape, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), S + 2)
    # sources of different scales, so the softmax is far from uniform
    sources = tuple((1.0 + i) * jax.random.normal(keys[i], shape).astype(dtype) for i in range(S))
    w = jax.random.normal(keys[S], shape[-1:]) * 0.7
    g = jax.random.normal(keys[S + 1], shape)
    return sources, w, g


@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 8)])
def test_read_matches_reference_float32(S, shape):
    sources, w, g = _inputs(S, shape, jnp.float32, seed=S)
    out, ref = read(sources, w, 1e-5), read_reference(sources, w, 1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda src, w: jnp.sum(f(src, w, 1e-5) * g)  # noqa: E731
    got = jax.grad(loss(read), argnums=(0, 1))(sources, w)
    want = jax.grad(loss(read_reference), argnums=(0, 1))(sources, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_read_bf16_sources_keep_their_dtype_and_match():
    sources, w, g = _inputs(3, (2, 6, 32), jnp.bfloat16, seed=7)
    out, ref = read(sources, w, 1e-5), read_reference(sources, w, 1e-5)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)  # both read bf16 exactly into f32
    grads = jax.grad(lambda src: jnp.sum(read(src, w, 1e-5) * g))(sources)
    want = jax.grad(lambda src: jnp.sum(read_reference(src, w, 1e-5) * g))(sources)
    for a, b in zip(grads, want):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def test_read_site_gradients_reach_norm_and_query():
    site = AttnResRead(16, rngs=nnx.Rngs(0))
    site.query[...] = jax.random.normal(jax.random.PRNGKey(1), (16,))
    sources, _, g = _inputs(2, (2, 4, 16), jnp.float32, seed=3)

    def loss(site, fn):
        w = site.norm[...] * site.query[...]
        return jnp.sum(fn(sources, w, site.eps) * g)
    got = nnx.grad(lambda m: loss(m, read))(site)
    want = nnx.grad(lambda m: loss(m, read_reference))(site)
    for name in ("norm", "query"):
        a, b = getattr(got, name)[...], getattr(want, name)[...]
        assert np.abs(b).max() > 1e-3  # a real gradient, not zeros
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5)


def test_sources_of_different_shapes_are_an_error():
    site = AttnResRead(8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="share one shape"):
        site([jnp.zeros((2, 8)), jnp.zeros((3, 8))])


def test_saved_read_output_is_behind_a_barrier_with_the_same_values():
    """attn_res.read_out("saved"): the output passes an optimization barrier (in the forward and
    the backward program), values and gradients unchanged; a bad mode raises."""
    from kimi_jax import attn_res

    site = AttnResRead(16, rngs=nnx.Rngs(0))
    site.query[...] = jax.random.normal(jax.random.PRNGKey(3), (16,))
    sources, _, g = _inputs(3, (2, 5, 16), jnp.float32, seed=4)
    graphdef, state = nnx.split(site)

    def loss(state, src):
        return jnp.sum(nnx.merge(graphdef, state)(list(src)) * g)

    results = {}
    for mode in attn_res.READ_OUT_MODES:
        grad = jax.value_and_grad(lambda *a: loss(*a), argnums=(0, 1))  # a new function: traced afresh
        with attn_res.read_out(mode):
            text = str(jax.make_jaxpr(grad)(state, sources))
            results[mode] = grad(state, sources)
        assert ("optimization_barrier" in text) == (mode == "saved")
    for a, b in zip(jax.tree.leaves(results["saved"]), jax.tree.leaves(results["xla"])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="READ_OUT='kept'"):
        with attn_res.read_out("kept"):
            pass

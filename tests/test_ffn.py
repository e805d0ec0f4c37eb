"""The GLU activations' two backward modes (kimi_jax.ffn.GLU_VJP): the recomputing custom VJP
matches autodiff and keeps only gate and up for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import ffn


def _grads(act, gate, up, mode):
    ct = jnp.cos(jnp.arange(gate.size, dtype=jnp.float32).reshape(gate.shape))
    with ffn.glu_vjp(mode):
        out, pull = jax.vjp(act, gate, up)
    return out, pull(ct)


ACTS = {"swiglu": ffn.swiglu, "situ": ffn.situ_glu,
        "situ_narrow": lambda g, u: ffn.situ_glu(g, u, beta=0.7, linear_beta=1.3)}


@pytest.mark.parametrize("name", list(ACTS))
def test_recompute_vjp_matches_autodiff(name):
    gate = jnp.linspace(-12.0, 12.0, 96).reshape(8, 12)
    up = jnp.flip(gate, 0) * 3.0 + 0.5  # up to +-36: past SiTU's tanh bound of 25
    out_a, (dg_a, du_a) = _grads(ACTS[name], gate, up, "autodiff")
    out_r, (dg_r, du_r) = _grads(ACTS[name], gate, up, "recompute")
    np.testing.assert_allclose(out_r, out_a, rtol=1e-6)
    np.testing.assert_allclose(dg_r, dg_a, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(du_r, du_a, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["swiglu", "situ"])
def test_recompute_vjp_keeps_only_gate_and_up_in_their_dtype(name):
    gate = jax.random.normal(jax.random.key(0), (4, 16), jnp.bfloat16)
    up = jax.random.normal(jax.random.key(1), (4, 16), jnp.bfloat16)
    f = lambda g, u: ACTS[name](g, u).astype(jnp.bfloat16)  # noqa: E731 - as the MLP casts it

    def saved(mode):  # the arrays the backward closes over (the leaves of jax.vjp's pull-back)
        with ffn.glu_vjp(mode):
            pull = jax.vjp(f, gate, up)[1]
        return sorted(f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(pull) if x.ndim)

    assert saved("recompute") == ["bfloat16[4, 16]", "bfloat16[4, 16]"]
    assert len(saved("autodiff")) > 2 and any(a.startswith("float32") for a in saved("autodiff"))
    with ffn.glu_vjp("recompute"):
        dg, du = jax.grad(lambda g, u: f(g, u).astype(jnp.float32).sum(), argnums=(0, 1))(gate, up)
    assert dg.dtype == du.dtype == jnp.bfloat16
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    want = jax.grad(lambda g, u: ACTS[name](g, u).sum(), argnums=(0, 1))(g32, u32)
    np.testing.assert_allclose(np.float32(dg), want[0], rtol=1e-2, atol=1e-2)  # bf16 rounding of the result
    np.testing.assert_allclose(np.float32(du), want[1], rtol=1e-2, atol=1e-2)


def test_mlp_gradients_equal_under_both_modes_and_bad_mode_raises():
    mlp = ffn.MLP(8, 16, activation="situ", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 3, 8))

    def grads(mode):
        with ffn.glu_vjp(mode):
            return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(mlp)
    a, r = grads("autodiff"), grads("recompute")
    for ga, gr in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
        np.testing.assert_allclose(gr, ga, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="GLU_VJP"):
        with ffn.glu_vjp("fused"):
            pass

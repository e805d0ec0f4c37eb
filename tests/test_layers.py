"""Basic layers: exact values on hand-set weights, dtypes, the short conv against a NumPy
convolution (packed and step-by-step), RoPE's relative-position property, logical axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.layers import (
    Embed,
    GatedRMSNorm,
    Linear,
    RMSNorm,
    ShortConv,
    apply_rope,
    l2_normalize,
    param,
    segment_positions,
)
from kimi_jax import layers
from kimi_jax.sharding import LOGICAL_AXIS_RULES


def _set(p, value):
    p[...] = jnp.asarray(value, p[...].dtype)


def test_linear_dense_general_exact(rng):
    lin = Linear((2, 3), (4, 5), axes=("heads", "head_dim", "embed", "mlp"), use_bias=True, rngs=nnx.Rngs(0))
    w = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    b = rng.normal(size=(4, 5)).astype(np.float32)
    _set(lin.kernel, w)
    _set(lin.bias, b)
    x = rng.normal(size=(7, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(lin(jnp.asarray(x)), np.einsum("nij,ijkl->nkl", x, w) + b, rtol=1e-5, atol=1e-5)
    assert lin.kernel.get_metadata()["out_sharding"] == ("heads", "head_dim", "embed", "mlp")
    assert lin.bias.get_metadata()["out_sharding"] == ("embed", "mlp")


def test_linear_compute_and_param_dtypes():
    lin = Linear(8, 4, axes=("embed", "mlp"), dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert lin.kernel[...].dtype == jnp.float32
    assert lin(jnp.ones((2, 8), jnp.float32)).dtype == jnp.bfloat16


def test_linear_rejects_bad_axes_and_shapes():
    with pytest.raises(ValueError, match="axes"):
        Linear(8, 4, axes=("embed",), rngs=nnx.Rngs(0))
    lin = Linear(8, 4, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="x.shape"):
        lin(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="one logical name per dimension"):
        param(nnx.Rngs(0), nnx.initializers.zeros, (2, 3), ("embed",), jnp.float32)


def test_rmsnorm_exact_and_dtype(rng):
    x = rng.normal(size=(3, 16)).astype(np.float32)
    w = rng.normal(size=(16,)).astype(np.float32)
    norm = RMSNorm(16, eps=1e-5, rngs=nnx.Rngs(0))
    _set(norm.scale, w)
    ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-6)
    bf = RMSNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert bf(jnp.asarray(x)).dtype == jnp.bfloat16
    assert norm.scale.get_metadata()["out_sharding"] == ("norm",)


def test_gated_rmsnorm_exact(rng):
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    g = rng.normal(size=(2, 3, 8)).astype(np.float32)
    norm = GatedRMSNorm(8, eps=1e-5, rngs=nnx.Rngs(0))
    ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-5) / (1 + np.exp(-g))
    np.testing.assert_allclose(norm(jnp.asarray(x), jnp.asarray(g)), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gate must match"):
        norm(jnp.asarray(x), jnp.asarray(g[..., :4]))


def test_embed_lookup_and_attend(rng):
    emb = Embed(11, 6, rngs=nnx.Rngs(0))
    table = np.asarray(emb.embedding[...])
    tok = jnp.asarray([[1, 4, 10]], jnp.int32)
    np.testing.assert_array_equal(emb(tok), table[[1, 4, 10]][None])
    x = rng.normal(size=(2, 6)).astype(np.float32)
    np.testing.assert_allclose(emb.attend(jnp.asarray(x)), x @ table.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="integer"):
        emb(jnp.ones((2,), jnp.float32))


def _conv_ref(x, w, seg):
    """NumPy causal depthwise conv + SiLU, restarting at segment boundaries. x [B, T, C]."""
    B, T, C = x.shape
    W = w.shape[0]
    y = np.zeros_like(x)
    for b in range(B):
        for t in range(T):
            for i in range(W):
                s = t - (W - 1 - i)
                if s >= 0 and seg[b, s] == seg[b, t]:
                    y[b, t] += w[i] * x[b, s]
    return y / (1 + np.exp(-y))


def test_short_conv_matches_numpy_with_segments(rng):
    conv = ShortConv(5, kernel_size=4, axes=("heads",), rngs=nnx.Rngs(0))
    w = np.asarray(conv.weight[...])
    x = rng.normal(size=(2, 9, 5)).astype(np.float32)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 2], [0] * 9], np.int32)
    out = conv(jnp.asarray(x), jnp.asarray(seg))
    np.testing.assert_allclose(out, _conv_ref(x, w, seg), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conv(jnp.asarray(x)), _conv_ref(x, w, np.zeros((2, 9))), rtol=1e-5, atol=1e-6)
    assert conv.weight.get_metadata()["out_sharding"] == ("conv", "heads")


def test_short_conv_step_equals_full(rng):
    conv = ShortConv((2, 3), kernel_size=4, axes=("heads", "head_dim"), rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.normal(size=(2, 6, 2, 3)).astype(np.float32))
    full = conv(x)
    cache = conv.init_cache(2, jnp.float32)
    assert cache.shape == (2, 3, 2, 3)
    for t in range(6):
        y, cache = conv.step(x[:, t], cache)
        np.testing.assert_allclose(y, full[:, t], rtol=1e-5, atol=1e-6)


def test_segment_positions():
    seg = jnp.asarray([[0, 0, 1, 1, 1, 4], [3, 3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(segment_positions(seg, 6, 2), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(segment_positions(None, 3, 2), [[0, 1, 2], [0, 1, 2]])


def test_rope_is_relative_and_norm_preserving(rng):
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)).astype(np.float32))
    rot = lambda x, p: apply_rope(x, jnp.full((1, 1), p), 10000.0)[0, 0, 0]
    dots = [float(rot(q, m) @ rot(k, m - 3)) for m in (3, 7, 20)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rot(q, 5)), jnp.linalg.norm(q), rtol=1e-5)
    np.testing.assert_allclose(rot(q, 0), q[0, 0, 0], rtol=1e-6)
    assert not np.allclose(rot(q, 1), q[0, 0, 0])
    with pytest.raises(ValueError, match="even"):
        apply_rope(jnp.ones((1, 2, 1, 3)), jnp.zeros((1, 2), jnp.int32), 10000.0)


def test_l2_normalize():
    x = jnp.asarray([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(l2_normalize(x), [[0.6, 0.8], [0.0, 0.0]], atol=1e-6)


def test_params_shard_eagerly_under_a_mesh():
    mesh = jax.make_mesh((2, 2, 2), ("fsdp", "tensor", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
        lin = Linear(8, 6, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
    spec = lin.kernel[...].sharding.spec
    assert tuple(spec) == ("fsdp", "tensor")
    with jax.set_mesh(mesh), nnx.use_eager_sharding(False):  # the context switch is respected
        lin = Linear(8, 6, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
    assert lin.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


def _norm_grads(module, x, gate, mode):
    ct = jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape))

    def loss(m, x, gate):
        y = m(x) if gate is None else m(x, gate)
        return jnp.sum(y.astype(jnp.float32) * ct)
    with layers.norm_vjp(mode):
        argnums = (0, 1) if gate is None else (0, 1, 2)
        return nnx.grad(loss, argnums=argnums)(module, x, gate)


@pytest.mark.parametrize("gated", [False, True])
def test_norm_recompute_vjp_matches_autodiff(gated):
    """layers.NORM_VJP = "recompute" (custom VJP keeping x, the gate and the inverse RMS) against
    autodiff: gradients of x, the scale and the gate, float32, with a non-trivial scale."""
    cls = layers.GatedRMSNorm if gated else layers.RMSNorm
    m = cls(16, rngs=nnx.Rngs(0))
    m.scale[...] = jnp.linspace(0.5, 1.5, 16)
    x = jax.random.normal(jax.random.key(0), (2, 3, 16)) * 3.0
    gate = jax.random.normal(jax.random.key(1), x.shape) if gated else None
    a = _norm_grads(m, x, gate, "autodiff")
    r = _norm_grads(m, x, gate, "recompute")
    for ga, gr in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
        np.testing.assert_allclose(gr, ga, rtol=2e-5, atol=2e-6)
    with layers.norm_vjp("recompute"):
        y_r = m(x) if gate is None else m(x, gate)
    np.testing.assert_allclose(y_r, m(x) if gate is None else m(x, gate), rtol=1e-6)


def test_norm_recompute_vjp_keeps_x_and_gate_in_their_dtype():
    m = layers.GatedRMSNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (4, 16), jnp.bfloat16)

    def saved(mode):  # the arrays the backward closes over
        with layers.norm_vjp(mode):
            pull = jax.vjp(lambda x, g: m(x, g), x, x)[1]
        return sorted(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(pull) if a.ndim)

    assert saved("recompute") == ["bfloat16[4, 16]", "bfloat16[4, 16]", "float32[16]", "float32[4, 1]"]
    assert sum(a.startswith("float32[4, 16]") for a in saved("autodiff")) >= 3
    with pytest.raises(ValueError, match="NORM_VJP"):
        with layers.norm_vjp("fused"):
            pass


def test_l2_normalize_recompute_vjp_matches_autodiff():
    x = jax.random.normal(jax.random.key(3), (2, 5, 3, 16)) * 2.0
    x = x.at[0, 0, 0].set(0.0)  # a zero row: eps keeps it finite in both
    ct = jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape))

    def grad(mode):
        with layers.norm_vjp(mode):
            return jax.grad(lambda x: jnp.sum(layers.l2_normalize(x) * ct))(x)
    np.testing.assert_allclose(grad("recompute"), grad("autodiff"), rtol=2e-5, atol=1e-5)
    xb = x.astype(jnp.bfloat16)
    with layers.norm_vjp("recompute"):
        pull = jax.vjp(layers.l2_normalize, xb)[1]
    assert sorted(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(pull) if a.ndim) == [
        "bfloat16[2, 5, 3, 16]", "float32[2, 5, 3, 1]"]

"""causal_conv_silu's custom VJP against autodiff of the plain padded-taps formulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import layers
from kimi_jax.layers import ShortConv, causal_conv_silu


def plain_conv_silu(x, w, segment_ids=None):
    """The straightforward formulation (pad, per-tap masked slices), differentiated by JAX."""
    B, T = x.shape[:2]
    W, extra = w.shape[0], x.ndim - 2
    xp = jnp.pad(x, [(0, 0), (W - 1, 0)] + [(0, 0)] * extra)
    wf = w.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32)
    for i in range(W):
        tap = xp[:, i : i + T]
        if segment_ids is not None:
            sp = jnp.pad(segment_ids, [(0, 0), (W - 1, 0)], constant_values=-1)
            same = (sp[:, i : i + T] == segment_ids).reshape((B, T) + (1,) * extra)
            tap = jnp.where(same, tap, 0)
        y = y + tap.astype(jnp.float32) * wf[i]
    return jax.nn.silu(y).astype(x.dtype)


def _segments(B, T, seed):
    r = np.random.default_rng(seed)
    starts = r.random((B, T)) < 0.15
    starts[:, 0] = False
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def _grads(fn, x, w, seg, dy):
    def loss(x, w):
        return jnp.sum(fn(x, w, seg).astype(jnp.float32) * dy)

    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.parametrize("conv_dw", layers.CONV_DW_MODES)
@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("channels", [(5,), (3, 4)])
def test_vjp_matches_autodiff_f32(W, segmented, channels, conv_dw):
    B, T = 2, 19
    kx, kw, kd = jax.random.split(jax.random.key(W * 10 + len(channels)), 3)
    x = jax.random.normal(kx, (B, T) + channels, jnp.float32)
    w = jax.random.normal(kw, (W,) + channels, jnp.float32)
    dy = jax.random.normal(kd, (B, T) + channels, jnp.float32)
    seg = _segments(B, T, W) if segmented else None
    np.testing.assert_allclose(causal_conv_silu(x, w, seg), plain_conv_silu(x, w, seg), rtol=1e-6, atol=1e-6)
    with layers.conv_dw(conv_dw):  # the tap sums' formulation, read while the backward is traced
        (l1, (dx1, dw1)) = _grads(causal_conv_silu, x, w, seg, dy)
    (l2, (dx2, dw2)) = _grads(plain_conv_silu, x, w, seg, dy)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw1, dw2, rtol=1e-5, atol=1e-5)


def test_segment_reset_blocks_gradient_across_documents():
    """A token's output must not depend on an earlier document's tokens (and vice versa for dx)."""
    B, T, C, W = 1, 12, 3, 4
    x = jax.random.normal(jax.random.key(0), (B, T, C))
    w = jax.random.normal(jax.random.key(1), (W, C))
    seg = jnp.asarray([[0] * 6 + [1] * 6], jnp.int32)
    jac = jax.jacrev(lambda x: causal_conv_silu(x, w, seg)[0, 6:])(x)  # outputs of document 1
    assert float(jnp.abs(jac[..., :6, :]).max()) == 0.0
    assert float(jnp.abs(jac).max()) > 0.0


@pytest.mark.parametrize("segmented", [False, True])
def test_vjp_matches_autodiff_bf16(segmented):
    B, T, C, W = 2, 64, 32, 4
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (B, T, C), jnp.bfloat16)
    w = (0.5 * jax.random.normal(kw, (W, C))).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (B, T, C), jnp.float32)
    seg = _segments(B, T, 7) if segmented else None
    y1, y2 = causal_conv_silu(x, w, seg), plain_conv_silu(x, w, seg)
    assert y1.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))
    (_, (dx1, dw1)), (_, (dx2, dw2)) = _grads(causal_conv_silu, x, w, seg, dy), _grads(plain_conv_silu, x, w, seg, dy)
    assert dx1.dtype == jnp.bfloat16 and dw1.dtype == jnp.bfloat16
    # autodiff sums the W per-tap dx contributions in bf16; the VJP sums them in float32.
    np.testing.assert_allclose(np.asarray(dx1, np.float32), np.asarray(dx2, np.float32), rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(dw1, np.float32), np.asarray(dw2, np.float32), rtol=2e-2, atol=2e-2)


def test_short_conv_module_grads_match_plain():
    """ShortConv (bf16 compute, float32 params) gives the plain formulation's parameter grads."""
    conv = ShortConv((2, 8), kernel_size=4, axes=("heads", "head_dim"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(5), (2, 33, 2, 8), jnp.bfloat16)
    seg = _segments(2, 33, 1)

    def loss(w, fn):
        return jnp.sum(fn(x, w.astype(jnp.bfloat16), seg).astype(jnp.float32) ** 2)

    w = conv.weight[...]
    g1, g2 = jax.grad(loss)(w, causal_conv_silu), jax.grad(loss)(w, plain_conv_silu)
    assert g1.dtype == jnp.float32
    np.testing.assert_allclose(g1, g2, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(
        np.asarray(conv(x, seg), np.float32), np.asarray(plain_conv_silu(x, w.astype(jnp.bfloat16), seg), np.float32)
    )


def test_conv_dw_setting_is_checked_and_restored():
    with pytest.raises(ValueError, match="CONV_DW"):
        with layers.conv_dw("tree"):
            pass
    before = layers.CONV_DW
    with layers.conv_dw("per_tap"):
        assert layers.CONV_DW == "per_tap"
    assert layers.CONV_DW == before


@pytest.mark.parametrize("kind", ["cpu", "other", "hopper"])
def test_auto_picks_the_kernel_with_da_only_on_hopper(kind, monkeypatch):
    """CONV_DW="auto" (the default) traces the kernel backward reading da ("pallas_gpu_da": da
    behind a barrier, the Mosaic GPU kernel) on a Hopper GPU and XLA's stacked tap sums elsewhere."""
    from kernels.kda import hopper
    from kernels.short_conv import ops

    assert layers.CONV_DW == "auto"
    monkeypatch.setattr(hopper, "device_kind", lambda: kind)
    monkeypatch.setattr(ops, "device_kind", lambda: kind)
    B, T, C, W = 2, 128, 32, 4
    x = jax.random.normal(jax.random.key(0), (B, T, C), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (W, C), jnp.float32)
    grad = jax.grad(lambda x, w: jnp.sum(causal_conv_silu(x, w).astype(jnp.float32)), argnums=(0, 1))
    text = str(jax.make_jaxpr(grad)(x, w))
    kernel = any(name in text for name in ("pallas_call", "mpmd_map"))  # how jax 0.11 names plgpu.kernel
    assert kernel == (kind == "hopper")
    assert ("optimization_barrier" in text) == (kind == "hopper")

"""The short convolution's tap-gradient kernel (Mosaic GPU, interpreted on CPU) against XLA's tap
sums in `kimi_jax.layers`: values, masks of packed documents, the mesh, the fallback."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kernels.short_conv import ops, pallas_gpu, reference
from kimi_jax import layers
from kimi_jax.sharding import make_mesh


def _inputs(B, T, chans, W, dtype, seed=0, segmented=False):
    kx, kw, kd, ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (B, T) + chans, jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (B, T) + chans, jnp.float32).astype(dtype)
    w = 0.5 * jax.random.normal(kw, (W,) + chans, jnp.float32)
    seg = jnp.cumsum(jax.random.bernoulli(ks, 0.03, (B, T)), axis=1).astype(jnp.int32) if segmented else None
    return x, dy, w, seg


def _grads(mode, x, w, seg, dy):
    loss = lambda x, w: jnp.vdot(layers.causal_conv_silu(x, w, seg).astype(jnp.float32), dy.astype(jnp.float32))
    with layers.conv_dw(mode):
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def _same_dx(dx, dx_ref):
    """dx is XLA's in both modes; fused differently, a bf16 result may round the other way."""
    rtol = 1e-6 if dx.dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("mode", ["pallas_gpu", "pallas_gpu_da"])
@pytest.mark.parametrize("W,chans,dtype,segmented", [
    (4, (2, 32), jnp.bfloat16, True),
    (4, (64,), jnp.float32, False),
    (2, (2, 32), jnp.float32, True),
    (1, (32,), jnp.bfloat16, False),
])
def test_kernel_matches_xla_tap_sums(W, chans, dtype, segmented, mode):
    x, dy, w, seg = _inputs(2, 256, chans, W, dtype, seed=W, segmented=segmented)
    dx_ref, dw_ref = _grads("stacked", x, w, seg, dy)
    dx, dw = _grads(mode, x, w, seg, dy)
    _same_dx(dx, dx_ref)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=2e-4 * float(jnp.max(jnp.abs(dw_ref))))
    assert float(jnp.max(jnp.abs(dw_ref))) > 1.0  # a real signal, not two zero arrays


@pytest.mark.parametrize("splits,slots,block_c,dtype", [(1, 2, 32, jnp.float32), (3, 3, 32, jnp.bfloat16),
                                                         (1, 4, 32, jnp.bfloat16), (3, 2, 64, jnp.bfloat16)])
def test_splits_slots_and_channel_blocks(splits, slots, block_c, dtype):
    """Row splits, TMA ring depths and channels per program give the same sums (3 tiles: one split
    of 3, three of 1; 128 channels: four blocks of 32 or two of 64)."""
    B, T, C, W = 1, 384, 128, 4
    x, dy, w, seg = _inputs(B, T, (C,), W, dtype, seed=7, segmented=True)
    masks = ops.tap_masks(seg, B, T, W)
    got = pallas_gpu.tap_grads(x, dy, w, masks, splits=splits, slots=slots, block_c=block_c, interpret=True)
    want = _grads("stacked", x, w, seg, dy)[1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))


def test_masks_cut_documents_and_the_start():
    seg = jnp.array([[0, 0, 1, 1, 1, 2]])
    m = np.asarray(ops.tap_masks(seg, 1, 6, 3))
    np.testing.assert_array_equal(m[0, 2], np.ones(6))  # the current token
    np.testing.assert_array_equal(m[0, 1], [0, 1, 0, 1, 1, 0])  # one step back
    np.testing.assert_array_equal(m[0, 0], [0, 0, 0, 0, 1, 0])  # two steps back
    np.testing.assert_array_equal(np.asarray(ops.tap_masks(None, 1, 4, 3))[0, 0], [0, 0, 1, 1])


def test_reference_matches_xla_tap_sums():
    B, T, C, W = 2, 50, 8, 4
    x, dy, w, seg = _inputs(B, T, (C,), W, jnp.float32, seed=5, segmented=True)
    got = reference.tap_grads(x, dy, w, ops.tap_masks(seg, B, T, W))
    np.testing.assert_allclose(got, _grads("stacked", x, w, seg, dy)[1], rtol=1e-5, atol=1e-5)


def test_on_a_mesh_matches_one_device(monkeypatch):
    """Batch over "data", heads over "tensor": per-shard calls, partial sums added outside.

    The Mosaic GPU interpreter keeps one global simulated memory and cannot run on 8 fake CPU
    devices at once, so each shard runs the reference (checked against the kernel above); what
    is tested is the sharding wiring.
    """
    calls = []

    def per_shard(x, dy, w, masks, *, from_da, per_batch, interpret):
        calls.append(x.shape)
        return reference.tap_grads(x, dy, w, masks, from_da=from_da, per_batch=per_batch)

    monkeypatch.setattr(pallas_gpu, "tap_grads", per_shard)
    x, dy, w, seg = _inputs(4, 128, (4, 32), 4, jnp.float32, seed=3, segmented=True)
    want = _grads("stacked", x, w, seg, dy)
    mesh = make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    xs = P("data", None, "tensor", None)
    with jax.set_mesh(mesh):
        got = _grads("pallas_gpu", put(x, xs), put(w, P(None, "tensor", None)), put(seg, P("data", None)),
                     put(dy, xs))
    assert calls == [(1, 128, 64)]  # one shard: batch over data x fsdp, heads / 2 (2 x 32 channels)
    _same_dx(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)


def test_unsupported_call_falls_back_and_says_why(caplog):
    x, dy, w, seg = _inputs(2, 100, (32,), 4, jnp.float32)  # T not a multiple of 128
    ops._say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=ops.__name__):
        got = _grads("pallas_gpu", x, w, seg, dy)
    assert "T=100 is not a multiple of 128" in caplog.text
    want = _grads("stacked", x, w, seg, dy)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_shard_shape_decides_the_fallback(caplog):
    """Heads over "tensor": 2 heads of 16 channels are 32 (a whole block) on one device, 16 per shard."""
    x, dy, w, seg = _inputs(4, 128, (2, 16), 4, jnp.float32, seed=4)
    mesh = make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    xs = P("data", None, "tensor", None)
    assert ops.unsupported_reason(x, 4) is None
    ops._say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=ops.__name__), jax.set_mesh(mesh):
        assert ops.unsupported_reason(x, 4) == "channels=16 is not a multiple of 32"
        got = _grads("pallas_gpu", put(x, xs), put(w, P(None, "tensor", None)), None, put(dy, xs))
    assert "channels=16 is not a multiple of 32" in caplog.text
    np.testing.assert_allclose(got[1], _grads("stacked", x, w, None, dy)[1], rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    x = jnp.zeros((1, 256, 32), jnp.float32)
    m = jnp.ones((1, 4, 256), jnp.float32)
    w = jnp.zeros((4, 32), jnp.float32)
    with pytest.raises(ValueError, match="must divide"):
        pallas_gpu.tap_grads(x, x, w, m, splits=3, interpret=True)
    with pytest.raises(ValueError, match="slots >= 2"):
        pallas_gpu.tap_grads(x, x, w, m, slots=1, interpret=True)
    with pytest.raises(ValueError, match="masks"):
        pallas_gpu.tap_grads(x, x, w, m[:, :3], interpret=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        pallas_gpu.tap_grads(x[..., :16], x[..., :16], w[:, :16], m, interpret=True)
    assert pallas_gpu.unsupported_reason(256, 32, 10, jnp.float32).startswith("kernel_size=10")
    x8, m8 = jnp.zeros((1, 1024, 32), jnp.float32), jnp.ones((1, 4, 1024), jnp.float32)  # 8 tiles
    with pytest.raises(ValueError, match="need 329 KiB of SMEM"):  # 4 slots of float32 tiles
        pallas_gpu.tap_grads(x8, x8, w, m8, splits=1, slots=4, interpret=True)
    assert pallas_gpu.unsupported_reason(256, 32, 4, jnp.bfloat16, slots=4) is None
    with pytest.raises(ValueError, match=r"block_c=48 \(the kernel takes \(32, 64\)\)"):
        pallas_gpu.tap_grads(x, x, w, m, block_c=48, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        pallas_gpu.tap_grads(x, x, w, m, block_c=64, interpret=True)


def test_row_splits_fill_the_gpu():
    assert pallas_gpu.row_splits(4, 4096, 2048) == 2  # 256 programs of 16 tiles -> 512
    assert pallas_gpu.row_splits(1, 65536, 2048) == 8  # 64 programs -> 512
    assert pallas_gpu.row_splits(64, 512, 2048) == 1  # already 4096 programs
    assert pallas_gpu.row_splits(1, 384, 32) == 1  # 3 tiles: too few to split


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pallas_gpu", "pallas_gpu_da"])
@pytest.mark.parametrize("segmented", [False, True])
def test_gpu_real_shape(segmented, mode):
    """The KDA layer's shape in configs/k3_1b3_dense.py: [4, 4096, 16, 128] bf16."""
    x, dy, w, seg = _inputs(4, 4096, (16, 128), 4, jnp.bfloat16, seed=11, segmented=segmented)
    dx_ref, dw_ref = _grads("stacked", x, w, seg, dy)
    dx, dw = _grads(mode, x, w, seg, dy)
    _same_dx(dx, dx_ref)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(dw_ref))))

"""kernels.conv.conv_silu_bwd (Pallas, interpret mode on CPU) against the reference backward of
kimi_jax.layers.causal_conv_silu (its XLA VJP, itself checked against autodiff)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.conv import conv_silu_bwd
from kimi_jax.layers import ShortConv, causal_conv_silu, conv_backward


def _case(seed, B, T, channels, W, segmented, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(B, T) + channels), dtype)
    w = jnp.asarray(0.5 * r.normal(size=(W,) + channels), jnp.float32)
    dy = jnp.asarray(r.normal(size=(B, T) + channels), dtype)
    seg = None
    if segmented:
        starts = r.random((B, T)) < 0.15
        starts[:, 0] = False
        seg = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
    return x, w, dy, seg


def _reference(x, w, dy, seg):
    _, vjp = jax.vjp(lambda x, w: causal_conv_silu(x, w, seg), x, w)
    return vjp(dy)


@pytest.mark.parametrize("B, T, channels, W, segmented, blocks", [
    (2, 37, (3, 5), 4, True, (8, 16, 16, 4)),      # T and C tails, packed documents, 2 tiles a program
    (1, 64, (2, 64), 4, False, (16, 64, 16, 4)),   # exact blocks, no segments, one tile a program
    (1, 100, (2, 64), 4, True, (16, 32, 64, 2)),   # 4 tiles a program, the last program past T
    (2, 19, (7,), 3, True, (8, 8, 8, 1)),          # W not a power of two
    (1, 9, (4,), 1, False, (64, 128, 256, 4)),     # W = 1 (no taps back), blocks larger than the array
])
def test_matches_the_reference_backward_f32(B, T, channels, W, segmented, blocks):
    x, w, dy, seg = _case(B * T + W, B, T, channels, W, segmented)
    dx, dw = conv_silu_bwd(x, w, dy, seg, blocks=blocks, interpret=True)
    dx_r, dw_r = _reference(x, w, dy, seg)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.shape == w.shape and dw.dtype == w.dtype
    np.testing.assert_allclose(dx, dx_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-5, atol=1e-4)


def test_bf16_inputs_and_document_boundaries():
    x, w, dy, seg = _case(3, 2, 48, (4, 16), 4, True, jnp.bfloat16)
    dx, dw = conv_silu_bwd(x, w, dy, seg, blocks=(16, 32, 32, 4), interpret=True)
    dx_r, dw_r = _reference(x, w, dy, seg)
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_r, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-4, atol=1e-3)
    # without the segment masks the gradient differs at document starts: the masks matter
    dx_flat, _ = conv_silu_bwd(x, w, dy, None, blocks=(16, 32, 32, 4), interpret=True)
    assert not np.allclose(np.asarray(dx_flat, np.float32), np.asarray(dx_r, np.float32), atol=5e-2)


def test_selected_by_name_inside_the_model_layer():
    """ShortConv's gradient is the same with the kernel selected; unknown names raise."""
    conv = ShortConv((2, 8), kernel_size=4, axes=("heads", "head_dim"), rngs=nnx.Rngs(0))
    x, _, _, seg = _case(5, 2, 24, (2, 8), 4, True)

    def grads():
        return jax.grad(lambda m, x: jnp.sum(jnp.sin(m(x, seg))), argnums=(0, 1))(conv, x)

    (gm_r, gx_r) = grads()
    with conv_backward("pallas_interpret"):
        (gm, gx) = grads()
    np.testing.assert_allclose(gx, gx_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gm.weight[...], gm_r.weight[...], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="unknown conv backward"):
        with conv_backward("triton"):
            pass
    from kimi_jax import layers

    layers.CONV_BACKWARD = "triton"  # set directly: the backward refuses it instead of guessing
    try:
        with pytest.raises(ValueError, match="CONV_BACKWARD='triton'"):
            grads()
    finally:
        layers.CONV_BACKWARD = "xla"


def test_rejects_bad_shapes_and_blocks():
    x, w, dy, _ = _case(0, 1, 8, (4,), 4, False)
    with pytest.raises(ValueError, match="want x = dy"):
        conv_silu_bwd(x, w[:, :2], dy, interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        conv_silu_bwd(x, w, dy, blocks=(48, 128, 256, 4), interpret=True)
    with pytest.raises(ValueError, match="block_rows >= block_t"):
        conv_silu_bwd(x, w, dy, blocks=(64, 128, 32, 4), interpret=True)
    with pytest.raises(ValueError, match="segment_ids"):
        conv_silu_bwd(x, w, dy, jnp.zeros((1, 7), jnp.int32), interpret=True)
    big = jax.ShapeDtypeStruct((8, 65536, 4096), jnp.bfloat16)  # 2**31 elements: 32-bit offsets overflow
    with pytest.raises(ValueError, match="exceed 2\\*\\*31"):
        jax.eval_shape(conv_silu_bwd, big, jax.ShapeDtypeStruct((4, 4096), jnp.float32), big)


def test_lowers_to_triton_for_an_h200(monkeypatch):
    """The Triton lowering at a mixer's shape, exported for CUDA from this CPU machine (jax asks
    for a device's compute capability: an H200's is given): catches what interpret mode does not."""
    from jax import export
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    x = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 16, 128), jnp.float32)
    seg = jax.ShapeDtypeStruct((4, 4096), jnp.int32)
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    module = export.export(jax.jit(conv_silu_bwd), platforms=["cuda"], disabled_checks=[triton])(
        x, w, x, seg).mlir_module()
    assert "xla.gpu.triton" in module and "grid_y = 16" in module and "grid_z = 16" in module
    assert "stablehlo.pad" not in module  # x and dy go to the kernel as they are, no padded copies


@pytest.mark.gpu
def test_lowers_and_matches_on_gpu():
    """The Triton lowering at a mixer's shape (4 x 4096 tokens, 16 heads x 128), bf16."""
    x, w, dy, seg = _case(7, 4, 4096, (16, 128), 4, True, jnp.bfloat16)
    dx, dw = jax.jit(conv_silu_bwd)(x, w, dy, seg)
    dx_r, dw_r = jax.jit(_reference)(x, w, dy, seg)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_r, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-3, atol=1e-2)


def test_benchmark_quick(tmp_path):
    """benchmarks/conv.py --quick: both impls run and agree; the JSON holds the table's rows."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "conv.py")
    spec = importlib.util.spec_from_file_location("bench_conv", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--out", str(tmp_path / "c.json")])
    assert [r["impl"] for r in result["rows"]] == ["xla", "pallas"]
    assert all(r["error"] is None and r["ms"] > 0 for r in result["rows"])
    assert result["rows"][1]["dx_max_err"] < 0.05 and result["rows"][1]["dw_rel_err"] < 1e-3
    assert json.loads((tmp_path / "c.json").read_text())["rows"] == result["rows"]


def test_runs_per_shard_under_a_mesh(monkeypatch):
    """Under a (data, tensor, fsdp) mesh of the fake CPU devices the kernel runs once per (batch,
    head) shard through shard_map, and dx, dw (summed over the batch shards) equal the unsharded
    call's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels.conv import conv_silu_bwd_per_shard, pallas_triton
    from kimi_jax.sharding import make_mesh

    x, w, dy, seg = _case(9, 4, 40, (2, 16), 4, True)
    want = conv_silu_bwd(x, w, dy, seg, blocks=(16, 16, 16, 4), interpret=True)
    shapes, real = [], pallas_triton.conv_silu_bwd

    def spy(x, *a, **kw):
        shapes.append(x.shape)
        return real(x, *a, blocks=(16, 16, 16, 4), **kw)

    monkeypatch.setattr(pallas_triton, "conv_silu_bwd", spy)
    mesh = make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    x4 = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: conv_silu_bwd_per_shard(*a, interpret=True))(
            jax.device_put(x, x4), w, jax.device_put(dy, x4), seg)
    assert shapes == [(1, 40, 1, 16)]  # batch / 4, heads / 2
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)

"""MXFP4: bit-level agreement with an independent NumPy encoder of OCP MX v1.0 (written here,
float64 and a table search), the 16 E2M1 code points, scale edge cases, and the matmuls on
packed weights against dequantise-then-matmul."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import mxfp4
from kernels.mxfp4 import pallas_gpu, reference
from kernels.testing import assert_close

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # E2M1 magnitudes of codes 0..7


def np_encode_element(q: float) -> int:
    """Round |q| to the nearest E2M1 magnitude, ties to the even code, saturate at 6."""
    mag = min(abs(q), 6.0)
    dists = [abs(mag - g) for g in GRID]
    best = min(dists)
    code = min(i for i, d in enumerate(dists) if d == best and (dists.count(best) == 1 or i % 2 == 0))
    return code | (8 if math.copysign(1.0, q) < 0 else 0)


def np_quantize(x):
    """Oracle: x [R, K] -> (packed [R, K/2], scales [R, K/32]) as uint8."""
    x = np.asarray(x, np.float64)
    rows, k = x.shape
    codes = np.zeros((rows, k), np.uint8)
    scales = np.zeros((rows, k // 32), np.uint8)
    for r in range(rows):
        for b in range(k // 32):
            blk = x[r, 32 * b:32 * b + 32]
            if not np.all(np.isfinite(blk)):
                scales[r, b] = 255
                continue
            amax = np.max(np.abs(blk))
            shared = -127 if amax == 0 else math.frexp(amax)[1] - 1 - 2
            shared = max(-127, min(127, shared))
            scales[r, b] = shared + 127
            for i, v in enumerate(blk):
                codes[r, 32 * b + i] = np_encode_element(v / 2.0**shared)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8), scales


def np_dequantize(packed, scales):
    vals = np.array(GRID + [-g for g in GRID])
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    scale = np.where(scales == 255, np.nan, 2.0 ** (scales.astype(np.float64) - 127))
    return vals[codes] * np.repeat(scale, 32, axis=1)


def _check_bits(x):
    packed, scales = mxfp4.quantize(jnp.asarray(x, jnp.float32))
    want_p, want_s = np_quantize(x)
    np.testing.assert_array_equal(np.asarray(scales), want_s)
    np.testing.assert_array_equal(np.asarray(packed), want_p)
    got = np.asarray(mxfp4.dequantize(packed, scales), np.float64)
    np.testing.assert_array_equal(got, np_dequantize(want_p, want_s))
    return packed, scales


def test_all_16_code_points_round_trip():
    vals = np.array(GRID + [-g for g in GRID], np.float32)
    for e in (-3, 0, 5):
        x = np.concatenate([vals, vals[::-1]])[None] * np.float32(2.0**e)
        packed, scales = _check_bits(x)
        assert int(scales[0, 0]) == 127 + e
        codes = np.stack([np.asarray(packed) & 15, np.asarray(packed) >> 4], -1).reshape(-1)
        np.testing.assert_array_equal(codes[:16], np.arange(16))
        back = np.asarray(mxfp4.dequantize(packed, scales))
        np.testing.assert_array_equal(back, x)
        np.testing.assert_array_equal(np.signbit(back), np.signbit(x))  # -0 is code 8


def test_rounding_ties_and_saturation():
    # amax 4 -> X = 1: values between grid points, exact ties, and the clip of (6X, 8X) to 6X.
    blk = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1, 0.3, 1.1] + [0.0] * 20
    x = np.array([blk, [7.5] + [1.0] * 31], np.float32)
    packed, _ = _check_bits(x)
    back = np.asarray(mxfp4.dequantize(packed, mxfp4.quantize(x)[1]))
    np.testing.assert_array_equal(back[0, :12], [4, 0, 1, 1, 2, 2, 4, 4, -0.0, -0.0, 0.5, 1])
    assert back[1, 0] == 6.0  # 7.5 with X = 1 clips to 6


def test_scale_edge_cases():
    rows = [
        np.zeros(32),                                   # zero block -> scale code 0, codes 0
        np.full(32, 2.0**-125),                         # X clamps exactly at 2^-127
        np.r_[2.0**-126, np.zeros(31)],                 # floor(log2) - 2 = -128 clamps to -127
        np.r_[3e38, -1e38, np.ones(30)],                # huge: X = 2^125
        np.r_[np.inf, np.ones(31)],                     # Inf -> NaN scale
        np.r_[1.0, np.nan, np.ones(30)],                # NaN -> NaN scale
        np.r_[-np.inf, np.zeros(31)],
    ]
    x = np.array(rows, np.float32)
    packed, scales = _check_bits(x)
    s = np.asarray(scales)[:, 0]
    np.testing.assert_array_equal(s, [0, 0, 0, 252, 255, 255, 255])
    back = np.asarray(mxfp4.dequantize(packed, scales))
    assert np.all(back[0] == 0) and np.all(np.isnan(back[4:]))
    assert back[1, 0] == 2.0**-125 and back[2, 0] == 2.0**-126


def test_random_magnitudes_bit_exact(rng):
    x = rng.normal(size=(6, 128)) * 2.0 ** rng.integers(-100, 100, size=(6, 1))
    x[0, 5:40] = 0.0
    _check_bits(x.astype(np.float32))
    w = rng.normal(size=(64, 256)).astype(np.float32)
    packed, scales = mxfp4.quantize(w)
    assert_close("mxfp4 error", w, mxfp4.dequantize(packed, scales), 0.15)
    assert packed.nbytes * 8 + scales.nbytes * 8 == mxfp4.BITS_PER_ELEMENT * w.size


def test_matmul_on_packed_weights(rng):
    w = rng.normal(size=(48, 64)).astype(np.float32)
    x = rng.normal(size=(10, 64)).astype(np.float32)
    packed, scales = mxfp4.quantize(w)
    want = x.astype(np.float64) @ np_dequantize(*np_quantize(w)).T
    assert_close("matmul", want, reference.matmul(jnp.asarray(x), packed, scales), 1e-6)


def test_grouped_pallas_matches_dequantize_then_matmul(rng):
    sizes = [30, 0, 60, 0]
    g, n, k, m = len(sizes), 64, 64, 100
    packed, scales = mxfp4.quantize(jnp.asarray(rng.normal(size=(g, n, k)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    w = np.asarray(mxfp4.dequantize(packed, scales), np.float64)
    want = np.zeros((m, n))
    start = 0
    for e, size in enumerate(sizes):
        want[start:start + size] = np.asarray(x[start:start + size], np.float64) @ w[e].T
        start += size
    assert_close("ref gmm", want, mxfp4.gmm(x, packed, scales, gs, impl="reference"), 5e-3)
    blocks = pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=2)
    out = pallas_gpu.gmm(x, packed, scales, gs, blocks=blocks, interpret=True)
    assert_close("pallas gmm", want, out, 5e-3)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(jnp.ones((2, 40)))
    packed, scales = mxfp4.quantize(jnp.ones((2, 64)))
    with pytest.raises(ValueError, match="one tensor"):
        mxfp4.dequantize(packed, scales[:, :1])
    with pytest.raises(ValueError, match="Unknown impl"):
        mxfp4.gmm(jnp.ones((4, 64)), packed[None], scales[None], jnp.array([4]), impl="cuda")


@pytest.mark.gpu
def test_compiled_pallas_kernel_on_gpu(rng):
    """The compiled Mosaic GPU MXFP4 kernel (default blocks) against dequantise-then-matmul."""
    sizes = [300, 0, 5, 400]
    packed, scales = mxfp4.quantize(jnp.asarray(rng.normal(size=(4, 192, 1024)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(800, 1024)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    want = mxfp4.gmm(x, packed, scales, gs, impl="reference")
    out = mxfp4.gmm(x, packed, scales, gs, impl="pallas_gpu")
    assert_close("gpu mxfp4", np.asarray(want, np.float32), np.asarray(out, np.float32), 5e-3)


def test_pallas_kernel_lowers_for_cuda():
    """Mosaic GPU lowering of the default-block MXFP4 kernel, exported for CUDA from the CPU."""
    import jax
    from jax import export

    args = (jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 384, 512), jnp.uint8),
            jax.ShapeDtypeStruct((4, 384, 32), jnp.uint8), jax.ShapeDtypeStruct((4,), jnp.int32))
    module = export.export(jax.jit(pallas_gpu.gmm), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in module

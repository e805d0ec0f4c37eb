"""MXFP4 (OCP Microscaling v1.0) encode / decode in pure JAX, blocks along the last axis.

A block is 32 consecutive elements of the last (contraction) axis sharing one E8M0 scale
X = 2^(s - 127) (s in [0, 254]; s = 255 is NaN). Elements are E2M1 codes: bit 3 = sign, then
magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Storage (K3 / compressed-tensors layout):
    packed u8 [..., K/2]  element 2j in the low nibble, 2j+1 in the high nibble;
    scales u8 [..., K/32] the E8M0 exponent byte.
4 bits + 8/32 bits = 4.25 bits per element.

Encoding follows the spec's quantiser: X = 2^(floor(log2 max|V|) - 2) (2 = emax of E2M1), then
P = RNE(V / X) saturated to +-6 (so a block max in (6X, 8X) clips to 6X). Choices where the
spec leaves room, applied identically by the NumPy oracle in the tests:
- all-zero block: s = 0 (the smallest scale, from clamping floor(log2 0) = -inf), codes 0;
- scale exponents clamp to the E8M0 range [-127, 127]; tiny blocks therefore round toward 0;
- a block holding NaN or +-Inf: s = 0xFF (NaN scale; the spec makes every element of such a
  block NaN, and E8M0/E2M1 have no Inf), element codes 0;
- signs survive rounding to zero (-0.1 X encodes as code 8, negative zero);
- inputs and decoded values below the f32 normal range may flush to zero where the platform
  flushes denormals (XLA:CPU does); codes and scales are exact integers either way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
EMAX_ELEM = 2
SCALE_BIAS = 127
SCALE_NAN = 255
BITS_PER_ELEMENT = 4 + 8 / BLOCK
# E2M1 code -> value for codes 0..15 (bit 3 = sign).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       np.float32)


def _check_last_axis(k: int, what: str, multiple: int) -> None:
    if k % multiple:
        raise ValueError(f"{what}: last axis {k} must be a multiple of {multiple}")


def quantize(x):
    """x [..., K] float -> (packed u8 [..., K/2], scales u8 [..., K/32]); K % 32 == 0."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize needs a float array, got {x.dtype}")
    _check_last_axis(x.shape[-1], "quantize", BLOCK)
    lead, k = x.shape[:-1], x.shape[-1]
    blocks = x.astype(jnp.float32).reshape(*lead, k // BLOCK, BLOCK)
    special = jnp.any(~jnp.isfinite(blocks), axis=-1)
    amax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(blocks), blocks, 0.0)), axis=-1)
    _, exp = jnp.frexp(amax)  # amax = m 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = jnp.where(amax > 0, exp - 1 - EMAX_ELEM, -SCALE_BIAS)
    shared = jnp.clip(shared, -SCALE_BIAS, SCALE_BIAS)
    scaled = jnp.ldexp(blocks, -shared[..., None])
    codes = jax.lax.bitcast_convert_type(scaled.astype(jnp.float4_e2m1fn), jnp.uint4)
    codes = jnp.where(special[..., None], 0, codes.astype(jnp.uint8))
    scales = jnp.where(special, SCALE_NAN, shared + SCALE_BIAS).astype(jnp.uint8)
    codes = codes.reshape(*lead, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(jnp.uint8)
    return packed, scales


def decode_codes(codes):
    """E2M1 codes (any int array, values 0..15) -> float32 values."""
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


def dequantize(packed, scales, dtype=jnp.float32):
    """(packed u8 [..., K/2], scales u8 [..., K/32]) -> [..., K] in `dtype`."""
    if packed.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"dequantize needs uint8 packed/scales, got {packed.dtype}/{scales.dtype}")
    k = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * BLOCK != k:
        raise ValueError(f"packed {packed.shape} and scales {scales.shape} do not describe one "
                         f"tensor (need scales [..., K/32] for K = {k})")
    lo, hi = decode_codes(packed & 15), decode_codes(packed >> 4)
    values = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], k // BLOCK, BLOCK)
    s = scales.astype(jnp.int32)[..., None]
    # ldexp, not a product with 2^(s-127): that factor is subnormal for s = 0 and would flush
    # to zero on platforms that flush denormals.
    out = jnp.where(s == SCALE_NAN, jnp.nan, jnp.ldexp(values, s - SCALE_BIAS))
    return out.reshape(*packed.shape[:-1], k).astype(dtype)


class MXFP4Weight(NamedTuple):
    """A stacked weight [G, K, N] (contraction K) kept as MXFP4 blocks along K.

    packed u8 [G, N, K/2], scales u8 [G, N, K/32] (the K3 [out, in] layout). `shape` is the
    logical [G, K, N] of the float weight it replaces and `astype` returns it unchanged, so code
    written for float expert weights can carry it to a matmul that reads packed weights.
    """

    packed: jax.Array
    scales: jax.Array

    @classmethod
    def from_dense(cls, w):
        """w [G, K, N] float -> MXFP4Weight."""
        if w.ndim != 3:
            raise ValueError(f"MXFP4Weight.from_dense expects [G, K, N], got {w.shape}")
        return cls(*quantize(jnp.swapaxes(w, 1, 2)))

    @property
    def shape(self):
        g, n, kh = self.packed.shape
        return (g, 2 * kh, n)

    def astype(self, dtype):
        del dtype
        return self

    def dequantize(self, dtype=jnp.float32):
        """-> [G, K, N] in `dtype`."""
        return jnp.swapaxes(dequantize(self.packed, self.scales, dtype), 1, 2)

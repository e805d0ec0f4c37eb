"""Compiled grouped matmuls at K3's expert shapes on a GPU (latent D=3584, expert width F=3072,
128 experts; 2048 tokens x top-16 = 32768 rows with ragged and empty groups).

`ragged_dot` cannot be the reference here (XLA's GPU lowering materialises [M, E, N]), so
sampled groups are checked against a plain f32 matmul of their rows, empty groups and rows past
the total against zero. Plain and warp-specialized tiles; MXFP4 weights against dequantise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import mxfp4
from kernels.gmm import pallas_gpu
from kernels.testing import assert_close

pytestmark = pytest.mark.gpu

D, F, E, ROWS = 3584, 3072, 128, 32768
WS = pallas_gpu.Blocks(bm=128, bn=256, bk=64, stages=3, wgs=2)
WS_TGMM = pallas_gpu.Blocks(bm=64, bn=256, bk=128, stages=3, wgs=2)
TILES = {"plain": (pallas_gpu.Blocks(), pallas_gpu.Blocks()), "warp_specialized": (WS, WS_TGMM)}


def _sizes(rng, rows=ROWS - 100, experts=E):
    """Multinomial loads with four empty experts (first, last, two inside); rows past the
    total."""
    p = rng.dirichlet(np.full(experts, 2.0))
    p[[0, experts // 8 + 1, experts // 8 + 2, experts - 1]] = 0
    return rng.multinomial(rows, p / p.sum()).astype(np.int32)


def _check_groups(name, got, want_fn, sizes, groups):
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for g in groups:
        s, e = offsets[g], offsets[g + 1]
        assert_close(f"{name}[{g}]", want_fn(g, s, e), got(g, s, e), 1e-2)


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    sizes = _sizes(rng)
    k = jax.random.split(jax.random.key(0), 4)
    lhs = jax.random.normal(k[0], (ROWS, D), jnp.bfloat16)
    rhs = (jax.random.normal(k[1], (E, D, F), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)
    dout = jax.random.normal(k[2], (ROWS, F), jnp.bfloat16)
    return sizes, lhs, rhs, dout


@pytest.mark.parametrize("tiles", list(TILES))
def test_gmm_forward_and_dlhs_at_k3_shapes(data, tiles):
    sizes, lhs, rhs, dout = data
    blocks = TILES[tiles][0]
    gs = jnp.asarray(sizes)
    out = jax.jit(lambda a, b: pallas_gpu.gmm(a, b, gs, blocks=blocks))(lhs, rhs)
    dlhs = jax.jit(lambda a, b: pallas_gpu.gmm(a, b, gs, transpose_rhs=True, blocks=blocks))(
        dout, rhs)  # dout [M, F] x rhs[g]^T
    groups = [1, 16, 19, 64, E - 2]
    _check_groups("fwd", lambda g, s, e: _f32(out[s:e]),
                  lambda g, s, e: _f32(lhs[s:e]) @ _f32(rhs[g]), sizes, groups)
    _check_groups("dlhs", lambda g, s, e: _f32(dlhs[s:e]),
                  lambda g, s, e: _f32(dout[s:e]) @ _f32(rhs[g]).T, sizes, groups)
    total = int(sizes.sum())
    assert not np.any(_f32(out[total:])) and not np.any(_f32(dlhs[total:]))
    assert np.all(np.isfinite(_f32(out))) and np.all(np.isfinite(_f32(dlhs)))


@pytest.mark.parametrize("tiles", list(TILES))
def test_tgmm_at_k3_shapes(data, tiles):
    sizes, lhs, _, dout = data
    blocks = TILES[tiles][1]
    gs = jnp.asarray(sizes)
    out = jax.jit(lambda a, d: pallas_gpu.tgmm(a, d, gs, blocks=blocks))(lhs, dout)
    assert out.shape == (E, D, F)
    _check_groups("tgmm", lambda g, s, e: _f32(out[g]),
                  lambda g, s, e: _f32(lhs[s:e]).T @ _f32(dout[s:e]), sizes, [1, 16, 19, 64, E - 2])
    empty = np.flatnonzero(sizes == 0)
    assert len(empty) >= 4 and not np.any(_f32(out[jnp.asarray(empty)]))


def test_mxfp4_gmm_at_k3_shapes():
    """Packed expert weights [16, F, D/2] of K3's width (16 experts keep the reference small)."""
    rng = np.random.default_rng(1)
    experts = 16
    sizes = _sizes(rng, rows=8000, experts=experts)
    k = jax.random.split(jax.random.key(1), 2)
    packed, scales = mxfp4.quantize(jax.random.normal(k[0], (experts, F, D), jnp.float32))
    x = jax.random.normal(k[1], (8192, D), jnp.bfloat16)
    out = mxfp4.gmm(x, packed, scales, jnp.asarray(sizes), impl="pallas_gpu")
    w = mxfp4.dequantize(packed, scales)
    _check_groups("mxfp4", lambda g, s, e: _f32(out[s:e]),
                  lambda g, s, e: _f32(x[s:e]) @ _f32(w[g]).T, sizes, [1, 5, 16 - 2])
    assert not np.any(_f32(out[int(sizes.sum()):]))


@pytest.mark.parametrize("mode", ["separate", "fused_bwd", "fused_glu"])
def test_gmm_dispatch_layer_at_k3_small_shapes(mode):
    """The routed layer through the Pallas kernels (`gmm` dispatch: pair gathers, grouped FFN,
    combine) at k3_small's shapes (8192 tokens x top-8 of 8 experts, D=256, F=224), forward and
    gradients, against the same layer through XLA's ragged_dot in float32."""
    from kimi_jax.ffn import glu_activation
    from kimi_jax.moe_dispatch import ExpertWeights, dispatch_fn, gate_up

    N, k, E_, D_, F_ = 8192, 8, 8, 256, 224
    keys = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(keys[0], (N, D_), jnp.float32)
    idx = jnp.argsort(jax.random.uniform(keys[1], (N, E_)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(keys[2], (N, k)), axis=1)
    ex = ExpertWeights(jax.random.normal(keys[3], (E_, D_, F_)) / D_**0.5,
                       jax.random.normal(keys[4], (E_, D_, F_)) / D_**0.5,
                       jax.random.normal(keys[5], (E_, F_, D_)) / F_**0.5)
    act = glu_activation("swiglu")

    def run(name, dtype, gate_up_mode):
        def loss(x, ex, idx, w):
            y = dispatch_fn(name)(x.astype(dtype), idx, w, jax.tree.map(lambda a: a.astype(dtype), ex), act)
            return jnp.sum(jnp.sin(y)), y

        with gate_up(gate_up_mode):  # inputs as arguments: constants would be folded at compile time
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, ex, idx, w)

    (_, y_ref), g_ref = run("ragged", jnp.float32, "separate")
    (_, y), g = run("gmm", jnp.bfloat16, mode)
    assert_close("y", _f32(y_ref), _f32(y), 2e-2)
    for name, a, b in zip(("dx", "dgate", "dup", "ddown"), jax.tree.leaves(g_ref), jax.tree.leaves(g)):
        assert_close(name, _f32(a), _f32(b), 3e-2)

"""Pallas TPU KDA kernels in TPU interpret mode on CPU against the naive reference; the block /
VMEM plan for the real shapes; Mosaic lowering for the TPU platform (no TPU needed to lower).

Interpret mode compiles each distinct shape for about 10 s per kernel, so the tests share two
shape sets (float32 K=V=64 "head_major" layout, bf16 K=V=128 "flat" layout) and run eagerly,
which lets the compiled kernels be reused across tests.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import kda, naive, pallas_tpu
from kernels.kda.pallas_tpu_plan import SCOPED_VMEM_LIMIT, Operand, plan
from kernels.testing import assert_close

B, T, H = 2, 100, 2  # odd T: 2 chunks of 64, the second padded
F32_TOL = dict(o=1e-5, S=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dg=1e-5, dbeta=1e-5, dh0=1e-5)
BF16_TOL = dict(o=0.005, S=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dh0=0.008)
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(rng, D, dtype, T=T, gate="channel"):
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, D)).astype(np.float32)
    g = {
        "none": np.zeros((B, T, H, D)),
        "head": np.broadcast_to(-rng.uniform(0, 1, (B, T, H, 1)), (B, T, H, D)),
        "channel": -rng.uniform(0, 1, (B, T, H, D)),
        "extreme": np.where(rng.uniform(size=(B, T, H, D)) < 0.05, -1000.0, -rng.uniform(0, 1, (B, T, H, D))),
        "bounded": np.where(rng.uniform(size=(B, T, H, D)) < 0.5, -5.0, -rng.uniform(0, 5, (B, T, H, D))),
    }[gate].astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    h0 = rng.standard_normal((B, H, D, D)).astype(np.float32)
    seg = np.cumsum(rng.uniform(size=(B, T)) < 0.04, axis=1).astype(np.int32)
    seg[:, 64] = seg[:, 63] + 1  # a reset exactly on a chunk boundary
    seg[:, 65:] = np.maximum(seg[:, 65:], seg[:, 64:65])
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return (q, k, v, jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0)), jnp.asarray(seg)


def _value_and_grads(fn, args, seg, rng, **kw):
    """o, final state and the gradients of <o, do> + <S, dht> w.r.t. (q, k, v, g, beta, h0)."""
    q, k, v, g, beta, h0 = args
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dht = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def loss(*a):
        o, S = fn(*a[:5], scale=q.shape[-1] ** -0.5, initial_state=a[5], segment_ids=seg, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dht), (o, S)

    (_, (o, S)), grads = jax.value_and_grad(loss, argnums=range(6), has_aux=True)(*args)
    return o, S, grads


def _check_parity(args, seg, tol, **kw):
    o_r, S_r, g_r = _value_and_grads(naive.kda_impl, args, seg, np.random.default_rng(1))
    o, S, g = _value_and_grads(pallas_tpu.chunk_kda_tpu, args, seg, np.random.default_rng(1), **kw)
    assert o.dtype == args[2].dtype and S.dtype == jnp.float32
    assert_close("o", o_r, o, tol["o"])
    assert_close("S", S_r, S, tol["S"])
    for name, ref, out in zip(NAMES, g_r, g):
        assert out.dtype == ref.dtype, name
        assert_close(name, np.asarray(ref, np.float32), np.asarray(out, np.float32), tol[name])


def test_f32_matches_naive_with_resets(rng):
    """float32 at 1e-5: outputs, final state and every gradient, odd T, segment resets, h0."""
    args, seg = _inputs(rng, 64, jnp.float32)
    _check_parity(args, seg, F32_TOL)


def test_bf16_matches_naive(rng):
    """bf16 inputs (bf16 MXU operands, f32 state) within FLA's tolerances; K=V=128 flat layout."""
    args, seg = _inputs(rng, 128, jnp.bfloat16)
    _check_parity(args, seg, BF16_TOL)


def test_bounded_gate_all_mxu_path(rng):
    """lower_bound=-5 (g in [-5, 0], half the entries at -5, the worst case): the all-MXU intra
    path, float32 at 1e-5 for outputs, state and gradients."""
    args, seg = _inputs(rng, 64, jnp.float32, gate="bounded")
    _check_parity(args, seg, F32_TOL, lower_bound=-5.0)


@pytest.mark.parametrize("gate", ["none", "head", "extreme"])
def test_gate_forms_forward(rng, gate):
    """DeltaNet (g=0), Gated DeltaNet (g broadcast over K) and g=-1000 resets, through `kda`."""
    (q, k, v, g, beta, h0), seg = _inputs(rng, 64, jnp.float32, gate=gate)
    g_api = {"none": None, "head": g[..., 0], "extreme": g}[gate]
    run = lambda impl: kda(q, k, v, g_api, beta, initial_state=h0, segment_ids=seg, output_final_state=True, impl=impl)
    (o_r, S_r), (o, S) = run("naive"), run("pallas_tpu")
    # g = -1000 makes |G| ~ 1000, where a float32 cumsum has an ulp of 6e-5: exp(G_r - G_c) then
    # carries ~1e-4 relative error (the serial reference multiplies exp(g) step by step instead).
    tol = 2e-4 if gate == "extreme" else 1e-5
    assert_close("o", o_r, o, tol)
    assert_close("S", S_r, S, tol)


def test_state_continuity(rng):
    """Two halves chained through the final/initial state equal the whole sequence."""
    (q, k, v, g, beta, h0), _ = _inputs(rng, 64, jnp.float32)
    run = lambda sl, s0: pallas_tpu.chunk_kda_tpu(
        q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=0.125, initial_state=s0
    )
    o_all, S_all = run(slice(0, T), h0)
    o_1, S_1 = run(slice(0, T // 2), h0)
    o_2, S_2 = run(slice(T // 2, T), S_1)
    assert_close("o", o_all, jnp.concatenate([o_1, o_2], axis=1), 1e-5)
    assert_close("S", S_all, S_2, 1e-5)


@pytest.mark.parametrize("D, dtype", [(128, "bfloat16"), (64, "bfloat16"), (128, "float32"), (64, "float32")])
def test_plan_obeys_tpu_tiling_and_vmem(D, dtype):
    """The real shape (B, T, H, D) = (1, 8192, 32, D): (8|16, 128) tiling and VMEM per grid step."""
    p = plan(1, 8192, 32, D, D, dtype)
    assert p.tiling_errors() == []
    assert (p.NT, p.Tp) == (128, 8192)
    for s in p.stages:
        assert s.grid == (1, 32, 128)
        serial = s.name.endswith("state")
        assert s.dimension_semantics == (("parallel", "parallel", "arbitrary") if serial else ("parallel",) * 3)
        assert s.reverse == (s.name == "bwd_state")
        assert 0 < s.vmem_bytes < SCOPED_VMEM_LIMIT["v5e"], (s.name, s.vmem_bytes)


def test_tiling_check_rejects_bad_blocks():
    """The tiling check can fail: a per-head (1, C) block of [B, T, H] and a bf16 block of 8 rows."""
    assert Operand("beta", (1, 8192, 32), (None, 64, 1), "float32", "tok").tiling_error()
    assert Operand("q", (1, 8192, 4096), (None, 8, 128), "bfloat16", "tok").tiling_error()
    assert Operand("q", (1, 8192, 4096), (None, 8, 128), "float32", "tok").tiling_error() is None


@pytest.mark.parametrize(
    "D, dtype, lower_bound", [(128, jnp.bfloat16, None), (128, jnp.bfloat16, -5.0), (64, jnp.float32, None)]
)
def test_lowers_to_mosaic_for_tpu(D, dtype, lower_bound):
    """Forward and backward lower to Mosaic TPU custom calls for the real shape (no TPU needed)."""
    f32 = jnp.float32
    x = jax.ShapeDtypeStruct((1, 8192, 32, D), dtype)

    def grads(q, k, v, g, beta):
        def loss(*a):
            o, S = pallas_tpu.chunk_kda_tpu(*a, scale=D**-0.5, lower_bound=lower_bound, interpret=False)
            return jnp.sum(o.astype(f32)) + jnp.sum(S)

        return jax.grad(loss, argnums=range(5))(q, k, v, g, beta)

    sd = lambda shape: jax.ShapeDtypeStruct(shape, f32)
    exported = jax.export.export(jax.jit(grads), platforms=["tpu"])(x, x, x, sd(x.shape), sd(x.shape[:3]))
    assert exported.mlir_module().count("tpu_custom_call") == 4


def test_unsupported_head_dim(rng, caplog):
    """K=32: the kernels raise a clear ValueError; the registry entry falls back to chunk, logged."""
    with pytest.raises(ValueError, match="K=32"):
        plan(1, 64, 2, 32, 32, "float32")
    q = jnp.asarray(rng.standard_normal((1, 16, 2, 32)), jnp.float32)
    with caplog.at_level(logging.WARNING):
        o, _ = kda(q, q, q, impl="pallas_tpu")
    assert "falls back to chunk" in caplog.text
    assert_close("o", kda(q, q, q, impl="naive")[0], o, 1e-5)

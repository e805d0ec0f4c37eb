"""The intra-chunk pieces' pull-back as a Mosaic GPU kernel (`kernels/kda/mosaic_prep_bwd.py`, run
by the Mosaic GPU interpreter) against autodiff of `chunk_intra.prep` in float32, alone and inside
KDA's gradients; errors; the setting's dispatch."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_prep_bwd, kda, mosaic_prep_bwd
from kernels.kda.chunk import _Numerics
from kernels.kda.chunk_intra import prep
from kernels.testing import rel_rms


def _case(rng, N, BH, K, gate=-5.0):
    """Chunked bf16 q, k (unit rows), v; gates in [gate, 0]; beta; and the pieces' VJP in float32."""
    C = 64
    n = lambda *s: rng.standard_normal((N, 1, BH, *s))  # noqa: E731
    unit = lambda x: jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), jnp.bfloat16)  # noqa: E731
    q, k = unit(n(C, K)), unit(n(C, K))
    v = jnp.asarray(n(C, K), jnp.bfloat16)
    g = jnp.asarray(gate * jax.nn.sigmoid(n(C, K)), jnp.float32)
    beta = jnp.asarray(jax.nn.sigmoid(n(C)), jnp.float32)
    scale = K**-0.5
    hi = jax.lax.Precision.HIGHEST
    mm = lambda spec, x, y: jnp.einsum(spec, x.astype(jnp.float32), y.astype(jnp.float32), precision=hi)  # noqa: E731
    f = lambda q, k, g, beta: prep(q, k, v, g, beta, None, scale=scale, bounded=True, delta=True, mm=mm,  # noqa: E731
                                   cd=jnp.float32, prec=hi)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    P, pull = jax.vjp(f, f32(q), f32(k), g, beta)
    # cotangents in bf16 (as the "compute" cotangents arrive); scores' ten times smaller, as in training
    ct = {key: jnp.asarray(rng.standard_normal(x.shape) * (0.1 if key in ("Aqk", "L") else 1.0), jnp.bfloat16)
          .astype(jnp.float32) for key, x in P.items()}
    ct["bv"] = jnp.zeros_like(P["bv"])  # bv's term is the caller's
    return (q, k, g, beta, scale, ct), pull(ct)


def _token_inputs(rng, B, T, H, K):
    """bf16 q, k (unit rows), v [B, T, H, K]; gates in [-5, 0]; beta [B, T, H]."""
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
    k = rng.standard_normal((B, T, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
    g = jnp.asarray(-5 * jax.nn.sigmoid(rng.standard_normal((B, T, H, K))), jnp.float32)
    return q, k, v, g, jnp.asarray(jax.nn.sigmoid(rng.standard_normal((B, T, H))), jnp.float32)


@pytest.mark.parametrize("K", [64, 128])
def test_kernel_matches_autodiff(rng, K):
    (q, k, g, beta, scale, ct), want = _case(rng, 2, 3, K)
    flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])  # noqa: E731
    G = jnp.cumsum(g, axis=-2)
    got = mosaic_prep_bwd.prep_bwd(flat(q), flat(k), flat(G), flat(beta), flat(ct["decay"]), flat(ct["Aqk"]),
                                   flat(ct["L"]), flat(ct["qg"]), flat(ct["kg"]), flat(ct["kgam"]), scale=scale,
                                   interpret=True)
    # dq, dk come out in bf16 (8 mantissa bits); dg and dbeta in float32 from split products
    for name, a, b, tol in zip(("dq", "dk", "dg", "dbeta"), got, want, (4e-3, 4e-3, 1e-4, 1e-5)):
        assert a.dtype == (jnp.bfloat16 if name in ("dq", "dk") else jnp.float32), name
        err = rel_rms(b, np.asarray(a, np.float32).reshape(b.shape))
        assert err < tol, (name, err)


def test_token_major_layout_gives_the_same(rng):
    """heads=H: q, k, G in and dq, dk, dg out as [B, N C, H, K] give exactly the chunk-major
    results, transposed; a layout that does not match beta's raises."""
    from kernels.kda.chunk_intra import from_chunks

    (q, k, g, beta, scale, ct), _ = _case(rng, 2, 3, 64)
    flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])  # noqa: E731
    G = jnp.cumsum(g, axis=-2)
    rest = (flat(beta), flat(ct["decay"]), flat(ct["Aqk"]), flat(ct["L"]), flat(ct["qg"]), flat(ct["kg"]),
            flat(ct["kgam"]))
    want = mosaic_prep_bwd.prep_bwd(flat(q), flat(k), flat(G), *rest, scale=scale, interpret=True)
    got = mosaic_prep_bwd.prep_bwd(from_chunks(q), from_chunks(k), from_chunks(G), *rest, scale=scale,
                                   interpret=True, heads=3)
    N, B, H = q.shape[:3]
    for name, a, b in zip(("dq", "dk", "dg"), got, want):
        assert a.shape == (B, N * 64, H, 64), name
        np.testing.assert_array_equal(np.asarray(from_chunks(b.reshape(N, B, H, 64, 64)), np.float32),
                                      np.asarray(a, np.float32), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    with pytest.raises(ValueError, match="heads=2"):
        mosaic_prep_bwd.prep_bwd(from_chunks(q), from_chunks(k), from_chunks(G), *rest, scale=scale,
                                 interpret=True, heads=2)


@pytest.mark.parametrize("heads", [None, 3])
def test_cumsum_in_the_kernel(rng, heads):
    """cumsum=True: the kernel takes g and forms G and its anchors itself; its results equal those
    from G (the XLA cumsum) to float32 rounding, in both layouts."""
    from kernels.kda.chunk_intra import from_chunks

    (q, k, g, beta, scale, ct), want_ad = _case(rng, 2, 3, 64)
    flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])  # noqa: E731
    lay = from_chunks if heads else flat
    rest = (flat(beta), flat(ct["decay"]), flat(ct["Aqk"]), flat(ct["L"]), flat(ct["qg"]), flat(ct["kg"]),
            flat(ct["kgam"]))
    run = lambda G, **kw: mosaic_prep_bwd.prep_bwd(lay(q), lay(k), lay(G), *rest, scale=scale, interpret=True,  # noqa: E731
                                                   heads=heads, **kw)
    want, got = run(jnp.cumsum(g, axis=-2)), run(g, cumsum=True)
    for name, a, b, tol in zip(("dq", "dk", "dg", "dbeta"), got, want, (1e-2, 1e-2, 1e-5, 1e-5)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_rms(b, a) < tol, (name, rel_rms(b, a))
    if heads is None:  # and autodiff of `prep`, at the chunk-major test's tolerances
        for name, a, b, tol in zip(("dq", "dk", "dg", "dbeta"), got, want_ad, (4e-3, 4e-3, 1e-4, 1e-5)):
            assert rel_rms(b, np.asarray(a, np.float32).reshape(b.shape)) < tol, name


def test_kda_gradients_with_the_kernel(rng):
    """KDA's gradients (bf16, bounded gate, T not a multiple of 64) with the kernel's pull-back
    equal XLA's to bf16 rounding, and both stay as close to the token-serial reference."""
    B, T, H, K = 1, 150, 2, 64
    q, k, v, g, beta = _token_inputs(rng, B, T, H, K)
    h0 = jnp.asarray(rng.standard_normal((B, H, K, K)) * 0.1, jnp.float32)

    def grads(impl):
        def f(q, k, v, g, beta, h0):
            o, S = kda(q, k, v, g, beta, initial_state=h0, lower_bound=-5.0, impl=impl, output_final_state=True)
            return jnp.sum(o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32))) + jnp.sum(S * S)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))(q, k, v, g, beta, h0)

    ref = grads("naive")
    with chunk.settings(prep_bwd="xla"):
        want = grads("chunk")
    with chunk.settings(prep_bwd="interpret"):
        got = grads("chunk")
    with chunk.settings(prep_bwd="interpret", residuals="pieces"):
        kept = grads("chunk")
    for name, a, b, c, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want, kept, ref):
        assert rel_rms(b, a) < 1e-2, (name, rel_rms(b, a))
        assert rel_rms(r, a) < max(2 * rel_rms(r, b), 2e-3), (name, rel_rms(r, a), rel_rms(r, b))
        # the forward's pieces are the ones the backward would form again
        assert rel_rms(a, c) < 1e-6, (name, rel_rms(a, c))
    assert rel_rms(want[3], got[3]) > 0, "the kernel's path was not taken"


def test_kept_pieces_replace_the_recompute(rng):
    """With residuals="pieces" (and the kernel's pull-back) the forward keeps the pieces the
    backward reads, and the backward runs no score product of its own; elsewhere none are kept."""
    N, B, H, C, K = 2, 1, 2, 64, 64
    x = jnp.asarray(rng.standard_normal((N, B, H, C, K)), jnp.bfloat16)
    g = jnp.full((N, B, H, C, K), -0.1, jnp.float32)
    beta = jnp.full((N, B, H, C), 0.5, jnp.float32)
    h0 = jnp.zeros((B, H, K, K), jnp.float32)
    args = (x, x, x, g, beta, h0, None, 0.125, True, True, "xla", "dense")

    def backward_ops(residuals):
        """(the residuals, the backward's count of exp and dot_general equations)"""
        with chunk.settings(prep_bwd="interpret", residuals=residuals):
            res = chunk._core_fwd(*args)[1]
            jaxpr = jax.make_jaxpr(lambda res, do: chunk._core_bwd(0.125, True, True, "xla", "dense", res, (do, h0)))(
                res, jnp.zeros_like(x, jnp.float32))
        text = str(jaxpr)
        return res, text.count(" exp ") + text.count("= exp"), text.count("dot_general")

    res, exps, dots = backward_ops("pieces")
    _, exps_recompute, dots_recompute = backward_ops("states_vn")
    pieces = res[-1]
    assert set(pieces) == {"Aqk", "qg", "kg", "kgam", "decay", "Ai", "w"}
    assert pieces["Ai"].shape == (N, B, H, C, C) and pieces["w"].dtype == jnp.bfloat16
    assert dots < dots_recompute and exps < exps_recompute, (dots, dots_recompute, exps, exps_recompute)
    with chunk.settings(prep_bwd="xla", residuals="pieces"):
        assert chunk._core_fwd(*args)[1][-1] is None


def test_dispatch(caplog):
    nm = _Numerics(jnp.bfloat16)
    counts = jnp.zeros((1, 1, 1, 64), jnp.int32)
    assert chunk_prep_bwd.PREP_BWD == "auto"
    with chunk.settings(prep_bwd="auto"):
        assert chunk_prep_bwd.prep_bwd_mode(nm, 128, True, True, None, "mosaic", True) == "mosaic"
        assert chunk_prep_bwd.prep_bwd_mode(nm, 128, True, True, None, "xla", True) is None
        assert chunk_prep_bwd.prep_bwd_mode(nm, 128, False, True, None, "mosaic", True) is None
    with chunk.settings(prep_bwd="interpret"):
        assert chunk_prep_bwd.prep_bwd_mode(nm, 128, True, True, None, "xla", True) == "interpret"
        chunk_prep_bwd._prep_warned.clear()
        with caplog.at_level(logging.WARNING, logger="kernels.kda.chunk_prep_bwd"):
            assert chunk_prep_bwd.prep_bwd_mode(nm, 128, True, True, counts, "xla", True) is None
            assert chunk_prep_bwd.prep_bwd_mode(nm, 96, True, True, None, "xla", True) is None
            assert chunk_prep_bwd.prep_bwd_mode(_Numerics(jnp.float32), 128, True, True, None, "xla", True) is None
            assert chunk_prep_bwd.prep_bwd_mode(nm, 128, True, True, None, "xla", False) is None
        for reason in ("segment resets", "K=96", "float32", "'compute' cotangents"):
            assert reason in caplog.text, reason
    with pytest.raises(ValueError, match="prep_bwd"):
        with chunk.settings(prep_bwd="cuda"):
            pass
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="interpret"), chunk.settings(prep_bwd="mosaic"):
            chunk_prep_bwd.prep_bwd_mode(nm, 128, True, True, None, "xla", True)


def test_shape_errors():
    bf = jnp.zeros((1, 1, 64, 96), jnp.bfloat16)
    f = jnp.zeros((1, 1, 64, 96), jnp.float32)
    with pytest.raises(ValueError, match="K=96"):
        mosaic_prep_bwd.prep_bwd(bf, bf, f, f[..., 0], f[:, :, 0], f[..., :64], f[..., :64], f, f, f, scale=1.0,
                                 interpret=True)
    with pytest.raises(ValueError, match="C=32"):
        mosaic_prep_bwd.prep_bwd(bf[:, :, :32, :64], bf[:, :, :32, :64], f[:, :, :32, :64], f[:, :, :32, 0],
                                 f[:, :, 0, :64], f[:, :, :32, :32], f[:, :, :32, :32], f[:, :, :32, :64],
                                 f[:, :, :32, :64], f[:, :, :32, :64], scale=1.0, interpret=True)


@pytest.mark.gpu
def test_gpu_kernel_matches_autodiff(rng):
    """Compiled, at K = 128 over 2000 chunk-heads."""
    (q, k, g, beta, scale, ct), want = _case(rng, 20, 100, 128)
    flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])  # noqa: E731
    got = mosaic_prep_bwd.prep_bwd(flat(q), flat(k), flat(jnp.cumsum(g, axis=-2)), flat(beta), flat(ct["decay"]),
                                   flat(ct["Aqk"]), flat(ct["L"]), flat(ct["qg"]), flat(ct["kg"]), flat(ct["kgam"]),
                                   scale=scale)
    for name, a, b, tol in zip(("dq", "dk", "dg", "dbeta"), got, want, (4e-3, 4e-3, 1e-4, 1e-5)):
        err = rel_rms(b, np.asarray(a, np.float32).reshape(b.shape))
        assert err < tol, (name, err)


@pytest.mark.gpu
def test_gpu_training_gradients_with_the_kernel(rng):
    """chunk_mosaic's gradients at 2,4096,16,128 with the kernel's pull-back equal XLA's, with G
    from XLA's cumsum or formed in the kernel (`prep_bwd_cumsum`)."""
    B, T, H, K = 2, 4096, 16, 128
    q, k, v, g, beta = _token_inputs(rng, B, T, H, K)
    do = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)

    def grads():
        def f(q, k, v, g, beta):
            o, _ = kda(q, k, v, g, beta, lower_bound=-5.0, impl="chunk_mosaic")
            return jnp.sum(o.astype(jnp.float32) * do)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)

    with chunk.settings(prep_bwd="xla"):
        want = grads()
    with chunk.settings(prep_bwd="mosaic"):
        got = grads()
    with chunk.settings(prep_bwd="mosaic", residuals="pieces"):
        kept = grads()
    with chunk.settings(prep_bwd="mosaic", residuals="pieces", prep_bwd_cumsum="kernel"):
        cumsum = grads()
    for name, a, b, c, d in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, kept, cumsum):
        assert rel_rms(b, a) < 1e-2, (name, rel_rms(b, a))
        assert rel_rms(a, c) < 1e-3, (name, rel_rms(a, c))
        assert rel_rms(c, d) < 1e-3, (name, rel_rms(c, d))

"""The Mosaic GPU backward of the bounded decayed scores (`kernels/kda/mosaic_scores_bwd.py`)
against XLA's autodiff of `chunk_intra.decayed_scores` (float32 products), in the Mosaic GPU
interpreter; the whole chunked KDA with it against the naive reference; its CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_intra, kda, mosaic_scores_bwd
from tests.kernels.test_kda_chunk import assert_as_accurate, make_inputs, relative_errors


def _rel(want, got):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.sqrt(np.mean((want - got) ** 2)) / np.sqrt(np.mean(want**2)))


def _check_vjp(rng, monkeypatch, delta, operands, interpret, N=2, H=2):
    """dq, dk, dG of the kernel's VJP (split-bf16 products) within 5e-5 of float32 autodiff, with
    the full bounded gate range (G falling by up to 5 per token) and two programs per chunk
    (K = 128)."""
    kernel = functools.partial(mosaic_scores_bwd.scores_bwd_kernel, operands=operands)
    monkeypatch.setattr(mosaic_scores_bwd, "scores_bwd_kernel", kernel)
    B, C, K = 1, 64, 128
    bf_values = lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)
    q = bf_values(rng.standard_normal((N, B, H, C, K)))
    k = bf_values(rng.standard_normal((N, B, H, C, K)) / np.sqrt(K))
    G = jnp.asarray(np.cumsum(-5 * rng.uniform(size=(N, B, H, C, K)), axis=-2), jnp.float32)
    scale = K**-0.5
    lower = np.tril(np.ones((C, C), bool))
    dA = [jnp.asarray(np.where(lower, rng.standard_normal((N, B, H, C, C)), 0), jnp.float32) for _ in range(2)]
    X = 2 if delta else 1
    hi = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)

    def ref(q, k, G):
        return chunk_intra.decayed_scores([q * scale, k][:X], k, G, bounded=True, mm=hi)

    def bf16_mm(spec, x, y):
        return jnp.einsum(spec, x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    want_out, vjp = jax.vjp(ref, q, k, G)
    got_out, kvjp = jax.vjp(lambda q, k, G: mosaic_scores_bwd.dense_scores(q, k, G, scale, delta, bf16_mm, interpret),
                            q, k, G)
    for name, want, got in zip(("dq", "dk", "dG"), vjp(dA[:X]), kvjp(dA[:X])):
        assert _rel(want, got) < 5e-5, name
    for want, got in zip(want_out, got_out):  # the forward is decayed_scores' own
        np.testing.assert_allclose(np.where(lower, got, 0), np.where(lower, want, 0), atol=5e-4, rtol=5e-3)


@pytest.mark.parametrize("delta, operands", [(True, "factored"), (False, "factored"), (True, "direct")])
def test_kernel_vjp_matches_float32_autodiff(rng, monkeypatch, delta, operands):
    """In the interpreter, for both ways of forming the anchored operands."""
    _check_vjp(rng, monkeypatch, delta, operands, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("operands", ["factored", "direct"])
def test_gpu_kernel_variants_match_float32_autodiff(rng, monkeypatch, operands):
    """Compiled, every variant the stage benchmark times (a race between a tile's operand rewrite
    or result staging and the products or copies still reading them would show here), over 16
    chunks x 8 heads."""
    _check_vjp(rng, monkeypatch, True, operands, interpret=False, N=16, H=8)


def test_kda_with_kernel_backward_matches_naive(rng, monkeypatch):
    """impl="chunk" in bf16 with scores_bwd="interpret": outputs and all gradients within the bf16
    tolerances of the float32 naive reference, with packed documents, and as close as with the
    XLA backward (or closer)."""
    calls = []
    kernel = mosaic_scores_bwd.scores_bwd_kernel
    monkeypatch.setattr(mosaic_scores_bwd, "scores_bwd_kernel", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    inputs = make_inputs(rng, 1, 128, 2, 64, 64, "channel", lower=-5.0, seg="random")
    base = relative_errors(inputs, scores_bwd="xla")
    assert calls == []
    got = relative_errors(inputs, scores_bwd="interpret")
    assert calls == [1]  # the interpret mode's backward ran the kernel, the XLA one did not
    assert_as_accurate(base, got)


def test_kernel_lowers_for_cuda():
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    N, BH, C, K = 2, 3, 64, 128
    for X, operands in ((1, "factored"), (2, "factored"), (2, "direct")):
        kernel = functools.partial(mosaic_scores_bwd.scores_bwd_kernel, scale=0.1, operands=operands)
        lowered = jax.jit(kernel).trace(
            bf(N, BH, C, K), bf(N, BH, C, K), f32(N, BH, C, K), f32(N, BH, 8, K), bf(N, BH, X, 2, C, C),
            bf(N, BH, X, 2, C, C)).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()[:4000]


def test_compiled_kernel_needs_a_gpu(rng):
    """scores_bwd="mosaic" on a backend without a GPU is a clear error, not a Mosaic GPU compile
    failure (the tests run the kernel as "interpret")."""
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU backend compiles the kernel")
    q, k, v, g, beta, h0, _ = make_inputs(rng, 1, 64, 1, 64, 64, "channel", lower=-5.0)
    loss = lambda q: jnp.sum(kda(q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), g, beta,
                                 lower_bound=-5.0, impl="chunk").astype(jnp.float32))
    with chunk.settings(scores_bwd="mosaic"):
        with pytest.raises(ValueError, match="interpret"):
            jax.grad(loss)(jnp.asarray(q, jnp.bfloat16))


def test_kernel_rejects_unsupported_inputs():
    x = jnp.zeros((1, 1, 64, 96), jnp.bfloat16)
    anchors = jnp.zeros((1, 1, 8, 96), jnp.float32)
    dA = jnp.zeros((1, 1, 2, 2, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        mosaic_scores_bwd.scores_bwd_kernel(x, x, x.astype(jnp.float32), anchors, dA, dA, scale=1.0, interpret=True)
    x = jnp.zeros((1, 1, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="operands"):
        mosaic_scores_bwd.scores_bwd_kernel(x, x, x.astype(jnp.float32), anchors[..., :64], dA, dA, scale=1.0,
                                            interpret=True, operands="fused")
    with pytest.raises(ValueError, match="bf16"):
        mosaic_scores_bwd.scores_bwd_kernel(x, x, x.astype(jnp.float32), anchors[..., :64], dA.astype(jnp.float32),
                                            dA, scale=1.0, interpret=True)


@pytest.mark.gpu
def test_gpu_kda_with_kernel_backward(rng):
    """Compiled on a GPU at K = V = 128 with resets: every gradient within the bf16 tolerances
    and as close to the reference as the XLA backward's."""
    inputs = make_inputs(rng, 1, 1024, 4, 128, 128, "channel", lower=-5.0, seg="random")
    assert_as_accurate(relative_errors(inputs, scores_bwd="xla"), relative_errors(inputs, scores_bwd="mosaic"))

"""A differentiated call's forward with the intra-chunk pieces from the bf16 intra kernel
(`pallas_gpu.TRAIN_INTRA` "kernel": `mosaic_intra_bf16.intra_bf16(pieces=True)` beside the state
kernel) against chunk.py's XLA pieces ("xla") and the token-serial reference, under the Mosaic GPU
interpreter; the residuals it keeps; the backward's XLA routes on those pieces; CUDA lowering."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, kda, mosaic_intra_bf16, mosaic_wy_bwd, pallas_gpu
from kernels.testing import rel_rms

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# every backward kernel under the interpreter, so that the kept pieces apply on CPU
KERNELS = dict(prep_bwd="interpret", wy_bwd="interpret")


def _inputs(rng, B, T, H, K, V):
    """bf16 q, k (unit rows), v; gates in [-5, 0]; beta; an initial state; cotangents of o and S."""
    n = lambda *s: rng.standard_normal(s)  # noqa: E731
    k = n(B, T, H, K)
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16)
    args = (jnp.asarray(n(B, T, H, K), jnp.bfloat16), k, jnp.asarray(n(B, T, H, V), jnp.bfloat16),
            jnp.asarray(-5 * jax.nn.sigmoid(n(B, T, H, K)), jnp.float32),
            jnp.asarray(jax.nn.sigmoid(n(B, T, H)), jnp.float32),
            jnp.asarray(n(B, H, K, V) * 0.1, jnp.float32))
    return args, jnp.asarray(n(B, T, H, V), jnp.float32), jnp.asarray(n(B, H, K, V), jnp.float32)


def _run(impl, args, do, dS):
    def loss(q, k, v, g, beta, h0):
        o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, lower_bound=-5.0, impl=impl)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS), (o, S)

    (_, (o, S)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    return o.astype(jnp.float32), S, grads


def _spy(monkeypatch):
    calls, kernel = [], mosaic_intra_bf16.intra_bf16
    monkeypatch.setattr(mosaic_intra_bf16, "intra_bf16",
                        lambda *a, **kw: calls.append(kw.get("pieces", False)) or kernel(*a, **kw))
    return calls


@pytest.mark.parametrize("K, V, T, levers", [(64, 64, 150, {}), (128, 64, 150, dict(wy_bwd="xla", grad_intra="input")),
                                            (64, 64, 256, dict(forward_segments=2, segments=2))])
def test_kernel_pieces_match_xla_pieces(rng, monkeypatch, K, V, T, levers):
    """impl="chunk_mosaic" under differentiation (an initial state): o, S and every gradient with the
    kernel's pieces equal those with XLA's to bf16 rounding, and stay as close to naive; with the
    WY pull-back and Aqk^T do in XLA too (they read Ai^T, Aqk^T and k exp(G) through transposes and
    a product with beta); with both serial passes in two segments (the forward's segment starts
    from the kernel's unnegated w, the reverse pass's segments splitting Aqk^T)."""
    from kernels.kda import mosaic_scan

    args, do, dS = _inputs(rng, 1, T, 2, K, V)
    o_ref, S_ref, ref = _run("naive", args, do, dS)
    calls, starts, segment_starts = _spy(monkeypatch), [], mosaic_scan.segment_starts
    monkeypatch.setattr(mosaic_scan, "segment_starts", lambda *a, **kw: starts.append(kw) or segment_starts(*a, **kw))
    with chunk.settings(train_intra="xla", **{**KERNELS, **levers}):
        o_x, S_x, want = _run("chunk_mosaic", args, do, dS)
    assert calls == []  # under differentiation the forward is chunk.py's, with XLA's pieces
    starts.clear()
    wy_calls, wy_bwd = [], mosaic_wy_bwd.wy_bwd
    monkeypatch.setattr(mosaic_wy_bwd, "wy_bwd", lambda *a, **kw: wy_calls.append(kw) or wy_bwd(*a, **kw))
    with chunk.settings(train_intra="kernel", **{**KERNELS, **levers}):
        o, S, got = _run("chunk_mosaic", args, do, dS)
    assert calls == [True], "the training form of the intra kernel did not run"
    if "wy_bwd" not in levers:  # the WY kernel gave the pull-back kernel Aqk's cotangents and dv in v's layout
        assert [(kw["score_cotangents"], kw["token_values"]) for kw in wy_calls] == [(True, True)], wy_calls
    if "forward_segments" in levers:  # the kernel's forward ran its state pass in segments, from w itself
        assert [kw["w_negated"] for kw in starts] == [False], starts
    assert rel_rms(o_x, o) < 1e-2 and rel_rms(S_x, S) < 1e-2
    assert rel_rms(o_ref, o) < 5e-3 and rel_rms(S_ref, S) < 5e-3
    for name, a, b, r in zip(NAMES, got, want, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_rms(b, a) < 1e-2, (name, rel_rms(b, a))
        assert rel_rms(r, a) < max(1.5 * rel_rms(r, b), 2e-3), (name, rel_rms(r, a), rel_rms(r, b))


def test_kept_residuals_and_fallbacks(rng, monkeypatch):
    """The forward keeps the kernel's pieces (chunk-major, bf16 but the decays) and no XLA score
    product; where the pieces are not kept (residuals="states_vn") or the kernel cannot take
    the call (segment resets) the XLA forward runs, without the kernel's training form."""
    B, T, H, K = 1, 128, 2, 64
    (q, k, v, g, beta, h0), _, _ = _inputs(rng, B, T, H, K, K)
    fwd = lambda: pallas_gpu._kda_fwd(q, k, v, g, beta, h0, None, 0.125, "mosaic_bf16", True, True, "chunk")  # noqa: E731
    with chunk.settings(**KERNELS):
        res = fwd()[1]
        text = str(jax.make_jaxpr(fwd)())
    pieces = res[-1]
    assert set(pieces) == {"qg", "w", "kg", "decay", "AqkT", "AiT", "kexp"}
    N = T // 64
    assert pieces["AiT"].shape == pieces["AqkT"].shape == (N, B, H, 64, 64)
    assert pieces["kexp"].shape == (N, B, H, 64, K) and pieces["decay"].shape == (N, B, H, K)
    assert all(x.dtype == jnp.bfloat16 for key, x in pieces.items() if key != "decay")
    assert "dot_general" not in text, "the forward formed pieces in XLA"
    calls = _spy(monkeypatch)
    with chunk.settings(residuals="states_vn", **KERNELS):
        assert fwd()[1][-1] is None
    seg = jnp.asarray(np.repeat([[0, 1]], T // 2, axis=1), jnp.int32)
    with chunk.settings(**KERNELS):
        _run("chunk_mosaic", (q, k, v, g, beta, h0), jnp.ones((B, T, H, K)), jnp.ones((B, H, K, K)))
        grad = jax.grad(lambda q: jnp.sum(kda(q, k, v, g, beta, segment_ids=seg, lower_bound=-5.0,
                                              impl="chunk_mosaic")[0].astype(jnp.float32)))
        grad(q)
    assert calls == [True], calls  # only the call without resets, in its training form
    with pytest.raises(ValueError, match="train_intra"), chunk.settings(train_intra="both"):
        pass
    with pytest.raises(ValueError, match="mosaic_bf16"):
        pallas_gpu._kernel_forward(q, k, v, g, beta, h0, None, 0.125, "chunk", True, True, pieces=True)


def test_training_step_lowers_for_cuda():
    """jit(grad) of impl="chunk_mosaic" with the kernel's pieces lowers for CUDA as one program (the
    layouts, wgmma operands and SMEM of the intra kernel's training form and of the backward's
    kernels taking the transposed pieces): five Mosaic GPU kernels, the intra kernel's among them."""
    from kernels.kda import hopper

    B, T, H, D = 2, 256, 2, 128
    bf = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    beta = jax.ShapeDtypeStruct((B, T, H), jnp.float32)

    def loss(q, k, v, g, beta):
        return jnp.sum(kda(q, k, v, g, beta, lower_bound=-5.0, impl="chunk_mosaic")[0].astype(jnp.float32))

    with hopper.assume_device_kind("hopper"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(bf, bf, bf, g, beta).lower(
            lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) >= 5
    assert "kda_intra_bf16" in text


@pytest.mark.gpu
def test_gpu_kernel_pieces_match_xla_pieces(rng):
    """At 2,4096,16,128 on the GPU: gradients with the kernel's pieces equal XLA's pieces'."""
    args, do, dS = _inputs(rng, 2, 4096, 16, 128, 128)
    with chunk.settings(train_intra="xla"):
        o_x, S_x, want = _run("chunk_mosaic", args, do, dS)
    with chunk.settings(train_intra="kernel"):
        o, S, got = _run("chunk_mosaic", args, do, dS)
    assert rel_rms(o_x, o) < 1e-2 and rel_rms(S_x, S) < 1e-2
    for name, a, b in zip(NAMES, got, want):
        assert rel_rms(b, a) < 1e-2, (name, rel_rms(b, a))


def test_pull_back_forms_the_cumsum_itself(rng, monkeypatch):
    """chunk.settings(prep_bwd_cumsum="kernel"): the pull-back kernel takes g and forms G itself;
    the training gradients equal those with XLA's cumsum to float32 rounding of G (bf16 outputs)."""
    from kernels.kda import mosaic_prep_bwd

    seen, prep_bwd = [], mosaic_prep_bwd.prep_bwd
    monkeypatch.setattr(mosaic_prep_bwd, "prep_bwd", lambda *a, **kw: seen.append(kw["cumsum"]) or prep_bwd(*a, **kw))
    args, do, dS = _inputs(rng, 1, 150, 2, 64, 64)
    with chunk.settings(**KERNELS):
        _, _, want = _run("chunk_mosaic", args, do, dS)
    with chunk.settings(prep_bwd_cumsum="kernel", **KERNELS):
        _, _, got = _run("chunk_mosaic", args, do, dS)
    assert seen == [False, True]
    for name, a, b in zip(NAMES, got, want):
        assert rel_rms(b, a) < 1e-2, (name, rel_rms(b, a))
    with pytest.raises(ValueError, match="prep_bwd_cumsum"), chunk.settings(prep_bwd_cumsum="scan"):
        pass

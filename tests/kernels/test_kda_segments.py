"""Segment-parallel serial passes (`chunk_segments`, `chunk.settings(segments=...)`): the same
states, outputs and gradients as the plain passes, through the XLA passes and the Mosaic GPU
kernels (interpreted), and the CUDA lowering of the width-(K + V) pass they add."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_segments, mosaic_scan
from kernels.kda.chunk import _Numerics, _grad_scan, _state_scan
from kernels.testing import assert_close
from tests.kernels.test_kda_chunk import BF16_TOL, F32_TOL, make_inputs
from tests.kernels.test_kda_mosaic_scan import _compare


def _chunks(rng, N, delta, B=2, H=2, K=64, V=64):
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)  # noqa: E731
    w = f(N, B, H, 64, K) if delta else None
    decay = jnp.asarray(rng.uniform(0.5, 1.0, (N, B, H, K)), jnp.float32)  # states carry across chunks
    return w, f(N, B, H, 64, V), f(N, B, H, 64, K), f(N, B, H, 64, K), f(N, B, H, 64, V), f(N, B, H, 64, V), \
        decay, f(B, H, K, V), f(B, H, K, V)


@pytest.mark.parametrize("delta, N, segments", [(True, 8, 4), (True, 8, 8), (False, 12, 4), (True, 6, 4)])
def test_segmented_passes_equal_the_plain_passes(rng, delta, N, segments):
    """Both passes on random chunk tensors (DeltaNet-style w and linear attention's w = None; 6
    chunks take 2 segments when asked for 4): every output within float32 rounding of the plain
    pass, and the starting states really do come through the segment transitions."""
    w, u, kg, qg, do, dvi, decay, h0, dS = _chunks(rng, N, delta)
    nm = _Numerics(jnp.float32)
    scan = lambda *a, **kw: _state_scan(nm, *a, **kw)  # noqa: E731
    want = scan(h0, w, u, kg, decay)
    got = chunk_segments.state_scan(scan, h0, w, u, kg, decay, segments)
    for name, r, x in zip(("states", "vn", "S"), want, got):
        assert_close(name, r, x, 1e-5)
    cut = scan(jnp.zeros_like(h0), w, u, kg, decay)[0]  # no initial state: later chunks change too
    assert float(jnp.abs(cut[-1] - want[0][-1]).max()) > 1e-3

    dS_out = nm.mm("nbhck,nbhcv->nbhkv", qg, do)
    grad = lambda dS, c, src, **kw: _grad_scan(nm, dS, c[0], c[1], c[2], *src, **kw)  # noqa: E731
    want = grad(dS, (w, kg, decay), (dS_out, dvi))
    got = chunk_segments.grad_scan(grad, dS, (w, kg, decay), (dS_out, dvi), segments)
    for name, r, x in zip(("dhs", "dvn", "dh0"), want, got):
        assert_close(name, r, x, 1e-5)


@pytest.mark.parametrize("grad_issue", ["in_order", "early"])
def test_segmented_mosaic_kernels_equal_the_plain_passes(rng, grad_issue):
    """The Mosaic GPU passes (interpreted) in segments, their width-(K + V) pass included, with
    either order of the reverse pass's products."""
    with chunk.settings(grad_issue=grad_issue):
        _segmented_mosaic_kernels_equal_the_plain_passes(rng)


def _segmented_mosaic_kernels_equal_the_plain_passes(rng):
    w, u, kg, qg, do, dvi, decay, h0, dS = _chunks(rng, 4, True, B=1, H=2, K=64, V=64)
    scan = lambda *a, **kw: mosaic_scan.state_scan_chunks(*a, cd=jnp.float32, interpret=True, **kw)  # noqa: E731
    want, got = scan(h0, w, u, kg, decay), chunk_segments.state_scan(scan, h0, w, u, kg, decay, 2)
    for name, r, x in zip(("states", "vn", "S"), want, got):
        assert_close(name, r, x, 1e-5)
    last = scan(h0, w, u, kg, decay, final_only=True)  # the final tile alone: the same values
    assert last[:2] == (None, None) and np.array_equal(last[2], want[2])
    grad = lambda dS, c, src, **kw: mosaic_scan.grad_scan_chunks(  # noqa: E731
        dS, c[0], c[1], c[2], src[0], src[1], c[3], cd=jnp.float32, interpret=True, **kw)
    chunked, sources = (w, kg, qg, decay), (do, dvi)
    want, got = grad(dS, chunked, sources), chunk_segments.grad_scan(grad, dS, chunked, sources, 2)
    for name, r, x in zip(("dhs", "dvn", "dh0"), want, got):
        assert_close(name, r, x, 1e-5)
    last = grad(dS, chunked, sources, final_only=True)
    assert last[:2] == (None, None) and np.array_equal(last[2], want[2])


@pytest.mark.parametrize("impl, dtype, T", [("chunk", jnp.float32, 500), ("chunk_mosaic", jnp.bfloat16, 256)])
def test_kda_with_segments_matches_naive(rng, monkeypatch, impl, dtype, T):
    """The whole op with `chunk.settings(segments=4)` (chunk_mosaic: its kernels, interpreted)
    against naive at the usual tolerances: outputs, final state and the six gradients, with an
    initial state, a padded last chunk (T = 500) and gates mild enough that states cross chunks
    (no resets). Both passes run in 4 segments."""
    used = []
    real = chunk_segments.effective_segments
    monkeypatch.setattr(chunk_segments, "effective_segments", lambda *a: used.append(real(*a)) or used[-1])
    K = 64 if impl == "chunk" else 128
    inputs = make_inputs(rng, 1, T, 2, K, K, "channel", lower=-0.05)
    with chunk.settings(segments=4):
        _compare(rng, inputs, F32_TOL if dtype == jnp.float32 else BF16_TOL, None, dtype, impls=("naive", impl))
    assert len(used) >= 2 and set(used) == {4}


def test_segments_setting_is_checked_and_reduced_with_a_log(caplog, monkeypatch):
    with pytest.raises(ValueError, match="segments"):
        with chunk.settings(segments=3):
            pass
    with pytest.raises(ValueError, match="segments"):
        chunk_segments.effective_segments(8, 3)
    with caplog.at_level(logging.WARNING):
        assert chunk_segments.effective_segments(12, 8) == 4
    assert "12 chunks do not split into 8 segments; using 4" in caplog.text
    assert chunk_segments.effective_segments(1024, 16) == 16
    # "auto" on a 132-SM GPU: 1 x 16 heads x 2 column blocks = 32 programs -> 8 segments of 128
    # chunks at T = 65536; 256 programs (8 x 4096 x 16) already fill it; short sequences stay whole.
    monkeypatch.setattr(chunk_segments, "_num_sms", lambda: 132)
    assert chunk_segments.effective_segments(1024, "auto", 32) == 8
    assert chunk_segments.effective_segments(64, "auto", 256) == 1
    assert chunk_segments.effective_segments(24, "auto", 2) == 1
    assert chunk_segments.effective_segments(256, "auto", 2) == 16
    # The forward-only pass's "auto": segments only below a quarter of the SMs, up to one program per SM.
    fwd = functools.partial(chunk_segments.effective_segments, auto=chunk_segments.auto_forward_segments)
    assert fwd(1024, "auto", 32) == 4  # 1 x 65536 x 16 heads: 128 programs
    assert fwd(256, "auto", 64) == 1  # 2 x 16384 x 16 heads: more than 33 programs already
    assert fwd(64, "auto", 256) == 1 and fwd(2048, "auto", 4) == 32 and fwd(24, "auto", 2) == 1
    assert fwd(1024, 8, 32) == 8  # a number is taken as it is
    kg = jnp.zeros((6, 2, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match="segments need"):  # 6 chunks, 4 segments
        mosaic_scan.state_scan(None, kg, kg, jnp.zeros((6, 2, 64)), jnp.zeros((8, 64, 64)), segments=4, interpret=True)
    with pytest.raises(ValueError, match="segments need"):  # one carried tile per batch * head, not per segment
        mosaic_scan.grad_scan(None, kg, kg, kg, kg, jnp.zeros((6, 2, 64)), jnp.zeros((2, 64, 64)), segments=2,
                              interpret=True)
    x = jnp.arange(8 * 3 * 2).reshape(8, 3, 2)
    assert np.array_equal(chunk_segments.join(chunk_segments.split(x, 4), 4), x)
    assert np.array_equal(chunk_segments.split(x, 4)[1, 3:6], x[3])  # segment 1, its chunk 1


def test_segmented_forward_backward_lowers_for_cuda():
    """The bf16 forward+backward with 4 segments (the kernels at V = 128 and at K + V = 256)
    lowers for CUDA on the CPU."""

    def loss(q, k, v, g, beta, h0):
        o, S = chunk.run_chunked(q, k, v, g, beta, scale=0.125, initial_state=h0, segment_ids=None,
                                 bounded=True, delta=True, state_pass="mosaic")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    sd = jax.ShapeDtypeStruct
    B, T, H, K = 1, 512, 2, 128
    args = [sd((B, T, H, K), jnp.bfloat16)] * 3 + [sd((B, T, H, K), jnp.float32), sd((B, T, H), jnp.float32),
                                                   sd((B, H, K, K), jnp.float32)]
    with chunk.settings(segments=4):
        module = jax.export.export(jax.jit(jax.grad(loss, argnums=tuple(range(6)))), platforms=["cuda"])(*args)
    assert module.mlir_module().count("mosaic_gpu") >= 4


@pytest.mark.gpu
def test_gpu_segmented_chunk_mosaic_matches_naive(rng):
    """8 segments of the compiled kernels at a real length (64 chunks; bf16, the bounded path with
    gates in [-0.05, 0] and no resets, so that states cross segments) against naive, at the
    tolerances of the unsegmented op."""
    inputs = make_inputs(rng, 1, 4096, 4, 128, 128, "channel", lower=-0.05)
    with chunk.settings(segments=8):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16, impls=("naive", "chunk_mosaic"))

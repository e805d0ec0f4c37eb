"""The transition form of the Mosaic serial passes (`chunk.settings(scan_form="transition")`,
`mosaic_scan_transition.py`): against chunk.py's lax.scan passes on random chunk tensors, the whole
chunk_mosaic op against naive, its refusals, and the CUDA lowering, on CPU (Mosaic GPU
interpreter); at a training shape on a GPU."""

import jax
import jax.numpy as jnp
import pytest

from kernels.kda import chunk, chunk_segments, mosaic_scan, mosaic_scan_transition as mt
from kernels.kda.chunk import _Numerics, _grad_scan, _state_scan
from kernels.testing import assert_close
from tests.kernels.test_kda_chunk import BF16_TOL, F32_TOL, make_inputs
from tests.kernels.test_kda_mosaic_scan import _compare, cuda_train_module


@pytest.mark.parametrize("N, block_v", [(3, 64), (2, 16)])
def test_passes_match_the_xla_passes(rng, N, block_v):
    """float32 chunk tensors: the re-associated recurrences equal the WY ones to float32 rounding
    (states, v', final state; dS per chunk, dv', dS of the initial state), with a reset chunk."""
    B, H, K, V = 1, 2, 128, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)  # noqa: E731
    w, u, kg, qg = f(N, B, H, 64, K), f(N, B, H, 64, V), f(N, B, H, 64, K), f(N, B, H, 64, K)
    do, dvi = f(N, B, H, 64, V), f(N, B, H, 64, V)
    decay = jnp.asarray(rng.uniform(0.3, 1.0, (N, B, H, K)), jnp.float32).at[N // 2, :, 0].set(0.0)
    h0, dS = f(B, H, K, V), f(B, H, K, V)
    nm = _Numerics(jnp.float32)
    with chunk.settings(block_v=block_v):
        want = _state_scan(nm, h0, w, u, kg, decay)
        got = mt.state_scan_chunks(nm, h0, w, u, kg, decay, interpret=True)
        for name, r, x in zip(("states", "vn", "S"), want, got):
            assert_close(name, r, x, 1e-5)
        dS_out = nm.mm("nbhck,nbhcv->nbhkv", qg, do)
        want = _grad_scan(nm, dS, w, kg, decay, dS_out, dvi)
        got = mt.grad_scan_chunks(nm, dS, w, kg, qg, do, dvi, decay, interpret=True)
        for name, r, x in zip(("dhs", "dvn", "dh0"), want, got):
            assert_close(name, r, x, 1e-5)
        assert mt.state_scan_chunks(nm, h0, w, u, kg, decay, interpret=True, final_only=True)[:2] == (None, None)


def _spy(monkeypatch):
    """Records which passes launch: (module, body) names."""
    launched = []
    for mod in (mosaic_scan, mt):
        real = mod.launch_bh_v

        def spy(body, *a, _real=real, _mod=mod, **kw):
            launched.append((_mod.__name__.rsplit(".", 1)[-1], body.func.__name__))
            return _real(body, *a, **kw)

        monkeypatch.setattr(mod, "launch_bh_v", spy)
    return launched


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)])
def test_chunk_mosaic_matches_naive(rng, monkeypatch, dtype, tol):
    """The op through both transition passes (packed documents, bounded gates) against naive:
    outputs, final state and every gradient at the usual tolerances. The same jitted call runs
    under the default form first: the setting is part of its cache key, so it is traced again."""
    inputs = make_inputs(rng, 1, 200, 2, 128, 128, "channel", lower=-5.0, seg="random")
    _compare(rng, inputs, tol, -5.0, dtype)
    launched = _spy(monkeypatch)
    with chunk.settings(scan_form="transition"):
        _compare(rng, inputs, tol, -5.0, dtype)
    assert set(launched) == {("mosaic_scan_transition", "_fwd_body"), ("mosaic_scan_transition", "_bwd_body")}


def test_linear_attention_and_settings(rng, monkeypatch):
    """Linear attention keeps the WY passes (no product on its chain); segments > 1 are refused
    with the reason; an unknown form is refused by name."""
    launched = _spy(monkeypatch)
    q, k, v, g, _, h0, _ = [jnp.asarray(x) if x is not None else None
                            for x in make_inputs(rng, 1, 70, 1, 64, 64, "channel")]

    def run(delta):
        return jax.grad(lambda q: jnp.sum(chunk.run_chunked(
            q, k, v, g, jnp.ones(q.shape[:3]), scale=0.125, initial_state=h0, segment_ids=None, bounded=False,
            delta=delta, state_pass="mosaic_interpret")[0]))(q)

    with chunk.settings(scan_form="transition"):
        run(False)
        assert set(launched) == {("mosaic_scan", "_fwd_body"), ("mosaic_scan", "_bwd_body")}
        with chunk.settings(segments=2):
            with pytest.raises(ValueError, match="segments=2 needs scan_form='wy'"):
                run(True)
    with pytest.raises(ValueError, match="scan_form='fused'"):
        with chunk.settings(scan_form="fused"):
            pass
    assert chunk_segments.SCAN_FORM == "wy"


@pytest.mark.parametrize("B, T, H, block_v", [(8, 4096, 16, 64), (1, 65536, 16, 16), (1, 256, 2, 32)])
def test_forward_backward_lowers_for_cuda(B, T, H, block_v):
    """Both transition passes in the bf16 forward+backward lower for CUDA (wgmma operands and
    swizzles, the [K, K] transition's SMEM within the budget at 64 columns)."""
    text = cuda_train_module(B, T, H, 128, block_v=block_v, scan_form="transition")
    assert text.count("mosaic_gpu") >= 2
    assert "mosaic_scan_transition" in text


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [64, 16])
def test_gpu_matches_naive(rng, block_v):
    """Compiled, at a training shape with packed documents: against naive at the bf16 tolerances."""
    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0, seg="random")
    with chunk.settings(block_v=block_v, scan_form="transition"):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)

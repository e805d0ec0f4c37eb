"""`chunk.settings(state_chain=...)` (`mosaic_state.CHAIN`): the forward-only state pass with S^T
and v'^T as wgmma's register operands (`mosaic_state_regs`, "regs") against the SMEM form
(`mosaic_state._body`, "smem") and a float64 recurrence; the interpreter on CPU, the compiled
kernels on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, mosaic_state, mosaic_state_regs
from kernels.testing import rel_rms
from tests.kernels.test_kda_chunk import BF16_TOL
from tests.kernels.test_kda_pallas_gpu import _check_parity


def _operands(rng, N, BH, K, V, chunk_major, segments=1, h0=True, wk=0.3):
    """Random chunk operands; `wk` scales w and kg, whose product sets how fast S grows per chunk."""
    f = lambda *s, x=0.3: jnp.asarray(rng.standard_normal(s) * x, jnp.bfloat16)  # noqa: E731
    lead = (N, BH) if chunk_major else (BH, N)
    ops = (f(*lead, 64, K), f(*lead, 64, K, x=wk), f(*lead, 64, K, x=wk), f(*lead, 64, V), f(*lead, 64, 64),
           jnp.asarray(rng.uniform(0.5, 1.0, (*lead, K)), jnp.float32))
    return ops + (jnp.asarray(rng.standard_normal((segments * BH, K, V)), jnp.float32) if h0 else None,)


def _recurrence(qg, wn, kg, u, a, d, h0, *, chunk_major, a_transposed, w_negated, segments):
    """o [BH, N, C, V] and the final states [segments * BH, K, V] in float64."""
    x = [np.asarray(t, np.float64) for t in (qg, wn, kg, u, a, d)]
    if chunk_major:
        x = [np.swapaxes(t, 0, 1) for t in x]
    qg, wn, kg, u, a, d = x
    BH, N = qg.shape[:2]
    a = np.swapaxes(a, -1, -2) if a_transposed else a
    h0 = np.zeros((segments * BH,) + (qg.shape[-1], u.shape[-1])) if h0 is None else np.asarray(h0, np.float64)
    o, final, L = np.zeros(u.shape), np.zeros(h0.shape), N // segments
    for s in range(segments):
        for b in range(BH):
            S = h0[s * BH + b].copy()
            for n in range(s * L, (s + 1) * L):
                vn = u[b, n] + (1 if w_negated else -1) * wn[b, n] @ S
                o[b, n] = qg[b, n] @ S + a[b, n] @ vn
                S = d[b, n][:, None] * S + kg[b, n].T @ vn
            final[s * BH + b] = S
    return o, final


@pytest.mark.parametrize("K,V,segments,h0,layout", [
    (128, 128, 1, False, dict(heads=2, a_transposed=True)),  # the forward call's layout
    (128, 128, 1, True, dict(heads=2, a_transposed=True)),
    (128, 128, 2, True, dict(chunk_major=True, w_negated=False)),  # segments, chunk-major, W itself
    (64, 64, 1, True, dict()),
    (64, 128, 1, True, dict(a_transposed=True)),
])
def test_regs_chain_matches_smem_and_the_recurrence(rng, K, V, segments, h0, layout):
    """Both forms, float32 o: "regs" equals "smem" (the same bf16 operands and products; 1e-6 for
    the order of float32 sums), and both follow the float64 recurrence on the same operands up
    to the bf16 rounding of S and v' (which both forms apply before every product)."""
    N, BH = 4, 4
    ops = _operands(rng, N, BH, K, V, layout.get("chunk_major", False), segments, h0)
    launched, orig = [], mosaic_state_regs._body

    def spy(*refs, **kw):
        launched.append(kw)
        return orig(*refs, **kw)

    outs = {}
    for form in ("smem", "regs"):
        with chunk.settings(state_chain=form), pytest.MonkeyPatch.context() as mp:
            mp.setattr(mosaic_state_regs, "_body", spy)
            outs[form] = mosaic_state.state_output(*ops, out_dtype=jnp.float32, interpret=True, segments=segments,
                                                   **layout)
    assert len(launched) == 1  # "regs" ran its own kernel, "smem" did not
    o_ref, s_ref = _recurrence(*ops, chunk_major=layout.get("chunk_major", False),
                               a_transposed=layout.get("a_transposed", False),
                               w_negated=layout.get("w_negated", True), segments=segments)
    heads = layout.get("heads")
    for form, (o, S) in outs.items():
        o = np.asarray(o, np.float64)
        if heads:  # [B, N * C, H, V] -> [B * H, N, C, V]
            o = o.reshape(o.shape[0], N, 64, heads, V).transpose(0, 3, 1, 2, 4).reshape(BH, N, 64, V)
        assert np.abs(o - o_ref).max() <= 0.02 * np.abs(o_ref).max(), form
        assert np.abs(np.asarray(S) - s_ref).max() <= 0.02 * np.abs(s_ref).max(), form
    for x, y in zip(outs["smem"], outs["regs"]):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-6 * float(jnp.abs(x).max()))


def test_chain_choice(monkeypatch):
    """"auto" takes "regs" where it runs (64 columns, double buffers, no per-chunk outputs) and the
    pass has no more programs than SMs; "regs" asked for where it cannot run raises; passes with
    per-chunk outputs run "smem"."""
    monkeypatch.setattr(mosaic_state, "_num_sms", lambda: 132)
    with chunk.settings(state_chain="auto"):
        assert mosaic_state.chain(64, False, 64) == "regs"
        assert mosaic_state.chain(64, False, 132) == "regs"
        assert mosaic_state.chain(64, False, 133) == "smem"
        assert mosaic_state.chain(32, False, 64) == "smem"
        assert mosaic_state.chain(64, True, 64) == "smem"
        with chunk.settings(state_buffers="single"):
            assert mosaic_state.chain(64, False, 64) == "smem"
        with pytest.raises(ValueError, match="program count"):
            mosaic_state.chain(64, False)
    with chunk.settings(state_chain="regs"):
        assert mosaic_state.chain(64, True) == "smem"
        with pytest.raises(ValueError, match="64 V columns per program"):
            mosaic_state.chain(32, False)
        with chunk.settings(state_buffers="single"), pytest.raises(ValueError, match="double buffers"):
            mosaic_state.chain(64, False)
    with chunk.settings(state_chain="smem"):
        assert mosaic_state.chain(64, False) == "smem"
    with pytest.raises(ValueError, match="state_chain="):
        with chunk.settings(state_chain="registers"):
            pass


@pytest.mark.parametrize("n_docs", [0, 2])
def test_regs_chain_runs_the_kda_forward(rng, n_docs):
    """Forward-only pallas_gpu calls (the bounded intra kernel without documents, the XLA intra
    stage with them) with "regs": o and the final state match naive within the bf16 tolerances,
    and the pass ran in this form."""
    launched, orig = [], mosaic_state_regs._body
    with chunk.settings(state_chain="regs"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(mosaic_state_regs, "_body", lambda *r, **kw: launched.append(1) or orig(*r, **kw))
        _check_parity(rng, 1, 192, 2, 128, 128, "channel", jnp.bfloat16, BF16_TOL, n_docs=n_docs, grads=False,
                      lower_bound=-5.0)
    assert launched == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("h0", [False, True])
def test_gpu_regs_chain_matches_smem(rng, h0):
    """The compiled kernels at the forward's layout, 64 chunks of 64 heads: "regs" against "smem"
    and both against the float64 recurrence."""
    ops = _operands(rng, 64, 64, 128, 128, False, 1, h0, wk=0.03)  # S stays finite over 64 chunks
    outs = {}
    for form in ("smem", "regs"):
        with chunk.settings(state_chain=form):
            outs[form] = jax.jit(lambda *x: mosaic_state.state_output(*x, out_dtype=jnp.float32))(*ops)
    o_ref, s_ref = _recurrence(*ops, chunk_major=False, a_transposed=False, w_negated=True, segments=1)
    errs = {form: (rel_rms(o_ref, o), rel_rms(s_ref, S)) for form, (o, S) in outs.items()}
    print("relative RMS error against float64 (o, final state):", errs)
    for form, (o, S) in outs.items():
        assert np.abs(np.asarray(o, np.float64) - o_ref).max() <= 0.02 * np.abs(o_ref).max(), form
        assert np.abs(np.asarray(S, np.float64) - s_ref).max() <= 0.02 * np.abs(s_ref).max(), form
    # Compiled, the two forms' products sum in different orders (S^T W^T against W S), and where
    # v' or S round to bf16 differently the chunks after carry it: not equal as in the
    # interpreter, but no further from the float64 recurrence.
    for smem, regs in zip(errs["smem"], errs["regs"]):
        assert regs <= 1.5 * smem + 1e-5, errs


@pytest.mark.gpu
@pytest.mark.parametrize("n_docs", [0, 8])
def test_gpu_regs_chain_parity(rng, n_docs):
    """Forward-only pallas_gpu calls with "regs" at (2, 4096, 16, 128), with and without 8 packed
    documents: o and the final state within the bf16 tolerances of naive."""
    with chunk.settings(state_chain="regs"):
        _check_parity(rng, 2, 4096, 16, 128, 128, "channel", jnp.bfloat16, BF16_TOL, n_docs=n_docs, grads=False,
                      lower_bound=-5.0)

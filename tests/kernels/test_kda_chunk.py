"""The chunked KDA (`impl="chunk"`) against the float64 oracle and the token-serial naive impl:
outputs, final states and all gradients, float32 and bfloat16, exact and bounded (lower_bound=-5)
paths, packed-document resets, extreme gates, state continuity, and numerical gradient checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from kernels.kda import kda
from kernels.testing import assert_close
from tests.oracle import delta_rule_np

F32_TOL = dict(o=1e-5, S=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dg=1e-5, dbeta=1e-5, dh0=1e-5)
BF16_TOL = dict(o=0.005, S=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dh0=0.008)
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(rng, B, T, H, K, V, gate="channel", lower=-1.0, seg=None, g_fill=None):
    """Unit-norm keys, beta in [0, 1], g in [lower, 0] per channel / per head / None.

    seg: None, "random" (resets w.p. 0.1) or "edge" (a mid-chunk reset and length-1 segments)."""
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    shape = {"none": None, "head": (B, T, H), "channel": (B, T, H, K)}[gate]
    g = None if shape is None else (lower * rng.uniform(0, 1, shape)).astype(np.float32)
    if g_fill is not None:
        g = np.where(rng.uniform(size=g.shape) < g_fill[1], g_fill[0], g).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    segment_ids = None
    if seg == "random":
        segment_ids = np.cumsum(rng.uniform(size=(B, T)) < 0.1, axis=1).astype(np.int32)
    elif seg == "edge":
        starts = np.zeros((B, T), bool)
        for t in (5, 30, 31, 32, 64, 65, 100):  # mid-chunk, length-1 runs, at and right after a chunk edge
            if t < T:
                starts[:, t] = True
        segment_ids = np.cumsum(starts, axis=1).astype(np.int32) % 3  # ids may repeat: a change is what counts
    return q, k, v, g, beta, h0, segment_ids


@functools.partial(jax.jit, static_argnames=("impl", "lower_bound", "has_seg", "traced"))
def _fwd_bwd(q, k, v, g, beta, h0, seg, do, dS, *, impl, lower_bound, has_seg, traced):
    """(o, S) and the gradients of <o, do> + <S, dS> w.r.t. q, k, v, g, beta, h0. `traced`: the
    module settings read while tracing (`_traced()`), so a program is never reused under others."""
    del traced

    def run(q, k, v, g, beta, h0):
        return kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=h0,
            segment_ids=seg if has_seg else None,
            lower_bound=lower_bound,
            output_final_state=True,
            impl=impl,
        )

    (o, S), vjp = jax.vjp(run, q, k, v, g, beta, h0)
    return o, S, vjp((do.astype(o.dtype), dS.astype(S.dtype)))


def _traced():
    from kernels.kda import chunk

    return chunk.traced_key()


def compare(rng, inputs, tol, lower_bound=None, dtype=jnp.float32):
    """chunk in `dtype` vs naive in float32 on the same (rounded) inputs; all outputs and grads."""
    q, k, v, g, beta, h0, seg = inputs
    cast = lambda x: jnp.asarray(x, dtype)
    qc, kc, vc = cast(q), cast(k), cast(v)
    up = lambda x: jnp.asarray(x, jnp.float32)
    do = rng.standard_normal(q.shape[:3] + (v.shape[-1],)).astype(np.float32)
    dS = rng.standard_normal(h0.shape).astype(np.float32)
    common = dict(lower_bound=lower_bound, has_seg=seg is not None, traced=_traced())
    seg_j = jnp.zeros(q.shape[:2], jnp.int32) if seg is None else jnp.asarray(seg)
    ref = _fwd_bwd(up(qc), up(kc), up(vc), g, beta, h0, seg_j, do, dS, impl="naive", **common)
    out = _fwd_bwd(qc, kc, vc, g, beta, h0, seg_j, do, dS, impl="chunk", **common)
    assert out[0].dtype == dtype and out[1].dtype == jnp.float32
    assert_close("o", ref[0], out[0], tol["o"])
    assert_close("S", ref[1], out[1], tol["S"])
    for name, r, x in zip(GRADS, ref[2], out[2]):
        if r is None:
            continue
        assert_close(name, r, x, tol[name])
    return ref, out


CASES = [
    # (B, T, H, K, V, gate, seg, lower_bound)
    (1, 1000, 1, 16, 16, "channel", None, None),
    (2, 65, 2, 128, 64, "head", None, -5.0),
    (2, 63, 1, 60, 100, "none", "edge", None),
    (1, 130, 2, 64, 128, "channel", "edge", -5.0),
    (2, 1, 2, 16, 60, "channel", None, None),
]


@pytest.mark.parametrize("B, T, H, K, V, gate, seg, lb", CASES)
def test_chunk_matches_naive_float32(rng, B, T, H, K, V, gate, seg, lb):
    """Against naive (outputs, final state, gradients) and the float64 oracle (outputs, state)."""
    inputs = make_inputs(rng, B, T, H, K, V, gate, lower=-5.0 if lb else -1.0, seg=seg)
    _, out = compare(rng, inputs, F32_TOL, lower_bound=lb)
    q, k, v, g, beta, h0, segment_ids = inputs
    o_ref, S_ref = delta_rule_np(q, k, v, g, beta, initial_state=h0, segment_ids=segment_ids)
    assert_close("o", o_ref, out[0], 1e-5)
    assert_close("S", S_ref, out[1], 1e-5)


@pytest.mark.parametrize("lb, gate, seg", [(-5.0, "channel", "random"), (None, "head", "edge")])
def test_chunk_bfloat16(rng, lb, gate, seg):
    inputs = make_inputs(rng, 1, 300, 2, 128, 128, gate, lower=-5.0, seg=seg)
    compare(rng, inputs, BF16_TOL, lower_bound=lb, dtype=jnp.bfloat16)


def test_extreme_gate_stays_finite(rng):
    """g = -1000 on random channels (a hard reset of those channels) on the exact path."""
    inputs = make_inputs(rng, 1, 150, 2, 32, 32, "channel", seg="random", g_fill=(-1000.0, 0.05))
    # float32 cumsums of -1000s round later decays of the chunk at ~1e-5 relative (FLA's kernels too).
    tol = {name: 2e-4 for name in F32_TOL}
    _, out = compare(rng, inputs, tol)
    for x in (out[0], out[1], *out[2]):
        assert np.all(np.isfinite(np.asarray(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(jnp.bfloat16, BF16_TOL), (jnp.float32, F32_TOL)])
def test_chunk_on_gpu(rng, dtype, tol):
    """On the GPU (TF32 and cuBLAS bf16 paths): a training-sized case on both paths."""
    for lb in (-5.0, None):
        inputs = make_inputs(rng, 2, 1000, 4, 128, 128, "channel", lower=-5.0, seg="random")
        compare(rng, inputs, tol, lower_bound=lb, dtype=dtype)


def test_state_continuity(rng):
    """Two halves chained through the final state equal the whole sequence (bounded path)."""
    q, k, v, g, beta, h0, seg = make_inputs(rng, 2, 150, 2, 32, 16, "channel", lower=-5.0, seg="random")
    seg[:, 75:] -= (seg[:, 75] - seg[:, 74])[:, None]  # no reset exactly at the split (invisible to the 2nd call)
    run = functools.partial(kda, output_final_state=True, impl="chunk", lower_bound=-5.0)
    o, S = run(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    a, b = slice(0, 75), slice(75, None)  # equal halves, one compiled program; each a chunk and a partial one
    o1, S1 = run(q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], initial_state=h0, segment_ids=seg[:, a])
    o2, S2 = run(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], initial_state=S1, segment_ids=seg[:, b])
    assert_close("o", o, jnp.concatenate([o1, o2], axis=1), 1e-5)
    assert_close("S", S, S2, 1e-5)


@pytest.mark.parametrize("lb", [None, -5.0])
def test_check_grads_float64(lb):
    """Numerical vs analytic gradients of the custom VJP on tiny float64 shapes with resets."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        q, k, v, g, beta, h0, _ = make_inputs(rng, 1, 70, 1, 4, 3, "channel", lower=-2.0)
        seg = np.cumsum(np.isin(np.arange(70), [3, 40, 41]), dtype=np.int32)[None]
        f64 = lambda x: jnp.asarray(x, jnp.float64)

        def f(q, k, v, g, beta, h0):
            o, S = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True,
                       lower_bound=lb, impl="chunk")
            return jnp.concatenate([o.ravel(), S.ravel()])

        args = [f64(x) for x in (q, k, v, np.clip(g, -2.0, -0.01), beta, h0)]
        check_grads(f, args, order=1, modes=("rev",), eps=1e-5, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("lb, g_fill, seg", [(-5.0, None, "edge"), (None, None, "random"), (None, (-1000.0, 0.05), "random")])
def test_tiled_scores_match_dense(rng, lb, g_fill, seg):
    """scores="tiled" (lower tile pairs, hand-written VJP) against scores="dense" in float32:
    outputs, final state and every gradient, bounded and exact paths, g = -1000, resets."""
    from kernels.kda.chunk import run_chunked

    q, k, v, g, beta, h0, segment_ids = make_inputs(rng, 2, 150, 2, 32, 16, "channel", lower=-5.0, seg=seg,
                                                    g_fill=g_fill)
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dS = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def run(scores):
        def f(*a):
            return run_chunked(*a, scale=0.3, initial_state=h0, segment_ids=segment_ids, bounded=lb is not None,
                               delta=True, scores=scores)

        (o, S), vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v, g, beta)))
        return (o, S, *vjp((do, dS)))

    for name, a, b in zip(("o", "S", "dq", "dk", "dv", "dg", "dbeta"), run("dense"), run("tiled")):
        assert np.all(np.isfinite(np.asarray(b))), name
        assert_close(name, a, b, 1e-5)


def relative_errors(inputs, **settings):
    """Relative RMS errors of impl="chunk" (bf16, lower_bound=-5) against naive: o, S and every
    gradient, traced under the KDA module `settings` (`chunk.settings`); `compare` asserts the
    bf16 tolerances too."""
    from kernels.kda import chunk

    with chunk.settings(**settings):
        ref, out = compare(np.random.default_rng(1), inputs, BF16_TOL, lower_bound=-5.0, dtype=jnp.bfloat16)
    rel = lambda r, x: float(np.sqrt(np.mean((np.asarray(r, np.float64) - np.asarray(x, np.float64)) ** 2)) /
                             np.sqrt(np.mean(np.asarray(r, np.float64) ** 2)))
    return [rel(r, x) for r, x in zip((ref[0], ref[1], *ref[2]), (out[0], out[1], *out[2])) if r is not None]


def assert_as_accurate(base, got):
    """Every error in `got` at most 10% (plus 2e-4) above its counterpart in `base`."""
    for b, g in zip(base, got):
        assert g <= 1.1 * b + 2e-4, (base, got)


def test_stacked_row_products_keep_the_bf16_accuracy(rng):
    """DIAG_STACK / OFFDIAG_STACK "stacked" on the bounded bf16 path: every output and gradient as
    close to the reference as with the rows' products separate (the stacked column-side gradient
    sums the same bf16 products in another order)."""
    inputs = make_inputs(rng, 1, 256, 2, 64, 64, "channel", lower=-5.0, seg="random")
    assert_as_accurate(relative_errors(inputs, diag_stack="separate", offdiag_stack="separate"),
                       relative_errors(inputs, diag_stack="stacked", offdiag_stack="stacked"))


@pytest.mark.parametrize("scores", ["dense", "tiled"])
def test_split_diagonal_tiles_keep_float32_accuracy(rng, scores):
    """chunk_intra.DIAG_MODE="split" (bounded diagonal tiles by three bf16 products, forward and
    backward): every output and gradient as close to the reference as the float32 tiles (plain
    bf16 operands would roughly 8x dg's error)."""
    inputs = make_inputs(rng, 1, 256, 2, 64, 64, "channel", lower=-5.0, seg="random")
    assert_as_accurate(relative_errors(inputs, scores=scores, diag="f32"),
                       relative_errors(inputs, scores=scores, diag="split"))


def test_unknown_diag_mode_is_an_error(monkeypatch):
    from kernels.kda import chunk_intra

    monkeypatch.setattr(chunk_intra, "DIAG_MODE", "bf16")
    with pytest.raises(ValueError, match="DIAG_MODE"):
        chunk_intra.diag_split(jnp.bfloat16, jnp.float32)


def test_diag_mode_is_part_of_the_jit_cache_key(monkeypatch):
    """A program traced under one DIAG_MODE is not reused under another (no cache clearing): the
    split mode's trace has bf16 products where the f32 mode's has HIGHEST-precision ones."""
    from kernels.kda import chunk, chunk_intra

    q = jnp.ones((1, 64, 1, 64), jnp.bfloat16)
    g = jnp.full((1, 64, 1, 64), -0.5, jnp.float32)
    beta = jnp.full((1, 64, 1), 0.5, jnp.float32)

    def trace():
        f = lambda q, g: chunk.run_chunked(q, q, q, g, beta, scale=0.125, initial_state=None, segment_ids=None,
                                           bounded=True, delta=True)[0]
        return str(jax.make_jaxpr(jax.grad(lambda q, g: f(q, g).astype(jnp.float32).sum(), (0, 1)))(q, g))

    texts = {}
    for mode in ("f32", "split", "f32", "bf16x3", "bf16x6"):
        monkeypatch.setattr(chunk_intra, "DIAG_MODE", mode)
        texts.setdefault(mode, []).append(trace())
    assert texts["f32"][0] == texts["f32"][1]
    assert texts["split"][0] != texts["f32"][0]
    assert texts["split"][0].count("HIGHEST") < texts["f32"][0].count("HIGHEST")
    for mode, algorithm in (("bf16x3", "BF16_BF16_F32_X3"), ("bf16x6", "BF16_BF16_F32_X6")):
        # the diagonal tiles' forward product and both of its transposes take the dot algorithm
        assert texts[mode][0].count(algorithm) >= 3, mode
        assert texts[mode][0].count("HIGHEST") < texts["f32"][0].count("HIGHEST")
    monkeypatch.setattr(chunk_intra, "DIAG_MODE", "bf16")
    with pytest.raises(ValueError, match="DIAG_MODE"):
        trace()


@pytest.mark.parametrize("name, modes, lower", [("ROW_MODE", ("stacked", "separate"), -5.0),
                                                ("ROW_MODE", ("stacked", "separate"), None),
                                                ("CUMSUM_MODE", ("matmul", "scan"), -5.0),
                                                ("CUMSUM_MODE", ("matmul_bf16x6", "scan"), -5.0),
                                                ("INVERSE_MODE", ("doubling", "substitute"), -5.0),
                                                ("DIAG_STACK", ("stacked", "separate"), -5.0),
                                                ("OFFDIAG_STACK", ("stacked", "separate"), -5.0),
                                                ("OFFDIAG_STACK", ("stacked", "separate"), None)])
def test_traced_modes_give_the_same_values(rng, monkeypatch, name, modes, lower):
    """chunk_intra.ROW_MODE "stacked" (q and k row tiles in one product) gives the values and
    gradients of "separate" (float32: the same sums), on the bounded and the exact path; so do
    CUMSUM_MODE "matmul" (the gate cumsum as a triangular matmul) against "scan", and DIAG_STACK /
    OFFDIAG_STACK "stacked" (both rows' diagonal / off-diagonal tiles in one product) against
    "separate" (float32 sums in another order), with packed documents."""
    from kernels.kda import chunk_intra

    inputs = make_inputs(rng, 1, 128, 2, 32, 32, "channel", lower=-5.0, seg="random")
    q, k, v, g, beta, h0, seg = inputs

    def run():
        def f(q, k, v, g, beta):
            o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg,
                       lower_bound=lower, impl="chunk")
            return jnp.sum(o * jnp.cos(o)) + jnp.sum(S * S)
        return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    got = {}
    for mode in modes:
        monkeypatch.setattr(chunk_intra, name, mode)
        got[mode] = jax.tree.leaves(run())
    for a, b in zip(got[modes[0]], got[modes[1]]):
        if name == "ROW_MODE":  # the same sums
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
        else:  # sums in another order (G; the diagonal blocks' inverse); each mode is within 1.5e-5 of float64 here
            assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 5e-5 * np.max(np.abs(np.asarray(b)))
    monkeypatch.setattr(chunk_intra, name, "paired")
    with pytest.raises(ValueError, match=name):
        run()


@pytest.mark.parametrize("mode", ["matmul", "matmul_bf16x6"])
@pytest.mark.parametrize("shape", [(3, 2, 16, 8), (2, 3, 2, 64, 16)])
def test_chunk_cumsum_and_its_gradient(monkeypatch, mode, shape):
    """chunk_intra.chunk_cumsum as a matmul (token-major for chunked arrays [.., H, C, K], whose
    gradient is a hand-written product with the transposed matrix) against numpy's cumsum down
    C, and its pull-back against the reverse cumsum."""
    from kernels.kda import chunk_intra

    monkeypatch.setattr(chunk_intra, "CUMSUM_MODE", mode)
    r = np.random.default_rng(3)
    g = -r.uniform(size=shape).astype(np.float32)
    ct = r.standard_normal(shape).astype(np.float32)
    G, pull = jax.vjp(chunk_intra.chunk_cumsum, jnp.asarray(g))
    (dg,) = pull(jnp.asarray(ct))
    np.testing.assert_allclose(np.asarray(G), np.cumsum(g, axis=-2), rtol=1e-5, atol=1e-5)
    reverse = np.flip(np.cumsum(np.flip(ct, axis=-2), axis=-2), axis=-2)
    np.testing.assert_allclose(np.asarray(dg), reverse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("row_mode, diag_stack, offdiag_stack", [
    ("stacked", "separate", "separate"), ("separate", "separate", "separate"), ("separate", "stacked", "separate"),
    ("separate", "separate", "stacked"), ("separate", "stacked", "stacked"), ("stacked", "stacked", "stacked")])
@pytest.mark.parametrize("C", [16, 64])
def test_decayed_scores_match_the_pairwise_sum(monkeypatch, bounded, row_mode, diag_stack, offdiag_stack, C):
    """chunk_intra.decayed_scores against A[r, c] = sum_d a_r k_c exp(G_r - G_c), r >= c, in
    float64: every entry on and below the diagonal, and the gradients of a weighted sum of them
    with respect to the rows, k and G, for one tile (C = 16) and a chunk, for each way of grouping
    the rows' products."""
    from kernels.kda import chunk_intra

    monkeypatch.setattr(chunk_intra, "ROW_MODE", row_mode)
    monkeypatch.setattr(chunk_intra, "DIAG_STACK", diag_stack)
    monkeypatch.setattr(chunk_intra, "OFFDIAG_STACK", offdiag_stack)
    r = np.random.default_rng(C)
    K = 8
    a = [r.standard_normal((2, C, K)).astype(np.float32) for _ in range(2)]
    k = r.standard_normal((2, C, K)).astype(np.float32)
    G = np.cumsum(-5.0 * r.uniform(size=(2, C, K)), axis=-2).astype(np.float32)
    mm = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    got = chunk_intra.decayed_scores([jnp.asarray(x) for x in a], jnp.asarray(k), jnp.asarray(G),
                                     bounded=bounded, mm=mm)
    lower = np.tril(np.ones((C, C), bool))
    Gd = G.astype(np.float64)
    decay = np.exp(np.where(lower[..., None], Gd[:, :, None, :] - Gd[:, None, :, :], -np.inf))
    for x, A in zip(a, got):
        want = np.einsum("brd,bcd,brcd->brc", x.astype(np.float64), k.astype(np.float64), decay)
        np.testing.assert_allclose(np.where(lower, np.asarray(A), 0), want, rtol=2e-4, atol=2e-4)
    W = [np.where(lower, r.standard_normal((2, C, C)), 0) for _ in a]

    def loss(a0, a1, k, G):
        A = chunk_intra.decayed_scores([a0, a1], k, G, bounded=bounded, mm=mm)
        return sum(jnp.sum(jnp.where(lower, w * x, 0)) for w, x in zip(W, A))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(x) for x in (*a, k, G)))
    a64, k64 = [x.astype(np.float64) for x in a], k.astype(np.float64)
    terms = [np.einsum("brc,brd,bcd,brcd->brcd", w, x, k64, decay) for w, x in zip(W, a64)]  # each pair's term
    want = [np.einsum("brc,bcd,brcd->brd", w, k64, decay) for w in W]
    want.append(sum(np.einsum("brc,brd,brcd->bcd", w, x, decay) for w, x in zip(W, a64)))
    want.append(sum(t.sum(axis=2) - t.sum(axis=1) for t in terms))  # + at r, - at c
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4 * np.max(np.abs(w)))


def test_settings_context_sets_and_restores_the_traced_module_settings():
    from kernels.kda import chunk, chunk_intra

    now = lambda: (chunk_intra.DIAG_MODE, chunk_intra.ROW_MODE, chunk.DEFAULT_SCORES, chunk_intra.CUMSUM_MODE,  # noqa: E731
                   chunk_intra.DIAG_STACK, chunk_intra.OFFDIAG_STACK)
    before = now()
    flip = {"stacked": "separate", "separate": "stacked"}
    d, o = flip[chunk_intra.DIAG_STACK], flip[chunk_intra.OFFDIAG_STACK]
    with chunk.settings(diag="split", rows="stacked", scores="tiled", cumsum="matmul", diag_stack=d, offdiag_stack=o):
        assert now() == ("split", "stacked", "tiled", "matmul", d, o)
    assert now() == before
    for bad in (dict(diag="bf16"), dict(tile=16), dict(diag_stack="paired"), dict(offdiag_stack=True),
                dict(forward_state="fused")):
        with pytest.raises(ValueError):
            with chunk.settings(**bad):
                pass
    assert now() == before


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [dict(diag="bf16x3"), dict(diag="bf16x6"), dict(cumsum="matmul_bf16x6"),
                                     dict(diag="bf16x3", diag_stack="separate", offdiag_stack="separate")])
def test_gpu_tensor_core_algorithms_keep_float32_accuracy(rng, setting):
    """On a GPU, where XLA runs the BF16_BF16_F32_X3/X6 dot algorithms on the tensor cores (CPU
    runs them as float32 products): bf16 inputs, K = V = 128, resets, every output and gradient
    within the bf16 tolerances and as close to the reference as with float32 diagonal tiles and
    cumsum (HIGHEST-precision products)."""
    inputs = make_inputs(rng, 1, 1024, 4, 128, 128, "channel", lower=-5.0, seg="random")
    assert_as_accurate(relative_errors(inputs, diag="f32", cumsum="matmul"), relative_errors(inputs, **setting))


@pytest.mark.parametrize("mode", ["substitute", "doubling"])
def test_unit_lower_inverse_matches_float64(monkeypatch, mode):
    """(I + L)^{-1} for strictly lower L [.., 64, 64] with entries like the delta rule's (|L| < 1,
    beta k . k decayed): both ways of inverting the 16x16 diagonal blocks within 1e-5 of NumPy's
    float64 inverse, relative to its largest entry."""
    from kernels.kda import chunk_intra

    monkeypatch.setattr(chunk_intra, "INVERSE_MODE", mode)
    r = np.random.default_rng(3)
    L = np.tril(r.uniform(-1, 1, (3, 64, 64)), -1) * 0.5
    got = np.asarray(chunk_intra.unit_lower_inverse(jnp.asarray(L, jnp.float32), jax.lax.Precision.HIGHEST))
    want = np.linalg.inv(np.eye(64) + L)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))

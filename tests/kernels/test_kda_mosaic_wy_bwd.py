"""The WY form's pull-back as a Mosaic GPU kernel (`kernels/kda/mosaic_wy_bwd.py`, run by the
Mosaic GPU interpreter) against its XLA reference (`chunk_wy.wy_bwd_reference`), alone and inside
KDA's gradients; shape and dtype errors; the setting's dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_wy, kda, mosaic_wy_bwd
from kernels.kda.chunk import _Numerics
from kernels.kda.chunk_intra import unit_lower_inverse
from kernels.testing import rel_rms


def _pieces(rng, lead, K, V, dtype=jnp.bfloat16):
    """dv', S_n, Ai = (I + L)^{-1} of a strictly lower L like the chunk's (float32), v, beta, kgam."""
    C = 64
    n = lambda *s: jnp.asarray(rng.standard_normal((*lead, *s)), jnp.float32)  # noqa: E731
    L = jnp.tril(n(C, C) * 0.1, -1)
    Ai = unit_lower_inverse(L, jax.lax.Precision.HIGHEST)
    beta = jax.nn.sigmoid(n(C))
    return (n(C, V).astype(dtype), (n(K, V) * 0.3).astype(dtype), Ai, n(C, V).astype(dtype), beta, n(C, K))


@pytest.mark.parametrize("K, V", [(128, 128), (64, 128), (128, 64)])
def test_kernel_matches_the_reference(rng, K, V):
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (2, 3), K, V)
    nm = _Numerics(jnp.bfloat16)
    want = chunk_wy.wy_bwd_reference(nm, dvn, S, Ai, v, beta, kgam, compact=True)
    got = mosaic_wy_bwd.wy_bwd(dvn, S, Ai, v, beta, kgam, interpret=True)
    for name, g, w in zip(("d bv", "d kgam", "d L"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.bfloat16, name
        # bf16 results (8 mantissa bits); dAi rounded once here, twice in the reference
        assert rel_rms(w, g) < 1e-2, (name, rel_rms(w, g))
    # the float64 pull-back of the same operands, as a check on both
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    Ai64, dvn64, S64 = f(Ai.astype(jnp.bfloat16)), f(dvn), f(S)
    dw = -dvn64 @ np.swapaxes(S64, -1, -2)
    bv = (beta[..., None] * v.astype(jnp.float32)).astype(jnp.bfloat16)
    dAi = dvn64 @ np.swapaxes(f(bv), -1, -2) + dw @ np.swapaxes(f(kgam.astype(jnp.bfloat16)), -1, -2)
    AiT = np.swapaxes(Ai64, -1, -2)
    for g, w in zip(got, (AiT @ dvn64, AiT @ dw, -AiT @ dAi @ AiT)):
        assert rel_rms(w, g) < 2e-2


@pytest.mark.parametrize("form, state", [("per_chunk", False), ("per_chunk", True), ("persistent", False)])
def test_intra_form_inputs_give_the_same_outputs(rng, form, state):
    """`intra_form=True` (Ai^T for Ai, k exp(G) for kgam = beta k exp(G), as the intra kernel writes
    them) gives what the standard inputs give, in each body of the kernel."""
    K, V = 64, 128
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (3,), K, V)
    k_exp = kgam.astype(jnp.bfloat16)
    kgam = beta[..., None] * k_exp.astype(jnp.float32)
    ai = Ai.astype(jnp.bfloat16)
    more = {}
    if state:
        n = lambda *s: jnp.asarray(rng.standard_normal((3, *s)), jnp.bfloat16)  # noqa: E731
        more = dict(do=n(64, V), vn=n(64, V), dhs=n(K, V))
    run = lambda ai, kg, **kw: mosaic_wy_bwd.wy_bwd(dvn, S, ai, v, beta, kg, interpret=True, form=form,  # noqa: E731
                                                     programs=2, **more, **kw)
    want = run(ai, kgam)
    got = run(jnp.swapaxes(ai, -1, -2), k_exp, intra_form=True)
    assert len(got) == len(want) == (6 if state else 3)
    for name, g, w in zip(("d bv", "d kgam", "d L", "dqg", "dkg", "d decay"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        # kgam rounded to bf16 in both (the kernel rounds beta k exp(G) as XLA's cast does)
        assert rel_rms(w, g) < 1e-6, (name, rel_rms(w, g))


@pytest.mark.parametrize("form, state, intra_form", [("per_chunk", True, True), ("per_chunk", False, False),
                                                     ("persistent", False, True)])
def test_transposed_dl_output(rng, form, state, intra_form):
    """`dl_transposed=True`: d L masked to r > c, and its transpose after the other outputs (formed
    by its own product, so equal to bf16 rounding); the other outputs unchanged."""
    K, V = 64, 64
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (3,), K, V)
    ai = Ai.astype(jnp.bfloat16)
    if intra_form:
        ai, kgam = jnp.swapaxes(ai, -1, -2), kgam.astype(jnp.bfloat16)
    more = {}
    if state:
        n = lambda *s: jnp.asarray(rng.standard_normal((3, *s)), jnp.bfloat16)  # noqa: E731
        more = dict(do=n(64, V), vn=n(64, V), dhs=n(K, V))
    run = lambda **kw: mosaic_wy_bwd.wy_bwd(dvn, S, ai, v, beta, kgam, interpret=True, form=form, programs=2,  # noqa: E731
                                             intra_form=intra_form, **more, **kw)
    want, got = run(), run(dl_transposed=True)
    assert len(got) == len(want) + 1
    r = np.arange(64)
    lower = r[:, None] > r[None, :]
    for i, (g, w) in enumerate(zip(got[:-1], want)):
        w = jnp.where(lower, w, 0) if i == 2 else w
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    dlt = got[-1]
    assert dlt.shape == got[2].shape and dlt.dtype == got[2].dtype
    assert not np.any(np.asarray(dlt, np.float32)[..., r[:, None] >= r[None, :]])  # zero on and below the diagonal
    assert rel_rms(jnp.swapaxes(got[2], -1, -2), dlt) < 1e-2


@pytest.mark.parametrize("K, V, intra_form", [(64, 64, True), (128, 64, False), (64, 128, True)])
def test_score_cotangents_output(rng, K, V, intra_form):
    """`score_cotangents=True` (state products, per-chunk form): do v'^T masked to r >= c and its
    transpose, last (the transpose from its own product, so equal to bf16 rounding of float64's);
    every other output unchanged, including with dl_transposed (v' memory reuse)."""
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (3,), K, V)
    ai = Ai.astype(jnp.bfloat16)
    if intra_form:
        ai, kgam = jnp.swapaxes(ai, -1, -2), kgam.astype(jnp.bfloat16)
    n = lambda *s: jnp.asarray(rng.standard_normal((3, *s)), jnp.bfloat16)  # noqa: E731
    do, vn = n(64, V), n(64, V)
    run = lambda **kw: mosaic_wy_bwd.wy_bwd(dvn, S, ai, v, beta, kgam, interpret=True, do=do, vn=vn,  # noqa: E731
                                             dhs=n(K, V) if not kw.pop("same", False) else dhs,
                                             intra_form=intra_form, dl_transposed=True, **kw)
    dhs = n(K, V)
    want, got = run(same=True), run(same=True, score_cotangents=True)
    assert len(got) == len(want) + 2
    for name, g, w in zip(("d bv", "d kgam", "d L", "dqg", "dkg", "d decay", "d L^T"), got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name)
    da, dat = got[-2:]
    assert da.shape == dat.shape == (3, 64, 64) and da.dtype == dat.dtype == jnp.bfloat16
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    r = np.arange(64)
    full = f(do) @ np.swapaxes(f(vn), -1, -2)
    assert rel_rms(np.where(r[:, None] >= r[None, :], full, 0), da) < 5e-3
    assert not np.any(np.asarray(da, np.float32)[..., r[:, None] < r[None, :]])
    assert not np.any(np.asarray(dat, np.float32)[..., r[:, None] > r[None, :]])
    assert rel_rms(np.swapaxes(f(da), -1, -2), dat) < 5e-3
    with pytest.raises(ValueError, match="score_cotangents"):
        mosaic_wy_bwd.wy_bwd(dvn, S, ai, v, beta, kgam, interpret=True, score_cotangents=True)


@pytest.mark.parametrize("form, state, K, V", [("per_chunk", True, 64, 128), ("per_chunk", False, 128, 64),
                                               ("persistent", False, 64, 64)])
def test_token_values(rng, form, state, K, V):
    """`token_values=True`: v (and do) read as [B, N C, H, V], dv = beta d bv written there and beta's term
    sum_v d bv v last, both against float64 from the same operands; the other outputs as with
    chunk-major v (dAi's bv^T product is scaled by beta after it, so equal to bf16 rounding)."""
    N, B, H = 2, 2, 3
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (N, B, H), K, V)
    ai = Ai.astype(jnp.bfloat16)
    more = {}
    if state:
        n = lambda *s: jnp.asarray(rng.standard_normal((N, B, H, *s)), jnp.bfloat16)  # noqa: E731
        more = dict(do=n(64, V), vn=n(64, V), dhs=n(K, V), score_cotangents=True)
    run = lambda v, **kw: mosaic_wy_bwd.wy_bwd(dvn, S, ai, v, beta, kgam, interpret=True, form=form,  # noqa: E731
                                                programs=5, dl_transposed=True, **{**more, **kw})
    # [N, B, H, C, V] -> [B, N C, H, V]
    tok = lambda x: jnp.moveaxis(x, 0, 1).transpose(0, 1, 3, 2, 4).reshape(B, N * 64, H, V)  # noqa: E731
    v_tok = tok(v)
    want = run(v)
    got = run(v_tok, token_values=True, **(dict(do=tok(more["do"])) if state else {}))
    assert len(got) == len(want) + 1
    dv, db = got[0], got[-1]
    assert dv.shape == v_tok.shape and dv.dtype == jnp.bfloat16
    assert db.shape == (N, B, H, 64) and db.dtype == jnp.float32
    for i, (g, w) in enumerate(zip(got[1:-1], want[1:])):
        assert rel_rms(w, g) < 1e-2, (i, rel_rms(w, g))
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    AiT = np.swapaxes(f(ai), -1, -2)
    d_bv = AiT @ f(dvn)  # [N, B, H, C, V]
    want_dv = (f(beta)[..., None] * d_bv).transpose(1, 0, 3, 2, 4).reshape(B, N * 64, H, V)
    assert rel_rms(want_dv, dv) < 1e-2
    assert rel_rms(np.sum(d_bv * f(v), axis=-1), db) < 1e-5
    with pytest.raises(ValueError, match="token_values"):
        run(v, token_values=True)
    if state:  # do in the chunk layout beside token-major v
        with pytest.raises(ValueError, match="do has shape"):
            run(v_tok, token_values=True)


@pytest.mark.parametrize("wy_state", chunk_wy.WY_STATES)
def test_kda_gradients_with_the_kernel(rng, wy_state):
    """KDA's gradients (bf16, bounded gate, packed documents) with the kernel's pull-back (and,
    wy_state "kernel", its state products) equal the XLA ops' to bf16 rounding."""
    B, T, H, K = 1, 128, 2, 64
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
    k = rng.standard_normal((B, T, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
    g = jnp.asarray(-5 * jax.nn.sigmoid(rng.standard_normal((B, T, H, K))), jnp.float32)
    beta = jnp.asarray(jax.nn.sigmoid(rng.standard_normal((B, T, H))), jnp.float32)
    seg = jnp.asarray(np.cumsum(np.isin(np.arange(T), [50, 90]))[None], jnp.int32)

    def grads():
        def f(q, k, v, g, beta):
            o, S = kda(q, k, v, g, beta, segment_ids=seg, lower_bound=-5.0, impl="chunk", output_final_state=True)
            return jnp.sum(o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32))) + jnp.sum(S * S)
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    with chunk.settings(wy_bwd="xla"):
        want = grads()
    with chunk.settings(wy_bwd="interpret", wy_state=wy_state):
        got = grads()
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert rel_rms(b, a) < 1e-2, (name, rel_rms(b, a))
    assert rel_rms(want[1], got[1]) > 0, "the kernel's path was not taken"


def test_errors_and_fallback(rng, caplog):
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (2,), 96, 128)
    with pytest.raises(ValueError, match="K=96"):
        mosaic_wy_bwd.wy_bwd(dvn, S, Ai, v, beta, kgam, interpret=True)
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (2,), 64, 64)
    with pytest.raises(ValueError, match="kgam has shape"):
        mosaic_wy_bwd.wy_bwd(dvn, S, Ai, v, beta, kgam[..., :32, :], interpret=True)
    with pytest.raises(ValueError, match="float32"):
        mosaic_wy_bwd.wy_bwd(dvn.astype(jnp.float32), S, Ai, v, beta, kgam, interpret=True)
    # float32 inputs have no compute-dtype cotangents: the XLA ops run, and say so once
    nm = _Numerics(jnp.float32)
    with chunk.settings(wy_bwd="interpret"), caplog.at_level("WARNING"):
        out = chunk_wy.pull_back(nm, dvn.astype(jnp.float32), S.astype(jnp.float32), Ai, v, beta, kgam, compact=False)
    ref = chunk_wy.wy_bwd_reference(nm, dvn.astype(jnp.float32), S.astype(jnp.float32), Ai, v, beta, kgam,
                                     compact=False)
    assert list(out) == ["bv", "kgam", "L"]
    for a, b in zip(out.values(), ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "runs the XLA ops" in caplog.text
    with pytest.raises(ValueError, match="wy_bwd"):
        with chunk.settings(wy_bwd="fast"):
            pass
    # the compiled kernel on a CPU backend: refused, naming the interpreter instead
    if jax.default_backend() == "cpu":
        with chunk.settings(wy_bwd="mosaic"), pytest.raises(ValueError, match="'interpret'"):
            chunk_wy.pull_back(_Numerics(jnp.bfloat16), dvn, S, Ai, v, beta, kgam, compact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("form", chunk_wy.WY_FORMS)
def test_gpu_kernel_matches_the_reference(rng, form):
    """Compiled, over 1000 chunk-heads at K = V = 128, each persistent program walking several (a
    race between the in-place result staging, the slots' refills and the products or copies still
    reading them would show here)."""
    dvn, S, Ai, v, beta, kgam = _pieces(rng, (10, 100), 128, 128)
    want = chunk_wy.wy_bwd_reference(_Numerics(jnp.bfloat16), dvn, S, Ai, v, beta, kgam, compact=True)
    got = mosaic_wy_bwd.wy_bwd(dvn, S, Ai, v, beta, kgam, form=form)
    for name, g, w in zip(("d bv", "d kgam", "d L"), got, want):
        assert rel_rms(w, g) < 1e-2, (name, rel_rms(w, g))
    if form == "per_chunk":  # with the state products: the same three, and those
        n = lambda *s: jnp.asarray(rng.standard_normal((10, 100, *s)), jnp.bfloat16)  # noqa: E731
        do, vn, dhs = n(64, 128), n(64, 128), n(128, 128)
        more = mosaic_wy_bwd.wy_bwd(dvn, S, Ai, v, beta, kgam, do=do, vn=vn, dhs=dhs)
        for a, b in zip(more[:3], got):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        T = lambda x: jnp.swapaxes(x, -1, -2).astype(jnp.float32)  # noqa: E731
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        for g, w in zip(more[3:], (f32(do) @ T(S), f32(vn) @ T(dhs), jnp.sum(f32(S) * f32(dhs), -1))):
            assert rel_rms(w, g) < 4e-3


def test_auto_follows_the_backward_state_pass():
    """"auto" (the default) runs the kernel only where the backward's serial passes are compiled
    Mosaic GPU kernels; the XLA ops elsewhere (impl="chunk", the interpreter's passes)."""
    assert chunk_wy.WY_BWD == "auto"
    with chunk.settings(wy_bwd="auto"):
        assert chunk_wy.wy_bwd_mode("mosaic") == "mosaic"
        for state_pass in ("xla", "mosaic_interpret", None):
            assert chunk_wy.wy_bwd_mode(state_pass) == "xla", state_pass
    with chunk.settings(wy_bwd="interpret"):
        assert chunk_wy.wy_bwd_mode("xla") == "interpret"
    with chunk.settings(wy_bwd="xla"):
        assert chunk_wy.wy_bwd_mode("mosaic") == "xla"


@pytest.mark.parametrize("lead, programs", [((7,), 2), ((2, 3), 4), ((3,), 3)])
def test_persistent_form_matches_the_per_chunk_form(rng, lead, programs):
    """Programs walking several chunks through two slots (chunk counts that do not divide evenly,
    an odd count per program, one chunk each) give the per-chunk form's values exactly."""
    args = _pieces(rng, lead, 64, 128)
    want = mosaic_wy_bwd.wy_bwd(*args, interpret=True, form="per_chunk")
    got = mosaic_wy_bwd.wy_bwd(*args, interpret=True, form="persistent", programs=programs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="form="):
        mosaic_wy_bwd.wy_bwd(*args, interpret=True, form="ring")
    with pytest.raises(ValueError, match="programs=0"):
        mosaic_wy_bwd.wy_bwd(*args, interpret=True, form="persistent", programs=0)


def test_state_products_match_numpy(rng):
    """With do, v' and dhs the kernel also forms dqg = do S^T, dkg = v' dhs^T (bf16) and
    d decay = sum_v S dhs (float32) against float64 NumPy, and its WY results stay bit-equal to the
    plain kernel's."""
    for K, V in ((128, 128), (64, 128), (128, 64)):
        args = _pieces(rng, (3,), K, V)
        n = lambda *s: jnp.asarray(rng.standard_normal((3, *s)), jnp.bfloat16)  # noqa: E731
        do, vn, dhs = n(64, V), n(64, V), n(K, V)
        got = mosaic_wy_bwd.wy_bwd(*args, interpret=True, do=do, vn=vn, dhs=dhs)
        plain = mosaic_wy_bwd.wy_bwd(*args, interpret=True)
        for a, b in zip(got[:3], plain):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        f = lambda x: np.asarray(x, np.float64)  # noqa: E731
        S = f(args[1])
        want = (f(do) @ np.swapaxes(S, -1, -2), f(vn) @ np.swapaxes(f(dhs), -1, -2), np.sum(S * f(dhs), -1))
        for name, g, w, dtype, tol in zip(("dqg", "dkg", "d decay"), got[3:], want,
                                          (jnp.bfloat16, jnp.bfloat16, jnp.float32), (4e-3, 4e-3, 1e-6)):
            assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
            assert rel_rms(w, g) < tol, (name, K, V, rel_rms(w, g))
    with pytest.raises(ValueError, match="together"):
        mosaic_wy_bwd.wy_bwd(*args, interpret=True, do=do)
    with pytest.raises(ValueError, match="together"):
        mosaic_wy_bwd.wy_bwd(*args, interpret=True, form="persistent", do=do, vn=vn, dhs=dhs)
    with pytest.raises(ValueError, match="dhs has shape"):
        mosaic_wy_bwd.wy_bwd(*args, interpret=True, do=do, vn=vn, dhs=dhs[..., :32, :])
    with chunk.settings(wy_state="kernel", wy_form="persistent"), pytest.raises(ValueError, match="per_chunk"):
        chunk.traced_key()

"""impl="pallas_gpu" against the naive reference: Mosaic GPU interpreter on CPU, compiled on GPU.

Tolerances (relative RMS, flash-linear-attention's): o and final state 0.005; dq, dk, dv 0.008;
dg, dbeta 0.02; dh0 0.008 at bf16; 1e-4 on everything at float32 (interpreter only).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import kda, kda_step
from kernels.kda import pallas_gpu
from kernels.testing import assert_close

BF16_TOL = dict(o=0.005, S=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dh0=0.008)
F32_TOL = {n: 1e-4 for n in BF16_TOL}
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(rng, B, T, H, K, V, gate, dtype, n_docs=0, g_floor=None):
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V))
    if gate == "channel":
        g = -5.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))
    elif gate == "head":
        g = np.log(rng.uniform(0.9, 1.0, (B, T, H)))
    else:
        g = None
    if g is not None and g_floor is not None:
        g = np.where(rng.uniform(size=g.shape) < 0.02, g_floor, g)  # hard decays, e.g. -1000
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    h0 = rng.standard_normal((B, H, K, V)) * 0.1
    seg = None
    if n_docs:
        cuts = np.sort(rng.choice(np.arange(1, T), n_docs - 1, replace=False))
        seg = np.broadcast_to(np.searchsorted(cuts, np.arange(T), side="right"), (B, T)).astype(np.int32)
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    return cast(q), cast(k), cast(v), f32(g), f32(beta), f32(h0), seg


def _value_and_grads(impl, q, k, v, g, beta, h0, seg, cot, lower_bound=None):
    do, dS = cot

    def loss(q, k, v, g, beta, h0):
        o, S = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True, impl=impl,
                   lower_bound=lower_bound)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS), (o, S)

    argnums = (0, 1, 2, 4, 5) if g is None else (0, 1, 2, 3, 4, 5)
    (_, (o, S)), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, g, beta, h0)
    names = ("dq", "dk", "dv", "dbeta", "dh0") if g is None else GRAD_NAMES
    return o, S, dict(zip(names, grads))


def _check_parity(rng, B, T, H, K, V, gate, dtype, tol, n_docs=0, grads=True, g_floor=None, lower_bound=None):
    q, k, v, g, beta, h0, seg = _inputs(rng, B, T, H, K, V, gate, dtype, n_docs, g_floor)
    if not grads:  # one jitted program each (op by op, the interpreter's pieces compile one by one)
        run = lambda impl, lb: jax.jit(lambda q, k, v, g, beta, h0: kda(  # noqa: E731
            q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True, impl=impl,
            lower_bound=lb))(q, k, v, g, beta, h0)
        o_ref, S_ref = run("naive", None)
        o, S = run("pallas_gpu", lower_bound)
        assert_close("o", o_ref, o, tol["o"])
        assert_close("S", S_ref, S, tol["S"])
        return
    cot = (jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32), jnp.asarray(rng.standard_normal(h0.shape), jnp.float32))
    o_ref, S_ref, g_ref = _value_and_grads("naive", q, k, v, g, beta, h0, seg, cot)
    o, S, g_out = _value_and_grads("pallas_gpu", q, k, v, g, beta, h0, seg, cot, lower_bound)
    assert o.dtype == v.dtype and S.dtype == jnp.float32
    assert_close("o", o_ref, o, tol["o"])
    assert_close("S", S_ref, S, tol["S"])
    for name in g_ref:
        assert_close(name, g_ref[name], g_out[name], tol[name])


@pytest.mark.parametrize(
    "gate, dtype, T, n_docs, grads",
    [("channel", jnp.bfloat16, 100, 3, True), ("head", jnp.float32, 45, 0, True), ("none", jnp.bfloat16, 64, 0, False)],
)
def test_interpret_parity(rng, gate, dtype, T, n_docs, grads):
    tol = BF16_TOL if dtype == jnp.bfloat16 else F32_TOL
    _check_parity(rng, 1, T, 1, 64, 64, gate, dtype, tol, n_docs=n_docs, grads=grads)


@pytest.mark.parametrize("intra", ["chunk", "xla"])
def test_interpret_hard_decays_and_k128(rng, monkeypatch, intra):
    """Unbounded gates (g = -1000 in places) stay exact; K = V = 128; odd T; float32 exact path;
    both XLA intra-chunk stages (chunk.py's pieces, this module's `prepare`)."""
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", intra)
    _check_parity(rng, 1, 53, 1, 128, 128, "channel", jnp.float32, F32_TOL, n_docs=2, grads=False, g_floor=-1000.0)


def test_interpret_bounded_intra_kernel(rng, monkeypatch):
    """intra="mosaic", lower_bound=-5, no resets: the Mosaic GPU intra-chunk kernel runs (odd T, K != V)."""
    from kernels.kda import mosaic_intra

    calls = []
    kernel = mosaic_intra.intra_bounded
    monkeypatch.setattr(mosaic_intra, "intra_bounded", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", "mosaic")
    _check_parity(rng, 1, 100, 1, 128, 64, "channel", jnp.bfloat16, BF16_TOL, grads=False, lower_bound=-5.0)
    assert calls == [1]
    with pytest.raises(ValueError, match="Unknown intra"):
        pallas_gpu.resolve_intra("cuda", -5.0, None, jnp.bfloat16)
    seg = jnp.zeros((1, 100), jnp.int32)
    for args, want in (((-5.0, None, jnp.bfloat16), "mosaic"), ((-5.0, None, jnp.float16), "chunk"),
                       ((-5.0, seg, jnp.bfloat16), "chunk"), ((None, None, jnp.bfloat16), "chunk"),
                       ((-6.0, None, jnp.bfloat16), "chunk")):
        assert pallas_gpu.resolve_intra("mosaic", *args) == want, args


def test_fallback_logs_and_matches(rng, caplog):
    q, k, v, g, beta, h0, _ = _inputs(rng, 1, 20, 2, 32, 16, "channel", jnp.float32)
    with caplog.at_level("WARNING"):
        pallas_gpu._warned.clear()
        o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl="pallas_gpu")
    assert "falls back" in caplog.text and "K=32" in caplog.text
    o_ref, S_ref = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl="naive")
    assert_close("o", o_ref, o, 1e-4)
    assert_close("S", S_ref, S, 1e-4)


def test_decode_kernel_matches_naive_step(rng, monkeypatch):
    from kernels.kda import mosaic_decode

    calls = []
    kernel = mosaic_decode.decode_step_pipelined
    monkeypatch.setattr(mosaic_decode, "decode_step_pipelined", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    B, H, K, V = 2, 3, 64, 128
    state = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    q, k = (jnp.asarray(rng.standard_normal((B, H, K)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, H, V)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 2, (B, H, K)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, H)), jnp.float32)
    o_ref, S_ref = kda_step(state, q, k, v, g, beta, impl="naive")
    o, S = kda_step(state, q, k, v, g, beta, impl="pallas_gpu")
    assert calls == [1] and o.dtype == v.dtype
    assert_close("o", o_ref.astype(jnp.float32), o.astype(jnp.float32), 0.005)
    assert_close("S", S_ref, S, 1e-5)
    with pytest.raises(ValueError, match="Unknown step impl"):
        kda_step(state, q, k, v, g, beta, impl="cuda")


def test_sharded_over_batch_and_heads(rng, monkeypatch):
    """Under a (data, tensor) mesh the per-shard function runs through shard_map.

    The Mosaic GPU interpreter keeps one global simulated memory and cannot run on 8 fake CPU
    devices at once, so here each shard runs the float32 plain-JAX chunked path that the
    kernel path is checked against above; what is tested is the sharding wiring.
    """
    from kernels.kda.pallas_gpu_prep import chunked_reference
    from tests.kernels.mesh import kda_on_mesh

    calls = []

    def per_shard(q, k, v, g, beta, h0, seg, *, scale, intra, interpret):
        calls.append(q.shape)
        return chunked_reference(q, k, v, g, beta, scale=scale, initial_state=h0, segment_ids=seg)

    monkeypatch.setattr(pallas_gpu, "run", per_shard)

    q, k, v, g, beta, h0, seg = _inputs(rng, 2, 40, 4, 64, 64, "channel", jnp.float32, n_docs=2)
    (o, S), (o_ref, S_ref) = kda_on_mesh("pallas_gpu", q, k, v, g, beta, h0, seg)
    assert calls == [(1, 40, 2, 64)]  # one shard: batch / 2, heads / 2
    assert_close("o", o_ref, o, 1e-4)
    assert_close("S", S_ref, S, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n_docs, intra", [(0, "mosaic_bf16"), (0, "chunk"), (8, "chunk"), (0, "mosaic"), (0, "xla"),
                                           (8, "xla")])
def test_gpu_parity_large(rng, monkeypatch, n_docs, intra):
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", intra)
    _check_parity(rng, 2, 4096, 16, 128, 128, "channel", jnp.bfloat16, BF16_TOL, n_docs=n_docs, lower_bound=-5.0)


@pytest.mark.gpu
def test_gpu_million_tokens_match_chained_halves(rng):
    T, H, D = 1 << 20, 2, 128
    q, k, v, g, beta, _, _ = _inputs(rng, 1, T, H, D, D, "channel", jnp.bfloat16)
    run = jax.jit(lambda q, k, v, g, b, h0: kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                 lower_bound=-5.0, impl="pallas_gpu"))
    h0 = jnp.zeros((1, H, D, D), jnp.float32)
    o, S = run(q, k, v, g, beta, h0)
    half = T // 2
    s1 = lambda x: x[:, :half]
    s2 = lambda x: x[:, half:]
    o1, S1 = run(s1(q), s1(k), s1(v), s1(g), s1(beta), h0)
    o2, S2 = run(s2(q), s2(k), s2(v), s2(g), s2(beta), S1)
    assert_close("o", jnp.concatenate([o1, o2], axis=1).astype(jnp.float32), o.astype(jnp.float32), 1e-3)
    assert_close("S", S2, S, 1e-3)


def test_kernels_lower_for_cuda():
    """The state and decode kernels lower through Mosaic GPU for CUDA (layouts, TMA, wgmma) on a
    CPU machine; the intra kernel's lowering takes ~25 s and is left to the GPU tests."""
    from kernels.kda import mosaic_decode, mosaic_state

    BH, NT, C, K, V = 2, 3, 64, 128, 64
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    state = jax.jit(lambda *a: mosaic_state.state_output(*a, out_dtype=jnp.bfloat16))
    args = (bf(BH, NT, C, K), bf(BH, NT, C, K), bf(BH, NT, C, K), bf(BH, NT, C, V), bf(BH, NT, C, C),
            f32(BH, NT, K), f32(BH, K, V))
    assert "mosaic_gpu" in state.trace(*args).lower(lowering_platforms=("cuda",)).as_text()[:4000]
    no_h0 = jax.jit(lambda *a: mosaic_state.state_output(*a, None, out_dtype=jnp.bfloat16))  # zeros in registers
    assert "mosaic_gpu" in no_h0.trace(*args[:6]).lower(lowering_platforms=("cuda",)).as_text()[:4000]
    for kernel in (mosaic_decode.decode_step, functools.partial(mosaic_decode.decode_step_pipelined, programs=132),
                   functools.partial(mosaic_decode.decode_step_pipelined, programs=132, slots=2, block_v=32)):
        for vt in (f32, bf):  # bf16 v in, bf16 o out: the kda_step path
            o_dtype = jnp.float32 if vt is f32 else jnp.bfloat16
            lowered = jax.jit(functools.partial(kernel, o_dtype=o_dtype)).trace(
                f32(BH, K, V), f32(BH, 4, K), vt(BH, V)).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()[:4000]


def test_pipelined_decode_matches_one_tile_per_program(rng):
    """The persistent decode kernel (several tiles per program, a ring of slots) against the
    one-tile-per-program kernel: 5 tiles over 3 programs (2, 2 and 1 tiles through 3 slots) and
    8 tiles over 2 programs (4 each, so every slot is refilled)."""
    from kernels.kda import mosaic_decode

    for BH, K, V, programs in ((5, 128, 64, 3), (4, 64, 128, 2)):
        state = jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32)
        vecs = jnp.asarray(rng.standard_normal((BH, 4, K)) * 0.3, jnp.float32)
        v = jnp.asarray(rng.standard_normal((BH, V)), jnp.float32)
        o_ref, S_ref = mosaic_decode.decode_step(state, vecs, v, interpret=True)
        o, S = mosaic_decode.decode_step_pipelined(state, vecs, v, programs=programs, slots=3, interpret=True)
        assert_close("o", o_ref, o, 1e-6)
        assert_close("S", S_ref, S, 1e-6)


@pytest.mark.parametrize("block_v, programs, slots", [(32, 3, 2), (128, 2, 2)])
def test_pipelined_decode_block_widths(rng, block_v, programs, slots):
    """Tiles of 32 and 128 state columns (128: a head's whole [K, V] state, one contiguous copy)
    give the one-tile-per-program kernel's o and state."""
    from kernels.kda import mosaic_decode

    BH, K, V = 3, 64, 128
    state = jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32)
    vecs = jnp.asarray(rng.standard_normal((BH, 4, K)) * 0.3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((BH, V)), jnp.float32)
    o_ref, S_ref = mosaic_decode.decode_step(state, vecs, v, interpret=True)
    o, S = mosaic_decode.decode_step_pipelined(state, vecs, v, programs=programs, slots=slots, block_v=block_v,
                                               interpret=True)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("S", S_ref, S, 1e-6)


@pytest.mark.parametrize("kernel", ["decode_step", "decode_step_pipelined"])
def test_decode_kernels_take_bf16_v_and_write_bf16_o(rng, kernel):
    """v in bf16 is converted in the kernel and o written in bf16: the float32 kernel's o, rounded
    once, and the same state."""
    from kernels.kda import mosaic_decode

    BH, K, V = 3, 64, 128
    state = jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32)
    vecs = jnp.asarray(rng.standard_normal((BH, 4, K)) * 0.3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((BH, V)), jnp.bfloat16)
    fn = getattr(mosaic_decode, kernel)
    kw = dict(programs=2, slots=2) if kernel.endswith("pipelined") else {}
    o_ref, S_ref = fn(state, vecs, v.astype(jnp.float32), interpret=True, **kw)
    o, S = fn(state, vecs, v, o_dtype=jnp.bfloat16, interpret=True, **kw)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)), np.asarray(o_ref.astype(jnp.bfloat16).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S_ref))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fn(state, vecs, v.astype(jnp.float16), interpret=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("programs, slots, block_v", [(132, 4, 64), (264, 3, 64), (132, 3, 128), (396, 3, 32)])
def test_gpu_pipelined_decode_settings(rng, programs, slots, block_v):
    """Every setting `benchmarks/kda.py --decode_blocks` is meant to sweep, at the benchmark's
    B * H = 2048 heads of K = V = 128, equals the one-tile-per-program kernel."""
    from kernels.kda import mosaic_decode

    BH, K, V = 2048, 128, 128
    state = jnp.asarray(rng.standard_normal((BH, K, V)) * 0.1, jnp.float32)
    vecs = jnp.asarray(rng.standard_normal((BH, 4, K)) * 0.1, jnp.float32)
    v = jnp.asarray(rng.standard_normal((BH, V)), jnp.float32)
    o_ref, S_ref = jax.jit(mosaic_decode.decode_step)(state, vecs, v)
    o, S = jax.jit(functools.partial(mosaic_decode.decode_step_pipelined, programs=programs, slots=slots,
                                     block_v=block_v))(state, vecs, v)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("S", S_ref, S, 1e-6)


def test_pipelined_decode_rejects_bad_blocks():
    from kernels.kda import mosaic_decode

    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    call = lambda **kw: jax.eval_shape(lambda *a: mosaic_decode.decode_step_pipelined(*a, **kw),
                                       f32(2, 128, 128), f32(2, 4, 128), f32(2, 128))
    with pytest.raises(ValueError, match="block_v in"):
        call(block_v=48)
    with pytest.raises(ValueError, match="KiB of SMEM"):
        call(block_v=128, slots=4)  # 4 x 64 KiB tiles
    with pytest.raises(ValueError, match="slots >= 2"):
        call(slots=1)

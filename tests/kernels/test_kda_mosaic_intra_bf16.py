"""The lean bounded-gate intra-chunk kernel (`mosaic_intra_bf16`): parity under the Mosaic GPU
interpreter against the exact XLA stage and, end to end, against impl="naive"; CUDA lowering
on a CPU machine (layouts, wgmma shapes, the SMEM budget of two programs per SM)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import mosaic_intra_bf16, pallas_gpu, pallas_gpu_prep
from kernels.kda.pallas_gpu_bench import inputs
from kernels.testing import assert_close
from tests.jaxprs import equations

BF16_TOL = dict(o=0.005, S=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dh0=0.008)
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(rng, B, T, H, K, V):
    return inputs(B, T, H, K, V=V, rng=rng)


def _float64_inverse(k, g, beta, C):
    """k, g [B, T, H, K], beta [B, T, H] -> chunk-major [NT, BH, C, *] float64 k, G (the chunk-local
    cumsum of g), L = strict_lower(beta (k e^G)(k e^-G)^T) and Ai = (I + L)^{-1}."""
    B, T, H, _ = k.shape
    NT = T // C
    chunked = lambda x: np.asarray(x, np.float64).reshape(B, NT, C, H, -1).transpose(1, 0, 3, 2, 4).reshape(NT, B * H, C, -1)  # noqa: E731
    kc, G, bc = chunked(k), np.cumsum(chunked(g), axis=2), chunked(beta)[..., 0]
    L = np.tril(np.einsum("...rk,...ck->...rc", kc * np.exp(G), kc * np.exp(-G)), -1) * bc[..., None]
    return kc, G, L, np.linalg.inv(np.eye(C) + L)


@pytest.mark.parametrize("K, V", [(128, 64), (64, 128)])
def test_operands_match_exact_stage(rng, K, V):
    """Every output against the float32 XLA stage, to bf16 rounding (K != V, both column-half
    counts, two heads; the kernel writes Aqk transposed)."""
    B, T, H, C = 1, 128, 2, 64
    q, k, v, g, beta = _inputs(rng, B, T, H, K, V)
    bt = jnp.moveaxis(beta, 1, 2)
    outs = mosaic_intra_bf16.intra_bf16(q, k, v, g, bt, scale=K**-0.5, interpret=True)
    p = pallas_gpu_prep.prepare(q, k, v, g, beta, scale=K**-0.5, segment_ids=None)
    flat = lambda x: x.reshape(B * H, T // C, *x.shape[3:])
    aT = jnp.swapaxes(flat(p["a"]), -1, -2)
    refs = dict(qg=flat(p["qg"]), wn=-flat(p["w"]), kg=flat(p["kg"]), u=flat(p["u"]), aT=aT)
    assert len(outs) == len(refs) + 1
    for (name, ref), out in zip(refs.items(), outs):
        assert out.dtype == jnp.bfloat16 and out.shape == ref.shape
        assert_close(name, ref, out.astype(jnp.float32), 0.005)
    assert_close("d", flat(p["d"]), outs[-1], 1e-5)  # the chunk decays exp(G_last)


@pytest.mark.parametrize("K, V", [(128, 64)])
def test_training_pieces_match_float32(rng, K, V):
    """`pieces=True`: the same operands chunk-major and w itself, plus Ai^T = (I + L)^{-T} and
    k exp(G) against float32 (Ai from a float64 inverse of the exact L)."""
    B, T, H, C = 1, 128, 2, 64
    NT = T // C
    q, k, v, g, beta = _inputs(rng, B, T, H, K, V)
    outs = mosaic_intra_bf16.intra_bf16(q, k, v, g, jnp.moveaxis(beta, 1, 2), scale=K**-0.5, interpret=True,
                                        pieces=True)
    p = pallas_gpu_prep.prepare(q, k, v, g, beta, scale=K**-0.5, segment_ids=None)
    major = lambda x: jnp.swapaxes(x.reshape(B * H, NT, *x.shape[3:]), 0, 1)  # noqa: E731 - [NT, BH, ...]
    refs = dict(qg=major(p["qg"]), w=major(p["w"]), kg=major(p["kg"]), u=major(p["u"]),
                aT=jnp.swapaxes(major(p["a"]), -1, -2))
    assert len(outs) == len(refs) + 3
    for (name, ref), out in zip(refs.items(), outs):
        assert out.dtype == jnp.bfloat16 and out.shape == ref.shape
        assert_close(name, ref, out.astype(jnp.float32), 0.005)
    assert_close("d", major(p["d"]), outs[5], 1e-5)
    kc, G, _, Ai = _float64_inverse(k, g, beta, C)
    ai_t, k_exp = outs[6:]
    assert ai_t.dtype == k_exp.dtype == jnp.bfloat16 and ai_t.shape == (NT, B * H, C, C)
    assert_close("Ai^T", jnp.asarray(np.swapaxes(Ai, -1, -2), jnp.float32), ai_t.astype(jnp.float32), 0.005)
    assert_close("k exp(G)", jnp.asarray(kc * np.exp(G), jnp.float32), k_exp.astype(jnp.float32), 0.005)


def test_inverse_stays_accurate_on_correlated_keys(rng):
    """Near-identical keys, beta ~ 1 and gates ~ 0 make L ~ beta times a strictly lower all-ones
    matrix, whose inverse is small while its powers grow like binomials (C(62, 31) ~ 5e17 in a
    64-row chunk). The kernel's inverse (Neumann products on 16-row blocks, then a nilpotent
    correction of degree 4) keeps Ai^T within bf16 operand error there; squaring the whole L
    instead passes the random-key tests above and is off by 1e11 here."""
    B, T, H, K, C = 1, 128, 2, 64, 64
    base = rng.standard_normal(K)
    k = base + 0.03 * rng.standard_normal((B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q, v = rng.standard_normal((2, B, T, H, K))
    g = -1e-3 * rng.random((B, T, H, K))
    beta = np.full((B, H, T), 0.99)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    g, beta = jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)
    outs = mosaic_intra_bf16.intra_bf16(q, k, v, g, beta, scale=K**-0.5, interpret=True, pieces=True)
    _, _, L, Ai = _float64_inverse(k, g, jnp.moveaxis(beta, 1, 2), C)
    assert np.abs(L[..., 1:, :1]).min() > 0.9  # the near-singular case this test is for
    assert_close("Ai^T", jnp.asarray(np.swapaxes(Ai, -1, -2), jnp.float32), outs[6].astype(jnp.float32), 0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [False, True])
def test_gpu_outputs_match_exact_stage_and_repeat(rng, pieces):
    """At 8,4096,16,128 on the GPU (8192 programs, two per SM): every output against the exact XLA
    stage, and two calls bitwise equal. A register-operand wgmma hazard once corrupted a few
    percent of the chunks at random here while smaller grids passed."""
    B, T, H, K = 8, 4096, 16, 128
    C, NT = 64, T // 64
    q, k, v, g, beta = _inputs(rng, B, T, H, K, K)
    bt = jnp.moveaxis(beta, 1, 2)
    run = jax.jit(lambda *a: mosaic_intra_bf16.intra_bf16(*a, scale=K**-0.5, pieces=pieces))
    outs, again = run(q, k, v, g, bt), run(q, k, v, g, bt)
    for i, (a, b) in enumerate(zip(outs, again)):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True), f"output {i} differs between calls"
    p = pallas_gpu_prep.prepare(q, k, v, g, beta, scale=K**-0.5, segment_ids=None)
    flat = lambda x: x.reshape(B * H, NT, *x.shape[3:])  # noqa: E731 - [BH, NT, ...]
    lay = (lambda x: jnp.swapaxes(flat(x), 0, 1)) if pieces else flat  # noqa: E731
    refs = dict(qg=lay(p["qg"]), w=lay(p["w"]) * (1 if pieces else -1), kg=lay(p["kg"]), u=lay(p["u"]),
                aT=jnp.swapaxes(lay(p["a"]), -1, -2))
    for (name, ref), out in zip(refs.items(), outs):
        assert_close(name, ref, out.astype(jnp.float32), 0.005)
    assert_close("d", lay(p["d"]), outs[5], 1e-5)
    assert outs[5].shape[:2] == ((NT, B * H) if pieces else (B * H, NT)) and outs[0].shape[2] == C


def test_rejects_unsupported_sizes():
    bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
    with pytest.raises(ValueError, match="K, V in"):
        mosaic_intra_bf16.intra_bf16(bf(1, 64, 1, 96), bf(1, 64, 1, 96), bf(1, 64, 1, 64),
                                     jnp.zeros((1, 64, 1, 96)), jnp.zeros((1, 1, 64)), scale=1.0, interpret=True)


def test_end_to_end_parity(rng, monkeypatch):
    """impl="pallas_gpu" with intra="mosaic_bf16": odd T, an initial state; o, S and every
    gradient vs naive (the backward runs chunk's bounded path from the kernel's chunk states)."""
    from kernels.kda import kda

    calls = []
    kernel = mosaic_intra_bf16.intra_bf16
    monkeypatch.setattr(mosaic_intra_bf16, "intra_bf16", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", "mosaic_bf16")
    q, k, v, g, beta = _inputs(rng, 1, 150, 1, 64, 64)
    h0 = jnp.asarray(rng.standard_normal((1, 1, 64, 64)) * 0.1, jnp.float32)
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dS = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def run(impl):
        def loss(q, k, v, g, beta, h0):
            o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, lower_bound=-5.0, impl=impl)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS), (o, S)

        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(q, k, v, g, beta, h0)

    (_, (o_ref, S_ref)), g_ref = run("naive")
    (_, (o, S)), g_out = run("pallas_gpu")
    assert calls == [1]
    assert_close("o", o_ref.astype(jnp.float32), o.astype(jnp.float32), BF16_TOL["o"])
    assert_close("S", S_ref, S, BF16_TOL["S"])
    for name, a, b in zip(GRAD_NAMES, g_ref, g_out):
        assert b.dtype == a.dtype
        assert_close(name, a, b, BF16_TOL[name])


@pytest.mark.parametrize("K, V", [(128, 128), (64, 128)])
def test_lowers_for_cuda_within_two_programs_per_sm(monkeypatch, K, V):
    """Lowering for CUDA on CPU catches layout / wgmma / TMA errors; SMEM must leave room for two
    programs per H200 SM (228 KiB, 1 KiB reserved per program)."""
    import jax.experimental.mosaic.gpu.core as mgpu_core

    sizes = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda t: sizes.append(size(t)) or sizes[-1])
    B, T, H = 2, 256, 2
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    f = jax.jit(lambda *a: mosaic_intra_bf16.intra_bf16(*a, scale=K**-0.5))
    args = (bf(B, T, H, K), bf(B, T, H, K), bf(B, T, H, V), f32(B, T, H, K), f32(B, H, T))
    assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()[:4000]
    assert sizes and max(sizes) <= 113 * 1024


def test_program_per_chunk_kernels_run_past_65535_chunks():
    """The kernels with a program per (chunk, head) launch them on CUDA's x axis alone (y and z
    stop at 65535): 65,537 chunks (4,194,368 tokens) lower for CUDA as one grid axis of that many
    programs, and `grid_indices` undoes the flattening in the launch order of the 2-D grid."""
    from kernels.kda import mosaic_state

    T, K = 65537 * 64, 64
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    f = jax.jit(lambda *a: mosaic_intra_bf16.intra_bf16(*a, scale=K**-0.5))
    text = f.trace(bf(1, T, 1, K), bf(1, T, 1, K), bf(1, T, 1, K), f32(1, T, 1, K), f32(1, 1, T)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert mosaic_state.flat_grid((65537, 2)) == dict(grid=(131074,), grid_names=("t",))
    with pytest.raises(ValueError, match="exceed"):
        mosaic_state.flat_grid((2**16, 2**16))
    with pytest.raises(ValueError, match="y axis"):  # the chunk-walking kernels keep batch * head on y
        mosaic_state.launch_bh_v(lambda *r: None, None, [], (), BH=65536, V=128, BV=64, interpret=True)
    # the flattened index, last axis fastest, read back per axis (as the kernels do) in the interpreter
    sizes = (3, 2, 5)

    def body(o_ref):
        n, bh, kx = mosaic_state.grid_indices(sizes)
        t = jax.lax.axis_index("t")
        o_ref[t] = (n * 100 + bh * 10 + kx).astype(jnp.int32)

    from jax.experimental.pallas import mosaic_gpu as plgpu
    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((30,), jnp.int32), **mosaic_state.flat_grid(sizes),
                       interpret=plgpu.InterpretGPUParams())()
    want = [n * 100 + b * 10 + x for n in range(3) for b in range(2) for x in range(5)]
    assert list(map(int, out)) == want


@pytest.mark.parametrize("block_v", [64, 32, 16])
def test_state_kernel_with_states_lowers_for_cuda(block_v):
    """The state kernel's per-chunk state output (the backward's residual), its o written
    straight into [B, T, H, V] and chunk-major operands lower for CUDA, at every V block width."""
    from kernels.kda import mosaic_state

    BH, NT, C, K, V = 2, 3, 64, 128, 128
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    for chunk_major in (False, True):
        f = jax.jit(lambda *a, cm=chunk_major: mosaic_state.state_output(
            *a, out_dtype=jnp.bfloat16, with_states=True, heads=2, chunk_major=cm, block_v=block_v))
        lead = (NT, BH) if chunk_major else (BH, NT)
        args = (bf(*lead, C, K), bf(*lead, C, K), bf(*lead, C, K), bf(*lead, C, V), bf(*lead, C, C),
                f32(*lead, K), f32(BH, K, V))
        assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()[:4000]


@pytest.mark.parametrize("intra", ["mosaic_bf16", "chunk"])
def test_whole_forward_backward_lowers_for_cuda(monkeypatch, intra):
    """jit(grad) of impl="pallas_gpu" (XLA glue, both kernels, the custom VJP that feeds the chunk
    states to chunk's backward) lowers for CUDA as one program, as on a Hopper GPU."""
    from kernels.kda import kda

    monkeypatch.setattr(pallas_gpu, "_device_kind", lambda: "hopper")
    monkeypatch.setattr(pallas_gpu, "DEFAULT_INTRA", intra)
    B, T, H, D = 2, 256, 2, 128
    bf = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    beta = jax.ShapeDtypeStruct((B, T, H), jnp.float32)

    def loss(q, k, v, g, beta):
        return jnp.sum(kda(q, k, v, g, beta, lower_bound=-5.0, impl="pallas_gpu")[0].astype(jnp.float32))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    text = f.trace(bf, bf, bf, g, beta).lower(lowering_platforms=("cuda",)).as_text()
    kernels = len(re.findall(r"custom_call @mosaic_gpu", text))
    assert kernels >= (2 if intra == "mosaic_bf16" else 1)  # (the intra kernel and) the state kernel


def test_kernel_marks_its_profiler_phases_in_order():
    """The phases and sub-phases that `benchmarks/mosaic_phases.py` reports are named scopes of
    the kernel body, in program order."""
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    g = jnp.zeros((1, 64, 1, 64), jnp.float32)
    fn = lambda *a: mosaic_intra_bf16.intra_bf16(*a, scale=1.0, interpret=True)  # noqa: E731
    seen = []
    for e in equations(jax.make_jaxpr(fn)(q, q, q, g, jnp.zeros((1, 1, 64), jnp.float32)).jaxpr):
        name = str(e.source_info.name_stack).split("/")[-1]
        if name and name not in seen:
            seen.append(name)
    want = ["load", "cumsum", "row_side", "row_side_out", "scores", "scores_operand", "scores_issue",
            "scores_drain", "scores_out", "inverse", "wy", "store"]
    assert [s for s in seen if s in want] == want


@pytest.mark.parametrize("block_v", [32, 16])
def test_state_kernel_narrow_v_blocks_equal_64(rng, block_v):
    """V / block_v programs per (batch * head) give the 64-column kernel's o, final state and
    per-chunk states (interpreted; bf16 operands, float32 accumulation)."""
    from kernels.kda import mosaic_state

    BH, NT, C, K, V = 2, 3, 64, 64, 64
    bf = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    args = (bf(BH, NT, C, K), bf(BH, NT, C, K), bf(BH, NT, C, K), bf(BH, NT, C, V), bf(BH, NT, C, C),
            jnp.asarray(rng.uniform(0.5, 1.0, (BH, NT, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32))
    run = lambda bv: mosaic_state.state_output(*args, out_dtype=jnp.float32, with_states=True,  # noqa: E731
                                               interpret=True, block_v=bv)
    for name, want, got in zip(("o", "S", "states"), run(64), run(block_v)):
        assert_close(name, want.astype(jnp.float32), got.astype(jnp.float32), 1e-6)
    with pytest.raises(ValueError, match="block_v=48"):
        run(48)

"""impl="chunk_mosaic" (the chunked KDA with its two serial passes in Mosaic GPU kernels) against
the XLA passes and the naive impl: the Mosaic GPU interpreter on CPU, compiled on a GPU; plus
the CUDA lowering of the whole forward+backward, exported from the CPU.

Tolerances are those of test_kda_chunk.py (float32 1e-5; bf16 flash-linear-attention's).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, chunk_mosaic, chunk_segments, mosaic_scan
from kernels.kda.chunk import _Numerics, _grad_scan, _state_scan
from kernels.testing import assert_close
from tests.kernels.test_kda_chunk import BF16_TOL, F32_TOL, GRADS, _fwd_bwd, _traced, make_inputs


def _compare(rng, inputs, tol, lower_bound, dtype, impls=("naive", "chunk_mosaic")):
    """Outputs, final state and all six gradients of impls[1] (in `dtype`) against impls[0]."""
    q, k, v, g, beta, h0, seg = inputs
    cast = lambda x: jnp.asarray(x, dtype)
    up = lambda x: jnp.asarray(cast(x), jnp.float32) if impls[0] == "naive" else cast(x)
    do = rng.standard_normal(q.shape[:3] + (v.shape[-1],)).astype(np.float32)
    dS = rng.standard_normal(h0.shape).astype(np.float32)
    common = dict(lower_bound=lower_bound, has_seg=seg is not None, traced=_traced())
    seg_j = jnp.zeros(q.shape[:2], jnp.int32) if seg is None else jnp.asarray(seg)
    ref = _fwd_bwd(up(q), up(k), up(v), g, beta, h0, seg_j, do, dS, impl=impls[0], **common)
    out = _fwd_bwd(cast(q), cast(k), cast(v), g, beta, h0, seg_j, do, dS, impl=impls[1], **common)
    assert out[0].dtype == dtype and out[1].dtype == jnp.float32
    assert_close("o", ref[0], out[0], tol["o"])
    assert_close("S", ref[1], out[1], tol["S"])
    for name, r, x in zip(GRADS, ref[2], out[2]):
        assert_close(name, r, x, tol[name])


@pytest.mark.parametrize("delta, N, block_v, grad_issue", [
    (True, 3, 64, "in_order"), (False, 3, 64, "in_order"), (True, 1, 64, "in_order"), (True, 3, 32, "in_order"),
    (False, 2, 16, "in_order"), (True, 2, "auto", "in_order"), (True, 3, 64, "early"), (False, 2, 32, "early")])
def test_kernels_match_xla_passes(rng, delta, N, block_v, grad_issue, monkeypatch):
    """Both kernels against chunk.py's lax.scan passes on random chunk tensors [N, B, H, ...]; at
    block_v 32 / 16 each (batch * head) runs V / block_v programs side by side ("auto": 16 for
    these two heads of 64 columns); grad_issue "early" issues the reverse pass's qg^T do first."""
    launched, launch = [], mosaic_scan.launch_bh_v

    def spy(body, *a, **kw):
        launched.append((kw["BV"], body.keywords.get("early")))
        return launch(body, *a, **kw)

    monkeypatch.setattr(mosaic_scan, "launch_bh_v", spy)
    with chunk.settings(block_v=block_v, grad_issue=grad_issue):
        _kernels_match_xla_passes(rng, delta, N)
    bv = 16 if block_v == "auto" else block_v
    assert launched == [(bv, None), (bv, grad_issue == "early")]


def test_auto_block_v_covers_the_sms(monkeypatch):
    """block_v="auto": the widest block whose programs cover every SM (132 here), else 16."""
    monkeypatch.setattr(chunk_segments, "_num_sms", lambda: 132)
    # (batch * head * V / 64 programs at 64 columns) -> columns. At V = 128: 8x4096x16 heads 256,
    # 4x8192x32 512, 2x16384x16 64 (128 at 32 columns: short of 132), 1x65536x16 32.
    for programs64, want in ((256, 64), (512, 64), (132, 64), (66, 32), (64, 16), (32, 16), (1, 16)):
        assert chunk_segments.auto_block_v(programs64) == want, programs64
        assert chunk_segments.block_v("auto", programs64=programs64) == want
    with pytest.raises(ValueError, match="program count"):
        chunk_segments.block_v("auto")
    with pytest.raises(ValueError, match="block_v=48"):
        chunk_segments.block_v(48)


def _kernels_match_xla_passes(rng, delta, N):
    B, H, K, V = 1, 2, 128, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
    w = f(N, B, H, 64, K) if delta else None
    u, kg, qg, do, dvi = f(N, B, H, 64, V), f(N, B, H, 64, K), f(N, B, H, 64, K), f(N, B, H, 64, V), f(N, B, H, 64, V)
    decay = jnp.asarray(rng.uniform(0.3, 1.0, (N, B, H, K)), jnp.float32)
    decay = decay.at[N // 2, :, 0].set(0.0)  # a reset chunk
    h0, dS = f(B, H, K, V), f(B, H, K, V)
    nm = _Numerics(jnp.float32)
    want = _state_scan(nm, h0, w, u, kg, decay)
    got = mosaic_scan.state_scan_chunks(h0, w, u, kg, decay, cd=jnp.float32, interpret=True)
    for name, r, x in zip(("states", "vn", "S"), want, got):
        assert_close(name, r, x, 1e-6)
    dS_out = nm.mm("nbhck,nbhcv->nbhkv", qg, do)
    want = _grad_scan(nm, dS, w, kg, decay, dS_out, dvi)
    got = mosaic_scan.grad_scan_chunks(dS, w, kg, qg, do, dvi, decay, cd=jnp.float32, interpret=True)
    for name, r, x in zip(("dhs", "dvn", "dh0"), want, got):
        assert_close(name, r, x, 1e-6)


@pytest.mark.parametrize(
    "B, T, H, K, V, gate, seg, lb",
    [
        (1, 130, 2, 64, 128, "channel", "edge", -5.0),  # odd T, mid-chunk and chunk-edge resets
        (2, 65, 1, 128, 64, "head", None, None),  # exact path, one token into the second chunk
    ],
)
def test_chunk_mosaic_matches_naive_float32(rng, B, T, H, K, V, gate, seg, lb):
    inputs = make_inputs(rng, B, T, H, K, V, gate, lower=-5.0 if lb else -1.0, seg=seg)
    _compare(rng, inputs, F32_TOL, lb, jnp.float32)


@pytest.mark.parametrize("block_v", [64, 32, "auto"])
def test_chunk_mosaic_bfloat16(rng, block_v):
    inputs = make_inputs(rng, 1, 200, 2, 128, 128, "channel", lower=-5.0, seg="random")
    with chunk.settings(block_v=block_v):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)


@pytest.mark.parametrize("block_v, grad_issue, segments", [(64, "in_order", 1), (16, "early", 1), (64, "in_order", 2)])
def test_reverse_pass_forming_aqk_do(rng, block_v, grad_issue, segments, monkeypatch):
    """grad_intra="kernel": the reverse pass forms Aqk^T do from Aqk (at 16 columns the [C, C]
    operand takes the narrow swizzle; with two segments Aqk rides with the pass's chunked inputs)
    and every gradient stays within the bf16 tolerances of naive; the pass was launched with Aqk."""
    launched, launch = [], mosaic_scan.launch_bh_v

    def spy(body, *a, **kw):
        launched.append(body.keywords.get("aqk_in"))
        return launch(body, *a, **kw)

    monkeypatch.setattr(mosaic_scan, "launch_bh_v", spy)
    jax.clear_caches()  # "kernel" is the default: an earlier test's compiled call would skip the spy
    inputs = make_inputs(rng, 1, 200, 2, 128, 128, "channel", lower=-5.0, seg="random")
    with chunk.settings(block_v=block_v, grad_issue=grad_issue, grad_intra="kernel", segments=segments):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)
    assert True in launched, launched


def test_reverse_pass_takes_aqk_transposed(rng):
    """aqk_transposed=True on Aqk^T (the intra kernel's layout) gives exactly what Aqk gives, and
    both equal the XLA pass fed with Aqk^T do."""
    N, BH, C, K, V = 3, 2, 64, 64, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    w, kg, qg, do = f(N, BH, C, K), f(N, BH, C, K), f(N, BH, C, K), f(N, BH, C, V)
    aqk = jnp.tril(f(N, BH, C, C))
    decay = jnp.asarray(rng.uniform(0.3, 1.0, (N, BH, K)), jnp.float32)
    dS = jnp.asarray(rng.standard_normal((BH, K, V)), jnp.float32)
    run = lambda a, t: mosaic_scan.grad_scan(w, kg, qg, do, None, decay, dS, interpret=True, aqk=a,  # noqa: E731
                                             aqk_transposed=t)
    want, got = run(aqk, False), run(jnp.swapaxes(aqk, -1, -2), True)
    dvi = jnp.einsum("nbrc,nbrv->nbcv", aqk, do, preferred_element_type=jnp.float32)
    ref = mosaic_scan.grad_scan(w, kg, qg, do, dvi, decay, dS, interpret=True)
    for name, a, b, r in zip(("dhs", "dvn", "dh0"), want, got, ref):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
        assert_close(name, r, b, 1e-2)


@pytest.mark.parametrize("segments", [1, 3])
def test_reverse_pass_reads_do_in_the_token_layout(rng, segments):
    """do_heads=H (do as [B, N C, H, V]) gives exactly what chunk-major do gives, in one and in
    several segments (each program's chunks located by their global index)."""
    N, B, H, C, K, V = 3, 2, 2, 64, 64, 128
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    w, kg, qg, do = f(N, B * H, C, K), f(N, B * H, C, K), f(N, B * H, C, K), f(N, B * H, C, V)
    aqk = jnp.tril(f(N, B * H, C, C))
    decay = jnp.asarray(rng.uniform(0.3, 1.0, (N, B * H, K)), jnp.float32)
    dS = jnp.asarray(rng.standard_normal((segments * B * H, K, V)), jnp.float32)
    do_tok = do.reshape(N, B, H, C, V).transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, V)
    run = lambda d, **kw: mosaic_scan.grad_scan(w, kg, qg, d, None, decay, dS, interpret=True, aqk=aqk,  # noqa: E731
                                                segments=segments, **kw)
    for name, a, b in zip(("dhs", "dvn", "dh0"), run(do), run(do_tok, do_heads=H)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    with pytest.raises(ValueError, match="do_heads"):
        run(do_tok, do_heads=2 * H)


def test_grad_scan_takes_one_intra_source(rng):
    N, BH, C, K, V = 2, 1, 64, 64, 64
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)  # noqa: E731
    args = (z(N, BH, C, K), z(N, BH, C, K), z(N, BH, C, K), z(N, BH, C, V))
    decay, dS = jnp.ones((N, BH, K), jnp.float32), jnp.zeros((BH, K, V), jnp.float32)
    with pytest.raises(ValueError, match="exactly one"):
        mosaic_scan.grad_scan(*args, z(N, BH, C, V), decay, dS, interpret=True, aqk=z(N, BH, C, C))
    with pytest.raises(ValueError, match="exactly one"):
        mosaic_scan.grad_scan(*args, None, decay, dS, interpret=True)
    with pytest.raises(ValueError, match="delta rule"):
        mosaic_scan.grad_scan(None, *args[1:], None, decay, dS, interpret=True, aqk=z(N, BH, C, C))
    with pytest.raises(ValueError, match="grad_intra"):
        with chunk.settings(grad_intra="xla"):
            pass


def test_forward_only_calls_run_the_bounded_kernel_forward(rng, monkeypatch):
    """Without a gradient, a bounded, reset-free bf16 call runs pallas_gpu's all-kernel forward
    (the intra kernel runs) and matches naive; under jax.grad chunk's forward runs instead (no
    intra kernel), and resets or an unbounded gate keep the chunk path forward too."""
    from kernels.kda import kda, mosaic_intra_bf16

    calls, kernel = [], mosaic_intra_bf16.intra_bf16
    monkeypatch.setattr(mosaic_intra_bf16, "intra_bf16", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    q, k, v, g, beta, h0, seg = make_inputs(rng, 1, 100, 1, 64, 64, "channel", lower=-5.0, seg="random")
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta))

    def run(impl, lower_bound=-5.0, segment_ids=None):
        return kda(*args, initial_state=jnp.asarray(h0), output_final_state=True, lower_bound=lower_bound,
                   segment_ids=segment_ids, impl=impl)

    o_ref, S_ref = run("naive")
    o, S = jax.jit(lambda: run("chunk_mosaic"))()
    assert calls == [1]
    assert o.dtype == o_ref.dtype and S.dtype == S_ref.dtype
    assert_close("o", o_ref.astype(jnp.float32), o.astype(jnp.float32), BF16_TOL["o"])
    assert_close("S", S_ref, S, BF16_TOL["S"])

    loss = lambda impl: lambda q: jnp.sum(kda(q, *args[1:], lower_bound=-5.0, impl=impl)[0].astype(jnp.float32))  # noqa: E731
    dq_ref, dq = jax.grad(loss("naive"))(args[0]), jax.jit(jax.grad(loss("chunk_mosaic")))(args[0])
    assert calls == [1]
    assert_close("dq", dq_ref.astype(jnp.float32), dq.astype(jnp.float32), BF16_TOL["dq"])

    # The route is picked while tracing: tracing alone shows whether the kernel would run.
    jax.eval_shape(lambda: run("chunk_mosaic", segment_ids=jnp.asarray(seg)))
    jax.eval_shape(lambda: run("chunk_mosaic", lower_bound=None))
    f16 = tuple(jnp.asarray(x, jnp.float16) for x in (q, k, v))  # e^75 factors overflow float16
    jax.eval_shape(lambda: kda(*f16, *args[3:], lower_bound=-5.0, impl="chunk_mosaic"))
    assert calls == [1]
    with chunk.settings(forward_only="chunk"):
        jax.eval_shape(lambda: run("chunk_mosaic"))
    assert calls == [1] and chunk_mosaic.FORWARD_ONLY == "pallas_gpu"
    with pytest.raises(ValueError, match="forward_only"):
        with chunk.settings(forward_only="pallas"):
            pass
    monkeypatch.setattr(chunk_mosaic, "FORWARD_ONLY", "pallas")
    with pytest.raises(ValueError, match="FORWARD_ONLY"):
        run("chunk_mosaic")


def test_linear_attention_state_passes(rng):
    """delta=False (w = 0, v' = v): the kernels' linear-attention variant against the XLA passes."""
    q, k, v, g, _, h0, seg = make_inputs(rng, 1, 100, 2, 64, 64, "channel", seg="random")

    def run(state_pass):
        def loss(q, k, v, g, h0):
            o, S = chunk.run_chunked(q, k, v, g, jnp.ones(q.shape[:3]), scale=0.125, initial_state=h0,
                                     segment_ids=jnp.asarray(seg), bounded=False, delta=False, state_pass=state_pass)
            return jnp.sum(o * v[..., ::-1]) + jnp.sum(S * h0), (o, S)

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, h0)

    want, got = run("xla"), run("mosaic_interpret")
    for name, r, x in zip(("dq", "dk", "dv", "dg", "dh0", "o", "S"), (*want[0], *want[1]), (*got[0], *got[1])):
        assert_close(name, r, x, 1e-6)


def test_falls_back_once_with_reason(rng, caplog):
    """K = 32 is not a kernel size: the XLA passes run, the reason is logged once."""
    q, k, v, g, beta, h0, _ = make_inputs(rng, 1, 70, 1, 32, 64, "channel")
    chunk_mosaic._warned.clear()
    run = lambda impl: chunk.kda_impl if impl == "chunk" else chunk_mosaic.kda_impl
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    kw = dict(scale=32**-0.5, initial_state=jnp.asarray(h0), segment_ids=None)
    with caplog.at_level(logging.WARNING, logger="kernels.kda.chunk_mosaic"):
        got = run("chunk_mosaic")(*args, **kw)
        run("chunk_mosaic")(*args, **kw)
    msgs = [r.getMessage() for r in caplog.records if "chunk_mosaic" in r.getMessage()]
    assert len(msgs) == 1 and "K=32" in msgs[0]
    want = run("chunk")(*args, **kw)
    assert_close("o", want[0], got[0], 0.0)
    assert chunk_mosaic.unsupported_reason(128, 128, jnp.float32, interpret=False) is not None
    assert chunk_mosaic.unsupported_reason(128, 64, jnp.float32, interpret=True) is None


@pytest.mark.parametrize("B, T, H, K, block_v, grad_issue, grad_intra", [
    (8, 4096, 16, 128, 64, "in_order", "input"), (1, 128, 2, 64, 64, "in_order", "input"),
    (1, 65536, 16, 128, 32, "in_order", "input"), (1, 128, 2, 128, 16, "in_order", "input"),
    (8, 4096, 16, 128, 64, "early", "input"), (1, 65536, 16, 128, 16, "early", "input"),
    (8, 4096, 16, 128, 64, "in_order", "kernel"), (1, 128, 2, 128, 16, "early", "kernel")])
def test_forward_backward_lowers_for_cuda(B, T, H, K, block_v, grad_issue, grad_intra):
    """The Mosaic GPU lowering (layouts, wgmma operands with one swizzle, SMEM budget) of both
    kernels in the bf16 forward+backward, exported for CUDA from this CPU machine."""
    module = cuda_train_module(B, T, H, K, block_v=block_v, grad_issue=grad_issue, grad_intra=grad_intra)
    assert module.count("mosaic_gpu") >= 2


def cuda_train_module(B, T, H, K, **settings) -> str:
    """The MLIR of jit(grad) of a bf16 bounded chunk_mosaic loss at [B, T, H, K], exported for CUDA
    under `chunk.settings(**settings)`."""

    def loss(q, k, v, g, beta, h0):
        o, S = chunk.run_chunked(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, segment_ids=None,
                                 bounded=True, delta=True, state_pass="mosaic")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    sd = jax.ShapeDtypeStruct
    args = [sd((B, T, H, K), jnp.bfloat16)] * 3 + [sd((B, T, H, K), jnp.float32), sd((B, T, H), jnp.float32),
                                                   sd((B, H, K, K), jnp.float32)]
    fn = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    with chunk.settings(**settings):
        return jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("block_v, extra", [(64, {}), (16, {}), (64, dict(forward_segments=2, state_buffers="single"))])
def test_forward_only_lowers_for_cuda(monkeypatch, block_v, extra):
    """A forward-only bounded bf16 chunk_mosaic call, as on a Hopper GPU, lowers for CUDA with
    pallas_gpu's intra and state kernels (the state kernel at block_v columns per program; with
    segments, the segments' pass 1 too)."""
    from kernels.kda import hopper, kda

    monkeypatch.setattr(chunk_mosaic, "_device_kind", lambda: "hopper")
    monkeypatch.setattr(hopper, "device_kind", lambda: "hopper")
    B, T, H, K = 2, 256, 2, 128
    sd = jax.ShapeDtypeStruct
    args = [sd((B, T, H, K), jnp.bfloat16)] * 3 + [sd((B, T, H, K), jnp.float32), sd((B, T, H), jnp.float32)]
    fn = jax.jit(lambda *a: kda(*a, lower_bound=-5.0, impl="chunk_mosaic")[0])
    with chunk.settings(block_v=block_v, **extra):
        module = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 2 + ("forward_segments" in extra)


@pytest.mark.gpu
def test_forward_only_on_gpu(rng):
    """The forward-only route (pallas_gpu's kernels) at a training shape against naive."""
    from kernels.kda import kda

    q, k, v, g, beta, h0, _ = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta))
    run = lambda impl: jax.jit(lambda: kda(*args, initial_state=jnp.asarray(h0), output_final_state=True,  # noqa: E731
                                           lower_bound=-5.0, impl=impl))()
    (o_ref, S_ref), (o, S) = run("naive"), run("chunk_mosaic")
    assert_close("o", o_ref.astype(jnp.float32), o.astype(jnp.float32), BF16_TOL["o"])
    assert_close("S", S_ref, S, BF16_TOL["S"])


@pytest.mark.gpu
@pytest.mark.parametrize("seg", [None, "random"])
def test_chunk_mosaic_on_gpu(rng, seg):
    """Compiled kernels at a training shape: against the XLA passes (the same roundings up to
    summation order) at half the bf16 tolerances, then against naive at the bf16 tolerances."""
    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0, seg=seg)
    _compare(rng, inputs, {n: t / 2 for n, t in BF16_TOL.items()}, -5.0, jnp.bfloat16, impls=("chunk", "chunk_mosaic"))
    _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)


def test_chunk_mosaic_runs_per_shard_under_a_mesh(rng, monkeypatch):
    """Under a (data, tensor) mesh chunk_mosaic runs once per (batch, head) shard through
    shard_map (XLA cannot partition the Mosaic custom calls: without it every device would run the
    whole batch). The interpreter cannot run on 8 fake devices at once, so each shard runs the
    XLA passes that the kernels are checked against above; what is tested is the wiring."""
    from tests.kernels.mesh import kda_on_mesh

    calls, real = [], chunk.kda_impl

    def shard_impl(q, *a, state_pass, **kw):
        calls.append((q.shape, state_pass))
        return real(q, *a, state_pass="xla", **kw)

    monkeypatch.setattr(chunk, "kda_impl", shard_impl)
    q, k, v, g, beta, h0, seg = make_inputs(rng, 2, 40, 4, 64, 64, seg="random")
    (o, S), (o_ref, S_ref) = kda_on_mesh("chunk_mosaic", q, k, v, g, beta, h0, seg)
    assert calls == [((1, 40, 2, 64), "mosaic_interpret")]  # one shard: batch / 2, heads / 2
    assert_close("o", o_ref, o, F32_TOL)
    assert_close("S", S_ref, S, F32_TOL)


def test_forward_only_route_differentiates_per_shard_under_a_mesh(rng, monkeypatch):
    """Under a mesh, the gradient of a bounded call goes through pallas_gpu's custom VJP with
    train_forward="chunk" (chunk's forward and backward) inside shard_map and matches the
    unsharded chunk gradient. The interpreter cannot run 8 devices, so the serial passes are
    the XLA ones (BACKWARD_STATE_PASS="xla"); what is tested is the wiring."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels.kda import kda, pallas_gpu
    from kimi_jax.sharding import make_mesh

    monkeypatch.setattr(pallas_gpu, "BACKWARD_STATE_PASS", "xla")
    calls, real = [], chunk._forward
    monkeypatch.setattr(chunk, "_forward", lambda q, *a, **kw: calls.append(q.shape) or real(q, *a, **kw))
    q, k, v, g, beta, _, _ = make_inputs(rng, 2, 40, 4, 64, 64, lower=-5.0)
    mesh = make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    x4 = P("data", None, "tensor", None)
    put = lambda x, s: jax.device_put(jnp.asarray(x), NamedSharding(mesh, s))  # noqa: E731

    def loss(impl):
        return lambda q, k, g: jnp.sum(kda(q, k, v, g, beta, lower_bound=-5.0, impl=impl)[0] ** 2)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss("chunk_mosaic"), argnums=(0, 1, 2)))(put(q, x4), put(k, x4), put(g, x4))
    assert calls == [(1, 1, 2, 64, 64)]  # chunk's forward on one shard's chunks: batch / 2, heads / 2
    ref = jax.grad(loss("chunk"), argnums=(0, 1, 2))(q, k, g)
    for name, a, b in zip(("dq", "dk", "dg"), ref, grads):
        assert_close(name, a, b, F32_TOL[name])


def test_scan_bench_pass_work_counts_what_each_pass_reads_and_writes():
    """The serial passes' bytes (chunk tensors read once, outputs written once) and FLOPs, at
    N=2 chunks, B=1, H=2, C=K=V=64: w, u, do bf16; kg, qg, dvi float32; decay [N, B, H, K]."""
    from kernels.kda import mosaic_scan_bench as bench
    from kernels.kda.pallas_gpu_bench import inputs

    t, h0, fns = bench.pass_fns(inputs(1, 128, 2, 64), interpret=True)
    tile = 2 * 1 * 2 * 64 * 64  # elements of one [N, B, H, C, K] (or [N, B, H, K, V]) tensor
    state = h0.size * 4
    decay = 2 * 1 * 2 * 64 * 4
    expect = {  # name: (bytes read, bytes written)
        "state_scan xla": (2 * tile * 2 + tile * 4 + decay + state, 2 * tile * 2 + state),  # states, v' bf16
        "grad_scan xla (with qg^T do)": (tile * 2 * 2 + 3 * tile * 4 + decay + state, 2 * tile * 4 + state),
        "grad_scan mosaic": (tile * 2 * 2 + 3 * tile * 4 + decay + state, tile * 4 + tile * 2 + state),  # dv' bf16
    }
    for name, (read, written) in expect.items():
        nbytes, flops = bench.pass_work(name, t, h0, jax.eval_shape(fns[name], t))
        assert nbytes == read + written, name
        assert flops == tile * 64 * (4 if name.startswith("state") else 6), name
    rates = bench.roofline(10**9, 10**12, 1.0)  # 1 GB and 1 TFLOP in 1 ms
    assert rates["gbps"] == 1000.0 and rates["tflops"] == 1000.0


@pytest.mark.gpu
@pytest.mark.parametrize("block_v, grad_issue", [(32, "in_order"), (16, "in_order"), (64, "early"), (16, "early")])
@pytest.mark.parametrize("grad_intra", ["input", "kernel"])
def test_gpu_narrow_v_blocks_match_naive(rng, block_v, grad_issue, grad_intra):
    """The compiled serial passes with V / block_v programs per (batch * head), and the reverse
    pass with qg^T do issued early, at a training shape (bf16, bounded gates, packed documents)
    against naive, at the usual tolerances."""
    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0, seg="random")
    with chunk.settings(block_v=block_v, grad_issue=grad_issue, grad_intra=grad_intra):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("levers", [dict(wy_state="kernel"),
                                    dict(wy_state="kernel", grad_intra="kernel", forward_state="output")])
def test_gpu_backward_levers_match_naive(rng, levers):
    """The WY kernel forming the state products (and with it the reverse pass forming Aqk^T do and
    the output pass keeping the chunk states), compiled at a training shape against naive."""
    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0, seg="random")
    with chunk.settings(**levers):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)


def test_scores_setting_reaches_the_bounded_route(rng, monkeypatch):
    """chunk.settings(scores="tiled") holds on chunk_mosaic's bounded bf16 route too (pallas_gpu's
    custom VJP with chunk's forward and backward), not only on impl="chunk": the tiled scores run
    in the forward and the backward, and the gradient matches the dense one."""
    from kernels.kda import chunk_scores, kda

    calls, real = [], chunk_scores.tiled_scores
    monkeypatch.setattr(chunk_scores, "tiled_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, g, beta, _, _ = make_inputs(rng, 1, 64, 1, 64, 64, "channel", lower=-5.0)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731

    def grad(scores):
        loss = lambda q: jnp.sum(kda(q, bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), lower_bound=-5.0,  # noqa: E731
                                     impl="chunk_mosaic")[0].astype(jnp.float32))
        with chunk.settings(scores=scores):
            return jax.jit(jax.grad(loss))(bf(q))

    dense = grad("dense")
    assert calls == []
    tiled = grad("tiled")
    assert len(calls) >= 2  # the forward's prep and the backward's recompute
    assert_close("dq", dense.astype(jnp.float32), tiled.astype(jnp.float32), BF16_TOL["dq"])


def test_launchers_trace_once_per_shape_and_setting(rng, monkeypatch, tmp_path):
    """The passes are jits with their settings static (`kernels.lowering`): a second call at the
    same shapes and settings reuses the first trace (a model's layers share one lowering), a
    changed setting (block_v, the profiler) traces afresh. Traced for the GPU (interpret=False;
    the interpreter's calls are not jits)."""
    from kernels import profiling

    traced, launch = [], mosaic_scan.launch_bh_v
    monkeypatch.setattr(mosaic_scan, "launch_bh_v", lambda body, *a, **kw: traced.append(kw["BV"]) or launch(body, *a, **kw))
    N, B, H, K, V = 2, 1, 2, 128, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    args = (jnp.zeros((B, H, K, V), jnp.float32), f(N, B, H, 64, K), f(N, B, H, 64, V), f(N, B, H, 64, K),
            jnp.asarray(rng.uniform(0.3, 1.0, (N, B, H, K)), jnp.float32))

    def step():  # one trace holding three layers' calls, as a train step does
        def layers(*a):
            return [mosaic_scan.state_scan_chunks(*a, cd=jnp.bfloat16, interpret=False)[2] for _ in range(3)]
        return jax.make_jaxpr(layers)(*args)

    step()  # first use registers JAX state that changes the tracing context once
    mosaic_scan._state_scan.jitted.clear_cache()
    traced.clear()
    step()
    assert traced == [64]
    with chunk.settings(block_v=32):
        step()
    assert traced == [64, 32]
    step()
    assert traced == [64, 32]
    with profiling.profiled(str(tmp_path)):
        step()
    assert traced == [64, 32, 64]

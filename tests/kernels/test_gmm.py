"""Grouped matmul: the Pallas Mosaic GPU kernels (interpreted on CPU) against `ragged_dot`,
forward and both gradients, with empty groups, ragged sizes and rows past the total."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import gmm, resolve_impl, tgmm
from kernels.gmm import pallas_gpu, reference
from kernels.testing import assert_close

BLOCKS = pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=2)

# (M, K, N, group_sizes): empty first/middle/last groups, a group spanning several M blocks,
# a 1-row group, rows past sum(group_sizes), K and N that are not block multiples.
CASES = [
    (150, 128, 64, [40, 0, 70, 1, 30]),
    (96, 80, 72, [0, 96, 0]),
    (130, 64, 128, [0, 0, 7, 64, 0, 50, 0]),
]


def _inputs(rng, m, k, n, sizes, dtype=jnp.bfloat16):
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _numpy_gmm(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_reference_matches_numpy(rng, m, k, n, sizes):
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes, jnp.float32)
    assert_close("ref", _numpy_gmm(lhs, rhs, sizes), reference.gmm(lhs, rhs, gs), 1e-5)


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_pallas_forward(rng, m, k, n, sizes):
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    out = pallas_gpu.gmm(lhs, rhs, gs, blocks=BLOCKS, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert_close("gmm", _numpy_gmm(lhs, rhs, sizes), out, 5e-3)
    out_t = pallas_gpu.gmm(lhs, jnp.swapaxes(rhs, 1, 2), gs, transpose_rhs=True, blocks=BLOCKS,
                           interpret=True)
    np.testing.assert_array_equal(np.asarray(out_t, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("m,k,n,sizes", CASES[:2])
def test_pallas_tgmm(rng, m, k, n, sizes):
    lhs, _, gs = _inputs(rng, m, k, n, sizes)
    dout = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    out = pallas_gpu.tgmm(lhs, dout, gs, blocks=BLOCKS, interpret=True)
    assert out.shape == (len(sizes), k, n)
    assert_close("tgmm", reference.tgmm(lhs.astype(jnp.float32), dout.astype(jnp.float32), gs),
                 out, 5e-3)
    empty = [g for g, s in enumerate(sizes) if s == 0]
    assert not np.any(np.asarray(out[np.asarray(empty, int)], np.float32))


@pytest.mark.parametrize("splits", [2, 5])
def test_pallas_tgmm_row_splits(rng, splits):
    """Rows of every group cut into `splits` parts (some empty, some one block) and summed."""
    m, k, n, sizes = 330, 64, 128, [0, 200, 7, 0, 100, 0]
    lhs, _, gs = _inputs(rng, m, k, n, sizes)
    dout = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    out = pallas_gpu.tgmm(lhs, dout, gs, blocks=BLOCKS, interpret=True, splits=splits)
    assert out.shape == (len(sizes), k, n) and out.dtype == jnp.bfloat16
    assert_close("tgmm_split", reference.tgmm(lhs.astype(jnp.float32),
                                              dout.astype(jnp.float32), gs), out, 5e-3)
    assert not np.any(np.asarray(out[np.asarray([0, 3, 5])], np.float32))


def test_pallas_gradients_match_ragged_dot(rng):
    m, k, n, sizes = CASES[0]
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    w = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b).astype(jnp.float32) * w)

    pallas = lambda a, b: pallas_gpu.gmm_vjp(a, b, gs, BLOCKS, True)  # noqa: E731
    ragged = lambda a, b: reference.gmm(a, b, gs)  # noqa: E731
    got = jax.jit(jax.grad(lambda a, b: loss(pallas, a, b), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(lambda a, b: loss(ragged, a, b), argnums=(0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert_close("dlhs", want[0], got[0], 1e-2)
    assert_close("drhs", want[1], got[1], 1e-2)
    assert got[0].dtype == lhs.dtype and got[1].dtype == rhs.dtype
    # rows past sum(group_sizes) get no gradient
    assert not np.any(np.asarray(got[0][sum(sizes):], np.float32))


def test_public_api_impls_agree(rng):
    m, k, n, sizes = CASES[2]
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    a = gmm(lhs, rhs, gs, impl="pallas_gpu", blocks=BLOCKS)
    b = gmm(lhs, rhs, gs, impl="ragged_dot")
    assert_close("api", np.asarray(b, np.float32), np.asarray(a, np.float32), 5e-3)
    dout = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    assert_close("api_t", np.asarray(tgmm(lhs, dout, gs, impl="ragged_dot"), np.float32),
                 np.asarray(tgmm(lhs, dout, gs, impl="pallas_gpu", blocks=BLOCKS), np.float32),
                 5e-3)
    assert resolve_impl("auto", jnp.bfloat16) == "ragged_dot"  # CPU: no Hopper


WS_BLOCKS = pallas_gpu.Blocks(bm=64, bn=128, bk=64, stages=2, band=2, wgs=2)


@pytest.mark.parametrize("m,k,n,sizes", [CASES[0], (130, 64, 200, [0, 0, 7, 64, 0, 50, 0])])
def test_warp_specialized_forward(rng, m, k, n, sizes):
    """The persistent 2-warpgroup kernel: several tiles per SM, groups across tile boundaries,
    N not a multiple of the CTA tile, empty groups and rows past the total."""
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    out = pallas_gpu.gmm(lhs, rhs, gs, blocks=WS_BLOCKS, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert_close("gmm_ws", _numpy_gmm(lhs, rhs, sizes), out, 5e-3)
    out_t = pallas_gpu.gmm(lhs, jnp.swapaxes(rhs, 1, 2), gs, transpose_rhs=True,
                           blocks=WS_BLOCKS, interpret=True)
    np.testing.assert_array_equal(np.asarray(out_t, np.float32), np.asarray(out, np.float32))


def test_chained_pipeline_across_tiles(rng):
    """Blocks.chain: one TMA pipeline over every tile and group of an SM (num_k % stages == 0;
    the interpreter checks that every barrier phase is observed)."""
    m, k, n, sizes = 330, 256, 200, [0, 0, 7, 64, 0, 150, 0]
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    blocks = pallas_gpu.Blocks(bm=64, bn=128, bk=64, stages=2, band=2, wgs=2, chain=True)
    out = pallas_gpu.gmm(lhs, rhs, gs, blocks=blocks, interpret=True)
    assert_close("gmm_chain", _numpy_gmm(lhs, rhs, sizes), out, 5e-3)


@pytest.mark.parametrize("m,k,n,sizes", [CASES[0], (130, 64, 200, [0, 0, 7, 64, 0, 50, 0])])
def test_warp_specialized_tgmm(rng, m, k, n, sizes):
    """Boundary M blocks masked per warpgroup half; empty groups give zero gradients."""
    lhs, _, gs = _inputs(rng, m, k, n, sizes)
    dout = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    out = pallas_gpu.tgmm(lhs, dout, gs, blocks=WS_BLOCKS, interpret=True)
    assert out.shape == (len(sizes), k, n)
    assert_close("tgmm_ws", reference.tgmm(lhs.astype(jnp.float32), dout.astype(jnp.float32),
                                           gs), out, 5e-3)
    empty = [g for g, s in enumerate(sizes) if s == 0]
    assert not np.any(np.asarray(out[np.asarray(empty, int)], np.float32))


def test_per_kernel_blocks_in_vjp(rng):
    """gmm_vjp with separate (forward, dlhs, drhs) tiles: warp-specialized and plain kernels."""
    m, k, n, sizes = CASES[0]
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    w = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    blocks = (WS_BLOCKS, BLOCKS, WS_BLOCKS)
    got = jax.grad(lambda a, b: jnp.sum(pallas_gpu.gmm_vjp(a, b, gs, blocks, True) * w),
                   argnums=(0, 1))(lhs, rhs)
    want = jax.grad(lambda a, b: jnp.sum(reference.gmm(a, b, gs) * w), argnums=(0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert_close("dlhs_ws", want[0], got[0], 1e-2)
    assert_close("drhs", want[1], got[1], 1e-2)


WS_CHAIN_BLOCKS = pallas_gpu.Blocks(bm=64, bn=128, bk=64, stages=2, band=2, wgs=2, chain=True)
# Per shard: empty groups, a group across M blocks, rows past the total; K = N = 2 stages of bk.
SHARD_M, SHARD_K, SHARD_N = 130, 128, 128
SHARD_SIZES = [[0, 40, 70, 1, 0], [64, 0, 0, 7, 50], [130, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def _ws_loss_in_shard_map(mesh, chain):
    """sum(gmm(lhs, rhs, sizes) * w) with every shard's rows (and group sizes) its own and rhs
    replicated, through `kernels.gmm.gmm` (pallas_gpu, custom VJP) with the warp-specialized
    kernels for the forward, dlhs and drhs, inside shard_map (varying-axes check on)."""
    from jax.sharding import PartitionSpec as P

    fwd = WS_CHAIN_BLOCKS if chain else WS_BLOCKS
    axes = tuple(mesh.axis_names)

    def shard(lhs, rhs, sizes, w):
        out = gmm(lhs, rhs, sizes[0], impl="pallas_gpu", blocks=(fwd, fwd, WS_BLOCKS))
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * w), axes)

    return jax.shard_map(shard, mesh=mesh, in_specs=(P(axes), P(), P(axes), P(axes)),
                         out_specs=P())


def _shard_inputs(rng, shards):
    sizes = jnp.asarray([SHARD_SIZES[s % len(SHARD_SIZES)] for s in range(shards)], jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(shards * SHARD_M, SHARD_K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(sizes.shape[1], SHARD_K, SHARD_N)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(shards * SHARD_M, SHARD_N)), jnp.float32)
    return lhs, rhs, sizes, w


@pytest.mark.parametrize("chain", [False, True], ids=["ws", "chain"])
def test_warp_specialized_kernels_trace_in_shard_map(rng, chain):
    """Blocks(wgs=2) (and chain=True) inside shard_map over the 8 fake devices, traced for the
    GPU, forward and backward: the persistent kernels' group loop counts from 0, not from the
    ref-read first group (whose varying mesh axes the loop's own arithmetic does not carry)."""
    from jax.sharding import Mesh

    from kernels.kda import hopper
    from tests.jaxprs import equations

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "expert"))
    args = _shard_inputs(rng, 8)
    with hopper.assume_device_kind("hopper"):
        traced = jax.make_jaxpr(jax.value_and_grad(_ws_loss_in_shard_map(mesh, chain),
                                                   argnums=(0, 1)))(*args)
    maps = [e for e in equations(traced.jaxpr) if e.primitive.name == "shard_map"]  # fwd, bwd
    kernels = [e for sm in maps for e in equations(sm.params["jaxpr"]) if e.primitive.name == "mpmd_map"]
    assert sorted(e.params["name"] for e in kernels) == ["gmm_ws", "gmm_ws", "tgmm_ws"]
    assert all(e.params["interpret"] is None for e in kernels)  # the GPU kernels, not the interpreter
    assert [a.shape for a in traced.out_avals] == [(), args[0].shape, args[1].shape]


@pytest.mark.parametrize("chain", [False, True], ids=["ws", "chain"])
def test_warp_specialized_kernels_in_shard_map_values(rng, chain):
    """The same in the interpreter on a one-device mesh (it does not run several devices' kernels
    at once): loss and gradients equal the f32 reference's."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
    lhs, rhs, sizes, w = _shard_inputs(rng, 1)
    got = jax.value_and_grad(_ws_loss_in_shard_map(mesh, chain), argnums=(0, 1))(lhs, rhs, sizes, w)
    want = jax.value_and_grad(lambda a, b: jnp.sum(reference.gmm(a, b, sizes[0]) * w), argnums=(0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    for name, a, b in zip(("loss", "dlhs", "drhs"), jax.tree.leaves(want), jax.tree.leaves(got)):
        assert_close(name, a, np.asarray(b, np.float32), 1e-2)


@pytest.mark.parametrize("num_m,num_n,band", [(5, 7, 3), (4, 8, 8), (3, 2, 8), (6, 5, 1)])
def test_banded_launch_order_covers_every_tile_once(num_m, num_n, band):
    t = jnp.arange(num_m * num_n)
    mb, nb = pallas_gpu._banded(t, num_m, num_n, min(band, num_n))
    tiles = sorted(zip(np.asarray(mb).tolist(), np.asarray(nb).tolist()))
    assert tiles == [(m, n) for m in range(num_m) for n in range(num_n)]
    # the first launches walk N within one M block, `band` columns wide
    assert np.asarray(nb[:min(band, num_n)]).tolist() == list(range(min(band, num_n)))


def test_bad_input_raises(rng):
    lhs, rhs, gs = _inputs(rng, 8, 16, 8, [4, 4])
    with pytest.raises(ValueError, match="Unknown impl"):
        gmm(lhs, rhs, gs, impl="triton")
    with pytest.raises(ValueError, match="shape mismatch"):
        gmm(lhs, rhs[:, :8], gs)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="bf16/f16"):
        pallas_gpu.gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        pallas_gpu.Blocks(bm=48)
    with pytest.raises(ValueError, match="warpgroups"):
        pallas_gpu.gmm(lhs, rhs, gs, blocks=pallas_gpu.Blocks(bn=64, wgs=2), interpret=True)


GPU_BLOCKS = [
    pallas_gpu.Blocks(),
    (pallas_gpu.Blocks(bm=128, bn=256, bk=64, stages=3, wgs=2),
     pallas_gpu.Blocks(bm=128, bn=256, bk=64, stages=3, wgs=2),
     pallas_gpu.Blocks(bm=64, bn=256, bk=128, stages=3, wgs=2)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", GPU_BLOCKS, ids=["plain", "warp_specialized"])
def test_compiled_kernels_on_gpu(rng, blocks):
    """The compiled Mosaic GPU kernels against ragged_dot, fwd and grads."""
    m, k, n, sizes = 1000, 256, 384, [300, 0, 1, 450, 0, 200]
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes)
    w = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)

    def loss(impl, a, b):
        return jnp.sum(gmm(a, b, gs, impl=impl, blocks=blocks).astype(jnp.float32) * w)

    for out, want in zip(jax.grad(lambda a, b: loss("pallas_gpu", a, b), (0, 1))(lhs, rhs),
                         jax.grad(lambda a, b: loss("ragged_dot", a, b), (0, 1))(lhs, rhs)):
        assert_close("gpu_grad", np.asarray(want, np.float32), np.asarray(out, np.float32), 1e-2)
    assert_close("gpu_fwd", np.asarray(gmm(lhs, rhs, gs, impl="ragged_dot"), np.float32),
                 np.asarray(gmm(lhs, rhs, gs, impl="pallas_gpu", blocks=blocks), np.float32),
                 5e-3)


def _load_benchmark():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "moe.py")
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_quick_mode(tmp_path):
    """`benchmarks/moe.py --quick` times every kernel and step of all impls at tiny shapes,
    checks the Pallas outputs against the first baseline and writes JSON + markdown; --profile N
    traces N calls of each Pallas step and keeps the kernel time per call by op (on CPU: the XLA
    threads' ops of the interpreted kernels), shown beside the timed ms (one run for both: each
    run compiles every step again)."""
    import json

    bench = _load_benchmark()
    rows = bench.main(["--quick", "--mxfp4", "--profile", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "moe_quick.json").read_text())
    assert data["meta"]["quick"] and len(data["rows"]) == len(rows)
    kernels = {(r["name"], r["impl"]) for r in rows if r["kind"] == "kernel"}
    assert kernels == {(k, i) for k in bench.KERNELS
                       for i in ("pallas_gpu", "ragged_dot", "padded_bmm")} | {
                           ("mxfp4_fwd_gate", "pallas_gpu")}
    steps = {(r["name"], r["impl"], r["gate_up"]) for r in rows if r["kind"] == "step"}
    assert steps == {(p, i, "separate") for p in ("ffn", "layer") for i in ("pallas_gpu", "ragged_dot", "padded_bmm")}
    for r in rows:
        assert r["ms"] > 0 and r["error"] is None
        if r["kind"] == "step":
            assert r["gflop"] == 9 * 2 * r["tokens"] * r["top_k"] * r["d"] * r["f"] / 1e9
        if r["kind"] == "kernel" and r["impl"] == "pallas_gpu":
            assert r["check"]["rel_rms"] < 1e-2
            assert r["check"]["against"] == ("ragged_dot" if r["name"] in bench.KERNELS else
                                             "pallas_gpu bf16 on dequantised weights")
    md = (tmp_path / "moe_quick.md").read_text()
    assert "| quick | step | layer | pallas_gpu |" in md
    # the profile: Pallas steps only
    for r in rows:
        if r["kind"] == "step" and r["impl"] == "pallas_gpu":
            prof = r["profile"]
            assert prof["steps"] == 2 and prof["kernel_ms_per_step"] > 0 and prof["top_ops"]
            assert abs(sum(prof["by_kind"].values()) - prof["kernel_ms_per_step"]) < 1e-2
        else:
            assert "profile" not in r, r
    assert "(kernels " in md


def test_benchmark_gate_up_rows(tmp_path, monkeypatch):
    """--gate_up runs each Pallas step once per mode, traced under that mode (the measurement is
    replaced by a stub that records moe_dispatch.GATE_UP at trace time), baselines once, and
    labels the fused rows; an unknown mode is refused. The two forms' values: test_moe_gate_up.py."""
    from kimi_jax import moe_dispatch

    bench = _load_benchmark()
    seen = []

    def fake_measure(fn, args, warmup, iters):
        seen.append((moe_dispatch.GATE_UP, moe_dispatch.PAIR_SORT))
        return dict(ms=1.0, compile_s=0.0, mem_gib=None, error=None)

    monkeypatch.setattr(bench, "measure", fake_measure)
    rows = bench.main(["--quick", "--gate_up", "separate,fused,fused_glu,fused_ffn", "--glu_blocks",
                       "64x128x64/3,64x64x64/4", "--ffn_blocks", "64x128x64/2", "--baselines", "ragged_dot",
                       "--pair_sort", "argsort,counting", "--no_kernels", "--out", str(tmp_path)])
    assert rows and all(r["kind"] == "step" for r in rows)  # --no_kernels: steps only
    steps = [(r["name"], r["impl"], r["gate_up"], r.get("pair_sort")) for r in rows if r["kind"] == "step"]
    forms = [("pallas_gpu", "separate"), ("pallas_gpu", "fused"), ("pallas_gpu", "fused_glu"),
             ("pallas_gpu", "fused_glu"), ("pallas_gpu", "fused_ffn")]
    assert steps == ([("ffn", i, m, None) for i, m in forms] + [("ffn", "ragged_dot", "separate", None)]
                     + [("layer", i, m, o) for i, m in forms for o in ("argsort", "counting")]
                     + [("layer", "ragged_dot", "separate", "auto")])
    assert seen == [(m, o or "auto") for _, _, m, o in steps]
    resolved = {r["pair_sort_resolved"] for r in rows if r["impl"] == "ragged_dot" and r["name"] == "layer"}
    assert resolved == {"counting"}  # "auto" at these sizes
    assert (moe_dispatch.GATE_UP, moe_dispatch.PAIR_SORT) == ("auto", "auto")
    assert "(gate/up fused_ffn, counting sort)" in (tmp_path / "moe_quick.md").read_text()
    glu_tiles = [r["blocks"].split(" glu ")[1] for r in rows if r.get("gate_up") == "fused_glu"]
    assert glu_tiles == ["64x128x64/3/band8", "64x64x64/4/band8"] + ["64x128x64/3/band8"] * 2 + ["64x64x64/4/band8"] * 2
    ffn_tiles = [r["blocks"].split(" ffn ")[1] for r in rows if r.get("gate_up") == "fused_ffn"]
    assert ffn_tiles == ["64x128x64/2/band8"] * 3
    assert "| quick | step | ffn | pallas_gpu (gate/up fused) |" in (tmp_path / "moe_quick.md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--gate_up", "interleaved", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--pair_sort", "radix", "--out", str(tmp_path)])


def test_padded_bmm_baseline_matches_ragged_dot(rng):
    """The benchmark's capacity-padded batched-matmul baseline computes the same gmm/tgmm."""
    m, k, n, sizes = CASES[0]
    lhs, rhs, gs = _inputs(rng, m, k, n, sizes, jnp.float32)
    dout = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    gmm_p, tgmm_p = _load_benchmark().padded_bmm(capacity=max(sizes))
    assert_close("pad", reference.gmm(lhs, rhs, gs), gmm_p(lhs, rhs, gs), 1e-5)
    assert_close("pad_t", reference.gmm(dout, rhs, gs, transpose_rhs=True),
                 gmm_p(dout, rhs, gs, True), 1e-5)
    assert_close("pad_tgmm", reference.tgmm(lhs, dout, gs), tgmm_p(lhs, dout, gs), 1e-5)


def test_kernels_lower_for_cuda():
    """Mosaic GPU lowering (layout inference, shared-memory budget) of the default-block kernels,
    exported for CUDA from this CPU machine: catches what the interpreter does not check."""
    from jax import export

    lhs = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
    dout = jax.ShapeDtypeStruct((1024, 384), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)
    ws = pallas_gpu.Blocks(bm=128, bn=256, bk=64, stages=3, wgs=2)
    for fn, args in ((pallas_gpu.gmm, (lhs, rhs, gs)),
                     (functools.partial(pallas_gpu.gmm, transpose_rhs=True), (dout, rhs, gs)),
                     (pallas_gpu.tgmm, (lhs, dout, gs)),
                     (functools.partial(pallas_gpu.tgmm, splits=4), (lhs, dout, gs)),
                     (functools.partial(pallas_gpu.gmm, blocks=ws), (lhs, rhs, gs)),
                     (functools.partial(pallas_gpu.gmm, transpose_rhs=True, blocks=ws),
                      (dout, rhs, gs)),
                     (functools.partial(pallas_gpu.tgmm, blocks=pallas_gpu.Blocks(
                         bm=64, bn=256, bk=128, stages=3, wgs=2)), (lhs, dout, gs))):
        module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu" in module


def test_benchmark_parses_fused_glu_tiles():
    """`--glu_blocks` tiles: bm x bn x bk / stages [/ band]; anything else is refused."""
    bench = _load_benchmark()
    assert bench.parse_tiles("64x128x64/3,64x64x128/4/band2") == (
        pallas_gpu.Blocks(64, 128, 64, 3), pallas_gpu.Blocks(64, 64, 128, 4, band=2))
    assert bench.parse_tiles("") == ()
    for bad in ("64x128/3", "64x128x64", "64x128x64/3/ws"):
        with pytest.raises(ValueError, match="BMxBNxBK"):
            bench.parse_tiles(bad)
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--glu_blocks", "big"])


def test_equal_calls_share_one_trace_and_lowering(rng):
    """Every MoE layer calls the launchers at the same shapes and settings: each is a jit with its
    settings static, so the calls of a step share one kernel jaxpr (and one Mosaic GPU lowering);
    other shapes or tiles trace their own. Traced for the GPU (interpret=False: the interpreter's
    calls are not jits)."""
    from kernels.gmm import pallas_gpu_glu

    lhs, rhs, sizes = _inputs(rng, *CASES[0])
    act = ("swiglu", 4.0, 25.0)
    glu_blocks = pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=2)

    def step(lhs, rhs, sizes):
        outs = [pallas_gpu.gmm(lhs, rhs, sizes, blocks=BLOCKS) for _ in range(3)]
        outs.append(pallas_gpu.gmm(lhs, rhs, sizes, blocks=pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=3)))
        outs += [pallas_gpu.tgmm(lhs, o, sizes, blocks=BLOCKS) for o in outs[:2]]
        outs += [pallas_gpu_glu.glu_gmm(lhs, rhs, rhs, sizes, act=act, blocks=glu_blocks) for _ in range(2)]
        return outs

    eqns = [e for e in jax.make_jaxpr(step)(lhs, rhs, sizes).eqns if e.primitive.name in ("pjit", "jit")]
    names = [e.params["name"] for e in eqns]
    assert names == ["gmm"] * 4 + ["tgmm"] * 2 + ["glu_gmm"] * 2
    jaxprs = [id(e.params["jaxpr"]) for e in eqns]
    assert jaxprs[0] == jaxprs[1] == jaxprs[2] != jaxprs[3]  # other tiles: another trace
    assert jaxprs[4] == jaxprs[5] and jaxprs[6] == jaxprs[7]

"""Expert parallelism on 8 fake CPU devices: outputs and gradients equal the single-device
dense reference for several meshes; the capacity policy drops exactly the pairs it should."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kimi_jax import moe_ep
from kimi_jax.ffn import glu_activation
from kimi_jax.moe_dispatch import ExpertWeights, dense_dispatch
from kernels.testing import assert_close
from tests.jaxprs import equations

N, D, F, E, K = 32, 16, 16, 8, 2
ACT = glu_activation("swiglu")


def _problem(rng):
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    scores = rng.normal(size=(N, E))
    idx = jnp.asarray(np.argsort(-scores, axis=1)[:, :K], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(N, K)), jnp.float32)
    ex = ExpertWeights(*(jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
                         for s in ((E, D, F), (E, D, F), (E, F, D))))
    return x, idx, w, ex


def _mesh(shape: dict):
    n = int(np.prod(list(shape.values())))
    return Mesh(np.array(jax.devices()[:n]).reshape(tuple(shape.values())), tuple(shape))


def _loss(fn, x, w, ex, idx):
    y = fn(x, idx, w, ex, ACT)
    return jnp.sum(jnp.sin(y)), y


def _grads(fn, x, w, ex, idx):
    return jax.jit(jax.value_and_grad(lambda *a: _loss(fn, *a, idx), argnums=(0, 1, 2),
                                      has_aux=True))(x, w, ex)


@pytest.mark.parametrize("shape", [
    {"expert": 8},
    {"data": 2, "expert": 4},
    {"data": 2, "fsdp": 2, "expert": 2},
    {"data": 2, "expert": 2, "tensor": 2},
    {"data": 4, "tensor": 2},
])
def test_matches_single_device_reference(rng, shape):
    x, idx, w, ex = _problem(rng)
    (_, want_y), want_g = _grads(dense_dispatch, x, w, ex, idx)
    with jax.set_mesh(_mesh(shape)):
        (_, y), g = _grads(moe_ep.expert_parallel_dispatch, x, w, ex, idx)
    assert_close("y", want_y, y, 1e-5)
    for name, a, b in zip(("dx", "dw", "dgate", "dup", "ddown"),
                          jax.tree.leaves(want_g), jax.tree.leaves(g)):
        assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize("mode", ["fused_glu", "fused_ffn"])
def test_fused_glu_expert_parallel_with_tensor_axis(rng, mode):
    """GATE_UP="fused_glu" / "fused_ffn" inside shard_map: each shard runs the fused FFN
    (kernels.gmm.glu_ffn; its reference on the CPU) on its experts and its slice of the hidden
    width, SiTU-GLU."""
    from kimi_jax.moe_dispatch import gate_up

    act = glu_activation("situ")
    x, idx, w, ex = _problem(rng)
    fn = lambda x, w, ex: jnp.sum(jnp.sin(dense_dispatch(x, idx, w, ex, act)))  # noqa: E731
    want_y, want_g = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(x, w, ex)
    with jax.set_mesh(_mesh({"data": 2, "expert": 2, "tensor": 2})), gate_up(mode):
        fn = lambda x, w, ex: jnp.sum(jnp.sin(moe_ep.expert_parallel_dispatch(x, idx, w, ex, act)))  # noqa: E731
        y, g = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(x, w, ex)
    assert_close("loss", want_y, y, 1e-5)
    for name, a, b in zip(("dx", "dw", "dgate", "dup", "ddown"), jax.tree.leaves(want_g), jax.tree.leaves(g)):
        assert_close(name, a, b, 1e-5)


def _expected_drops(idx, shards, cap, chunks):
    """NumPy model of the policy: per source chunk, pairs ranked per destination shard in
    (expert, token, slot) order; rank >= cap is dropped. -> keep mask [N, K]."""
    idx = np.asarray(idx)
    keep = np.ones(idx.shape, bool)
    per = N // chunks
    for c in range(chunks):
        flat = idx[c * per:(c + 1) * per].reshape(-1)
        seen = np.zeros(shards, int)
        for p in np.argsort(flat, kind="stable"):
            dest = flat[p] // (E // shards)
            if seen[dest] >= cap:
                keep[c * per + p // K, p % K] = False
            seen[dest] += 1
    return keep


@pytest.mark.parametrize("shape", [{"expert": 8}, {"data": 2, "expert": 4}])
def test_capacity_drops_are_reported_and_exact(rng, shape):
    x, idx, w, ex = _problem(rng)
    idx = jnp.asarray(np.where(np.arange(N)[:, None] % 3 == 0, 0, np.asarray(idx)))  # hot expert
    shards, chunks = shape["expert"], int(np.prod(list(shape.values())))
    cf = 1.0
    cap = moe_ep.capacity(N // chunks, K, shards, cf)
    keep = _expected_drops(idx, shards, cap, chunks)
    assert (~keep).sum() > 0
    with jax.set_mesh(_mesh(shape)):
        y, dropped = jax.jit(lambda *a: moe_ep.expert_parallel_dispatch(
            *a, ACT, capacity_factor=cf, return_dropped=True))(x, idx, w, ex)
        _, none_dropped = jax.jit(lambda *a: moe_ep.expert_parallel_dispatch(
            *a, ACT, return_dropped=True))(x, idx, w, ex)
    assert int(dropped) == int((~keep).sum()) and int(none_dropped) == 0
    want = dense_dispatch(x, idx, jnp.where(jnp.asarray(keep), w, 0.0), ex, ACT)
    assert_close("capped", want, y, 1e-5)
    # Gradients with drops: those of the reference whose dropped pairs have zero weight.
    capped = lambda *a: moe_ep.expert_parallel_dispatch(*a, capacity_factor=cf)  # noqa: E731

    def masked(x, idx, w, ex, act):
        return dense_dispatch(x, idx, jnp.where(jnp.asarray(keep), w, 0.0), ex, act)

    (_, want_y), want_g = _grads(masked, x, w, ex, idx)
    with jax.set_mesh(_mesh(shape)):
        (_, y), g = _grads(capped, x, w, ex, idx)
    assert_close("capped y", want_y, y, 1e-5)
    for name, a, b in zip(("dx", "dw", "dgate", "dup", "ddown"), jax.tree.leaves(want_g), jax.tree.leaves(g)):
        assert_close(name, a, b, 1e-5)
    assert float(jnp.abs(jnp.where(jnp.asarray(keep), 0.0, g[1])).max()) == 0.0  # no gradient to dropped weights


def test_without_mesh_and_gmm_dispatch(rng):
    x, idx, w, ex = _problem(rng)
    want = dense_dispatch(x, idx, w, ex, ACT)
    assert_close("no mesh", want, moe_ep.expert_parallel_dispatch(x, idx, w, ex, ACT), 1e-5)
    assert_close("gmm", want, moe_ep.gmm_dispatch(x, idx, w, ex, ACT), 1e-5)


def test_bad_configuration_raises(rng):
    x, idx, w, ex = _problem(rng)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_ep.capacity(4, 2, 2, 0.0)
    with jax.set_mesh(_mesh({"data": 2, "expert": 4})):
        with pytest.raises(ValueError, match="batch shards"):
            moe_ep.expert_parallel_dispatch(x[:30], idx[:30], w[:30], ex, ACT)


def test_moe_layer_dispatches_through_the_config(rng):
    """kimi_jax.moe.MoE with dispatch "gmm" / "expert_parallel" / "auto" (mesh data=2, expert=4)
    equals "ragged", gradients included; a capacity_factor reports its drops in the layer stats
    (under "auto" too, which runs expert_parallel on that mesh)."""
    import dataclasses

    from flax import nnx

    from kimi_jax.config import MoEConfig
    from kimi_jax.moe import MoE

    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=1,
                    latent_dim=12, dispatch="ragged")
    x = jnp.asarray(rng.normal(size=(4, 8, 24)), jnp.float32)

    def build(**changes):  # built outside the mesh: parameters carry names, not shardings
        return MoE(24, dataclasses.replace(cfg, **changes), activation="situ", rngs=nnx.Rngs(0))

    def loss(m, x):
        y, stats = m(x)
        return jnp.sum(y**2), (y, stats)

    def run(m):
        (_, (y, stats)), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(m, x)
        return y, stats, g

    y_r, _, g_r = run(build())
    gmm_moe, ep_moe = build(dispatch="gmm"), build(dispatch="expert_parallel")
    capped = build(dispatch="expert_parallel", capacity_factor=0.25)
    auto_capped = build(dispatch="auto", capacity_factor=0.25)
    y_a, _, g_a = run(build(dispatch="auto"))  # no mesh, CPU: ragged
    with jax.set_mesh(_mesh({"data": 2, "expert": 4})):
        y_g, _ = nnx.jit(lambda m, x: m(x))(gmm_moe, x)
        y_e, stats, g_e = run(ep_moe)
        _, stats_cap = nnx.jit(lambda m, x: m(x))(capped, x)
        _, stats_auto_cap = nnx.jit(lambda m, x: m(x))(auto_capped, x)  # expert axis: expert_parallel
    assert_close("gmm y", y_r, y_g, 1e-5)
    assert_close("ep y", y_r, y_e, 1e-5)
    assert_close("auto y", y_r, y_a, 1e-6)
    assert int(stats_auto_cap["dropped"]) == int(stats_cap["dropped"])
    for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_a)):
        assert_close("auto grad", a, b, 1e-6)
    for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_e)):
        assert_close("ep grad", a, b, 1e-4)
    assert int(stats["dropped"]) == 0 and int(stats_cap["dropped"]) > 0


def test_mxfp4_experts_expert_parallel(rng):
    """Packed MXFP4 expert weights travel through shard_map (experts split, tensor replicated)."""
    from kernels.mxfp4 import MXFP4Weight

    x = jnp.asarray(rng.normal(size=(N, 32)), jnp.float32)
    idx = jnp.asarray(np.argsort(-rng.normal(size=(N, E)), axis=1)[:, :K], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(N, K)), jnp.float32)
    ex = ExpertWeights(*(MXFP4Weight.from_dense(jnp.asarray(rng.normal(size=s), jnp.float32))
                         for s in ((E, 32, 32), (E, 32, 32), (E, 32, 32))))
    dense = ExpertWeights(*(m.dequantize() for m in ex))
    want = dense_dispatch(x, idx, w, dense, ACT)
    assert_close("gmm mxfp4", want, moe_ep.gmm_dispatch(x, idx, w, ex, ACT), 1e-5)
    with jax.set_mesh(_mesh({"expert": 4, "tensor": 2})):
        y = jax.jit(lambda *a: moe_ep.expert_parallel_dispatch(*a, ACT))(x, idx, w, ex)
    assert_close("ep mxfp4", want, y, 1e-5)


@pytest.mark.parametrize("shape,pallas,packed,want", [
    ({}, False, False, "ragged"),
    ({}, True, False, "gmm"),
    ({}, False, True, "gmm"),
    ({"data": 1}, True, False, "gmm"),
    ({"data": 8}, False, False, "ragged"),
    ({"data": 8}, True, False, "expert_parallel"),
    ({"data": 8}, False, True, "expert_parallel"),
    ({"data": 2, "expert": 4}, False, False, "expert_parallel"),
    ({"data": 4, "expert": 1, "tensor": 2}, False, False, "ragged"),
])
def test_auto_dispatch_resolution(monkeypatch, shape, pallas, packed, want):
    """"auto": gmm on one device where the grouped matmul is Pallas (or MXFP4 experts), the same
    per batch shard inside expert_parallel on several, expert_parallel wherever experts are sharded,
    else ragged (XLA partitions it)."""
    monkeypatch.setattr(moe_ep.gmm_ops, "resolve_impl", lambda impl, *d: "pallas_gpu" if pallas else "ragged_dot")
    if shape:
        with jax.set_mesh(_mesh(shape)):
            name, reason = moe_ep.resolve_auto(jnp.bfloat16, packed)
    else:
        name, reason = moe_ep.resolve_auto(jnp.bfloat16, packed)
    assert name == want, reason


def test_auto_dispatch_runs_its_choice(rng, monkeypatch, caplog):
    """auto_dispatch calls the dispatch it resolves to (logged once) and returns its values; the
    dropped count is zero for the dropless choices, expert_parallel's own count otherwise."""
    x, idx, w, ex = _problem(rng)
    want = dense_dispatch(x, idx, w, ex, ACT)
    called = []
    for name in ("ragged", "gmm", "expert_parallel"):
        fn = moe_ep.DISPATCH[name]
        monkeypatch.setitem(moe_ep.DISPATCH, name, lambda *a, _f=fn, _n=name, **k: called.append(_n) or _f(*a, **k))
    monkeypatch.setattr(moe_ep, "expert_parallel_dispatch", moe_ep.DISPATCH["expert_parallel"])
    monkeypatch.setattr(moe_ep, "_auto_logged", set())
    with caplog.at_level("INFO", logger="kimi_jax.moe_ep"):
        y, dropped = moe_ep.auto_dispatch(x, idx, w, ex, ACT, return_dropped=True)
        moe_ep.auto_dispatch(x, idx, w, ex, ACT)
    assert called == ["ragged", "ragged"] and int(dropped) == 0  # CPU: no Pallas grouped matmul
    assert_close("auto (ragged)", want, y, 1e-5)
    assert sum("moe dispatch 'auto' -> 'ragged'" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(moe_ep.gmm_ops, "resolve_impl", lambda impl, *d: "pallas_gpu")
    assert_close("auto (gmm)", want, moe_ep.auto_dispatch(x, idx, w, ex, ACT), 1e-5)
    with jax.set_mesh(_mesh({"data": 2, "expert": 4})):
        y, dropped = jax.jit(lambda *a: moe_ep.auto_dispatch(*a, ACT, capacity_factor=0.25, return_dropped=True))(
            x, idx, w, ex)
    assert called[2:] == ["gmm", "expert_parallel"] and int(dropped) > 0


def _bf16_problem(rng):
    x, idx, w, ex = _problem(rng)
    return x.astype(jnp.bfloat16), idx, w, jax.tree.map(lambda a: a.astype(jnp.bfloat16), ex)


@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 2}, {"data": 2, "expert": 2}, {"data": 2, "expert": 2, "tensor": 2}])
def test_auto_traces_the_pallas_kernels_per_shard(rng, monkeypatch, shape):
    """On several Hopper GPUs "auto" runs the Pallas grouped matmuls inside expert_parallel's
    shard_map (traced here as for the GPU): forward and backward trace with the mesh's
    varying-axes check on (kernel outputs typed by `kernels.vma`; the grouped loop's counter
    no longer starts at a ref-read value), and the kernels are inside the shard_map."""
    from kernels.gmm import ops as gmm_impl
    from kernels.kda import hopper

    x, idx, w, ex = _bf16_problem(rng)
    monkeypatch.setattr(gmm_impl, "_is_hopper", lambda: True)
    step = jax.value_and_grad(lambda *a: _loss(moe_ep.auto_dispatch, *a, idx), argnums=(0, 1, 2), has_aux=True)
    with hopper.assume_device_kind("hopper"), jax.set_mesh(_mesh(shape)):
        assert moe_ep.resolve_auto(jnp.bfloat16, False)[0] == "expert_parallel"
        traced = jax.make_jaxpr(step)(x, w, ex)
    (sm, *_), = [[e for e in equations(traced.jaxpr) if e.primitive.name == "shard_map"]]
    kernels = [e.params["name"] for e in equations(traced.jaxpr) if e.primitive.name == "mpmd_map"]
    assert kernels and all(e.params["interpret"] is None for e in equations(traced.jaxpr) if e.primitive.name == "mpmd_map")
    assert any(e.primitive.name == "mpmd_map" for e in equations(sm.params["jaxpr"]))
    grads = traced.out_avals[-len(jax.tree.leaves((x, w, ex))):]
    assert [g.shape for g in grads] == [a.shape for a in jax.tree.leaves((x, w, ex))]


def test_expert_parallel_runs_the_pallas_kernels_in_shard_map(rng, monkeypatch):
    """The Pallas grouped matmuls (their interpreter) inside expert_parallel's shard_map with the
    varying-axes check on give the dense reference's outputs and gradients (one device: the
    interpreter does not run several devices' kernels at once)."""
    from kernels.gmm import ops as gmm_impl

    x, idx, w, ex = _bf16_problem(rng)
    (_, want_y), want_g = _grads(dense_dispatch, x, w, ex, idx)
    monkeypatch.setattr(gmm_impl, "_is_hopper", lambda: True)
    with jax.set_mesh(_mesh({"data": 1, "expert": 1})):
        jaxpr = jax.make_jaxpr(lambda *a: _loss(moe_ep.expert_parallel_dispatch, *a, idx))(x, w, ex).jaxpr
        (_, y), g = _grads(moe_ep.expert_parallel_dispatch, x, w, ex, idx)
    (sm,) = [e for e in equations(jaxpr) if e.primitive.name == "shard_map"]
    assert any(e.primitive.name == "mpmd_map" for e in equations(sm.params["jaxpr"])), "no Pallas kernel in shard_map"
    assert_close("y", want_y.astype(jnp.float32), y.astype(jnp.float32), 2e-2)
    for name, a, b in zip(("dx", "dw", "dgate", "dup", "ddown"), jax.tree.leaves(want_g), jax.tree.leaves(g)):
        assert_close(name, a.astype(jnp.float32), b.astype(jnp.float32), 2e-2)


def test_auto_dispatch_in_the_config():
    """"auto" is a valid moe.dispatch, also for MXFP4 experts (it picks a dispatch that reads them)."""
    from kimi_jax.config import MoEConfig

    MoEConfig(num_experts=8, top_k=2, expert_hidden=16, dispatch="auto", experts_dtype="mxfp4")
    with pytest.raises(ValueError, match="needs moe.dispatch in"):
        MoEConfig(num_experts=8, top_k=2, expert_hidden=16, dispatch="ragged", experts_dtype="mxfp4")

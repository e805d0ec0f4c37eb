"""Muon (optax.contrib.muon) on a mesh: its masked optimizer state gets shardings, one train step
on 8 fake CPU devices matches one device, and train.py trains configs/tiny.py and resumes."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import train
from kimi_jax import checkpoint, data, optim, sharding, train_lib
from tests.test_sharding import _step, assert_matches
from tests.test_train import _losses
from tests.toy_lm import toy_config, use_toy_model


def _muon_config(**overrides):
    return toy_config(experts=4, **{"optim.name": "muon", "model.num_layers": 1, "model.d_model": 64,
                                    "model.num_heads": 4, "optim.lr": 1e-2, **overrides})


def _groups(opt_state):
    """(Adam group's ScaleByAdamState, Muon group's MuonState) of make_optimizer's Muon chain."""
    partition = opt_state[1]
    return (partition.inner_states["adam"].inner_state[0], partition.inner_states["muon"].inner_state[0])


def test_muon_state_shardings_mirror_parameters_and_keep_masks(monkeypatch):
    use_toy_model(monkeypatch)
    config = _muon_config()
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, params, rest = train_lib.abstract_model(config)
    tx, _ = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    shardings = train_lib.state_shardings(tx, params, rest, mesh)
    abstract_opt = jax.eval_shape(tx.init, params.to_pure_dict())
    assert jax.tree.structure(shardings["opt_state"]) == jax.tree.structure(abstract_opt)

    adam, muon = _groups(shardings["opt_state"])
    p = shardings["params"]
    block, p_block = muon.mu["blocks"][0], p["blocks"][0]
    for name in ("wq", "wo", "w1", "router"):  # Muon's matrices: momentum sharded like the parameter
        assert block[name] == p_block[name], name
        assert isinstance(adam.mu["blocks"][0][name], optax.MaskedNode)
    assert p_block["wq"].spec == P("fsdp", "tensor", None) and p_block["w1"].spec == P(None, "fsdp", "tensor")
    for tree in (adam.mu, adam.nu):  # Adam's group: embedding table and norms
        assert tree["embed"] == p["embed"] and tree["blocks"][0]["norm1"] == p_block["norm1"]
    assert p["embed"].spec == P("tensor", "fsdp")
    assert isinstance(muon.mu["embed"], optax.MaskedNode) and isinstance(block["norm1"], optax.MaskedNode)
    replicated = [adam.count, muon.count, muon.ns_coeffs, shardings["opt_state"][-1].count]
    assert all(s.spec == P() for s in replicated)


def test_state_leaves_the_parameter_sharding_cannot_split_are_replicated():
    """A statistic of a different shape (as in factored optimizers) than its parameter."""
    mesh = sharding.make_mesh({"fsdp": 4, "data": 2})
    params = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32), "v": jax.ShapeDtypeStruct((8,), jnp.float32)}
    shard = {"w": jax.sharding.NamedSharding(mesh, P("fsdp", None)),
             "v": jax.sharding.NamedSharding(mesh, P("fsdp"))}
    tx = optax.GradientTransformation(
        lambda p: (jax.tree.map(lambda x: jnp.zeros(x.shape[-1:]), p), jax.tree.map(jnp.zeros_like, p)),
        None)
    out = sharding.optimizer_shardings(tx, jax.eval_shape(tx.init, params), shard, mesh)
    assert out[0]["w"].spec == P() and out[0]["v"] == shard["v"]  # [6] cannot take P("fsdp", None)
    assert out[1] == shard


def _spec(s):
    return s if isinstance(s, optax.MaskedNode) else s.spec


@pytest.mark.parametrize("case", ["all_masked", "subtree_masked", "empty_group", "muon"])
def test_masked_and_empty_parts_keep_the_state_structure(case):
    """A group that masks out every parameter, a mask that drops a whole subtree (one MaskedNode
    for it), a parameter tree with an empty module, a partition group without parameters."""
    mesh = sharding.make_mesh({"fsdp": 4, "data": 2})
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    params = {"w": shape(8, 6), "empty": {}, "b": {"v": shape(8)}}
    named = lambda *s: jax.sharding.NamedSharding(mesh, P(*s))  # noqa: E731
    shard = {"w": named("fsdp", None), "empty": {}, "b": {"v": named("fsdp")}}
    tx = {"all_masked": optax.masked(optax.adam(1.0), {"w": False, "empty": {}, "b": False}),
          "subtree_masked": optax.masked(optax.adam(1.0), {"w": True, "empty": {}, "b": False}),
          "empty_group": optax.partition({"a": optax.adam(1.0), "s": optax.sgd(1.0, momentum=0.9)},
                                         {"w": "a", "empty": {}, "b": {"v": "a"}}),
          "muon": optax.contrib.muon(1.0)}[case]
    state = jax.eval_shape(tx.init, params)
    out = sharding.optimizer_shardings(tx, state, shard, mesh)
    assert jax.tree.structure(out) == jax.tree.structure(state)
    mask, w, v = optax.MaskedNode(), P("fsdp", None), {"v": P("fsdp")}
    want = {"all_masked": [(mask, mask)], "subtree_masked": [(w, mask)], "empty_group": [(w, v)],
            "muon": [(mask, v), (w, {"v": mask})]}[case]  # Muon: its Adam group's mu, then its own
    moments = [m for _, m in optax.tree_utils.tree_get_all_with_path(out, "mu")]
    assert [(_spec(m["w"]), jax.tree.map(_spec, m["b"]), m["empty"]) for m in moments] == \
        [(a, b, {}) for a, b in want]
    assert all(c.spec == P() for _, c in optax.tree_utils.tree_get_all_with_path(out, "count"))


@pytest.fixture(scope="module")
def one_device_steps():
    """The toy model's config, a batch, and the state and metrics of two steps on one device
    (computed once for every mesh shape)."""
    with pytest.MonkeyPatch.context() as m:
        use_toy_model(m)
        config = _muon_config()
        batch = next(data.make_iterator(config, "train"))
        return config, batch, *_step(config, sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]), batch)


@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 4}, {"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2},
                                   {"data": 2, "expert": 4}], ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_muon_step_on_8_devices_matches_one_device(monkeypatch, one_device_steps, shape):
    use_toy_model(monkeypatch)
    config, batch, ref_state, ref = one_device_steps
    state, metrics = _step(config, sharding.make_mesh(shape), batch)
    assert_matches(state, metrics, ref_state, ref, str(shape))
    _, muon = _groups(state["opt_state"])
    for name in ("wq", "w1"):
        assert muon.mu["blocks"][0][name].sharding == state["params"]["blocks"][0][name].sharding
        assert float(jnp.abs(muon.mu["blocks"][0][name]).max()) > 0  # the step reached the Muon group


def test_train_py_muon_tiny_resumes_exactly(tmp_path):
    """configs/tiny.py (the real hybrid model) with Muon on a data=2, fsdp=4 mesh: a run resumed
    from the straight run's step-2 checkpoint (what a kill during steps 3-4 leaves) restores the
    masked Muon state and logs the straight run's losses bitwise."""
    from configs import tiny

    config = tiny.get_config()
    config.optim.name = "muon"
    config.mesh.data, config.mesh.fsdp = 2, 4
    config.data.task_kwargs = dict(seq_len=16, num_kv_pairs=2, vocab_size=32)
    config.data.batch_size, config.optim.warmup_steps = 8, 1
    config.total_steps, config.log_every_steps, config.eval_every_steps = 4, 1, 0  # saves: step 2, step 4
    config.checkpoint_every_steps = 2
    config.evals.train_tasks = ""
    train.train_and_evaluate(config, str(tmp_path / "straight"))
    reference = _losses(tmp_path / "straight")
    assert sorted(reference) == [1, 2, 3, 4] and np.all(np.isfinite(list(reference.values())))
    assert reference[4] < reference[1], reference

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "2", resumed / "checkpoints" / "2")
    assert checkpoint.Checkpointer(str(resumed)).latest_step() == 2
    train.train_and_evaluate(config, str(resumed))
    assert _losses(resumed) == {s: reference[s] for s in (3, 4)}

"""Mesh construction, parameter/optimizer-state shardings from the logical rules, and one train
step on 8 fake CPU devices giving the loss and update of one device for several mesh shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from kimi_jax import data, optim, sharding, train_lib
from tests.toy_lm import toy_config, use_toy_model


def test_mesh_shape_resolution_and_errors():
    assert sharding.mesh_shape({"data": -1, "tensor": 2}, 8) == {"data": 4, "fsdp": 1, "tensor": 2, "expert": 1}
    assert sharding.mesh_shape({"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}, 8)["fsdp"] == 2
    with pytest.raises(ValueError, match="needs 4 devices but 8 are present"):
        sharding.mesh_shape({"data": 2, "fsdp": 2}, 8)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.mesh_shape({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="not divisible by 3"):
        sharding.mesh_shape({"data": -1, "tensor": 3}, 8)
    with pytest.raises(ValueError, match="Unknown mesh axes"):
        sharding.mesh_shape({"model": 8}, 8)
    mesh = sharding.make_mesh({"fsdp": -1})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}


def test_spec_for_shape_follows_rules_and_falls_back():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharding.spec_for_shape(("vocab", "embed"), (64, 32), mesh) == P("tensor", "fsdp")
    assert sharding.spec_for_shape(("vocab", "embed"), (63, 32), mesh) == P(None, "fsdp")  # 63 % 2
    assert sharding.spec_for_shape(("norm",), (32,), mesh) == P(None)
    assert sharding.spec_for_shape(("heads", "mlp"), (4, 8), mesh) == P("tensor", None)  # axis used once
    assert sharding.spec_for_shape(None, (4, 8), mesh) == P()
    with pytest.raises(ValueError, match="do not match"):
        sharding.spec_for_shape(("embed",), (4, 8), mesh)


def _step(config, mesh, batch):
    """Init straight into the shardings, then two steps of train.py's jitted step (lr as an argument)."""
    graphdef, params, rest = train_lib.abstract_model(config)
    tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    shardings = train_lib.state_shardings(tx, params, rest, mesh)
    state = jax.jit(train_lib.make_init(config, tx), out_shardings=shardings)()
    step = train_lib.jit_train_step(config, graphdef, tx, schedule, shardings, mesh)
    lr = jnp.asarray(config.optim.lr, jnp.float32)
    with jax.set_mesh(mesh):
        for i in (1, 2):
            state, metrics = step(state, train_lib.global_batch(batch, mesh), jnp.asarray(i, jnp.int32), lr)
    return state, metrics


def assert_matches(state, metrics, ref_state, ref, name):
    """Loss, gradient norm and every state leaf (parameters and optimizer state) as on one device."""
    np.testing.assert_allclose(metrics["loss"], ref["loss"], rtol=2e-5, err_msg=name)
    np.testing.assert_allclose(metrics["grad_norm"], ref["grad_norm"], rtol=1e-4, err_msg=name)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state), name
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, err_msg=name)


MESHES = {
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "data2-fsdp2-tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "data2-expert4": {"data": 2, "expert": 4},
}


def test_one_step_on_8_devices_matches_one_device(monkeypatch):
    use_toy_model(monkeypatch)
    config = toy_config(experts=4, **{"model.num_layers": 1, "model.d_model": 64, "model.num_heads": 4, "optim.lr": 1e-2})
    batch = next(data.make_iterator(config, "train"))
    one = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_state, ref = _step(config, one, batch)
    for name, shape in MESHES.items():
        mesh = sharding.make_mesh(shape)
        state, metrics = _step(config, mesh, batch)
        assert_matches(state, metrics, ref_state, ref, name)
        # parameters and their Adam moments are sharded as the rules say
        embed = state["params"]["embed"]
        expect = {"fsdp8": P(None, "fsdp"), "data2-fsdp2-tensor2": P("tensor", "fsdp")}.get(name, P(None, None))
        assert embed.sharding.spec == expect, (name, embed.sharding.spec)
        w1 = state["params"]["blocks"][0]["w1"]  # [experts, embed, expert_mlp]
        if name == "data2-expert4":
            assert w1.sharding.spec == P("expert", None, None)
        mu = optax.tree_utils.tree_get(state["opt_state"], "mu")["embed"]
        assert mu.sharding.spec == embed.sharding.spec

"""The peak learning rate as a runtime argument of the train step: the same parameters as an
optimizer built with the learning rate inside its schedules (AdamW and Muon, warmup + cosine and
WSD, weight decay and clipping on), the true lr in the metrics, and one program (identical HLO)
for every learning rate, which is what lets a sweep's lr trials share a compilation-cache entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import data, optim, sharding, train_lib
from tests.toy_lm import toy_config, use_toy_model

LR = 3e-3
STEPS = 6


def _config(name: str, schedule: str, lr: float = LR):
    return toy_config(total_steps=STEPS, **{
        "optim.name": name, "optim.lr": lr, "optim.schedule": schedule, "optim.warmup_steps": 2,
        "optim.min_lr_ratio": 0.1, "optim.decay_fraction": 0.5, "optim.weight_decay": 0.1,
        "optim.clip_norm": 0.05, "model.num_layers": 1})


def _train(config, peak_lr: float, *lr_args):
    """STEPS steps on one repeated batch with the optimizer built at `peak_lr`, from the same
    initial state for each of the step's lr arguments `lr_args` (one jitted step for all):
    (initial params, [(final params, per-step metrics) for each lr argument])."""
    graphdef, params, _ = train_lib.abstract_model(config)
    tx, schedule = optim.make_optimizer(config.optim, STEPS, train_lib.param_names(params), peak_lr=peak_lr)
    first = jax.jit(train_lib.make_init(config, tx))()
    init = jax.tree.map(np.asarray, first["params"])
    step = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule))
    batch = {k: jnp.asarray(v) for k, v in next(data.make_iterator(config, "train")).items()}
    runs = []
    for lr_arg in lr_args:
        state, metrics = jax.tree.map(jnp.copy, first), []
        for i in range(STEPS):
            state, m = step(state, batch, jnp.asarray(i + 1, jnp.int32), lr_arg)
            metrics.append(jax.device_get(m))
        runs.append((jax.tree.map(np.asarray, state["params"]), metrics))
    return init, runs


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_runtime_lr_matches_the_lr_inside_the_optimizer(monkeypatch, name, schedule):
    use_toy_model(monkeypatch)
    config = _config(name, schedule)
    # Before: the learning rate inside the schedules (Adam, Muon, Muon's Adam group, weight decay).
    init, [(old, old_metrics)] = _train(config, LR, 1.0)
    # Now: the optimizer at peak 1, the learning rate a float32 argument of the step (and twice it).
    _, [(new, new_metrics), (doubled, _)] = _train(config, 1.0, jnp.float32(LR), jnp.float32(2 * LR))
    for a, b, p0 in zip(jax.tree.leaves(old), jax.tree.leaves(new), jax.tree.leaves(init)):
        moved = np.abs(a - p0).max()
        assert moved > 1e-4  # every parameter trained
        # float32 rounding only: within 16 ulps of the leaf's largest entry after STEPS steps
        assert np.abs(b - a).max() <= 16 * np.finfo(np.float32).eps * np.abs(a).max()
    assert all(m["grad_norm"] > config.optim.clip_norm for m in new_metrics)  # clipping was active
    want = [float(optim.make_schedule(config.optim, STEPS)(i)) for i in range(STEPS)]
    np.testing.assert_allclose([float(m["lr"]) for m in new_metrics], want, rtol=1e-6)
    np.testing.assert_allclose([float(m["lr"]) for m in old_metrics], want, rtol=1e-6)
    assert want[0] == 0.0 and want[2] == pytest.approx(LR) and want[-1] < LR
    # The argument is what sets the step size: twice the lr moves the parameters differently.
    assert max(np.abs(d - b).max() for d, b in zip(jax.tree.leaves(doubled), jax.tree.leaves(new))) > 1e-4


def _lowered_text(config, pass_lr: bool, sharded: bool) -> str:
    """The jitted train step lowered on abstract inputs: train.py's (`jit_train_step`, state and
    batch sharded over a 2-device data mesh) or, unsharded, a plain `jax.jit` of it."""
    mesh = sharding.make_mesh({"data": 2}, devices=jax.devices()[:2])
    graphdef, params, rest = train_lib.abstract_model(config)
    tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    abstract = jax.eval_shape(train_lib.make_init(config, tx))
    first = next(data.make_iterator(config, "train"))
    if sharded:
        shardings = train_lib.state_shardings(tx, params, rest, mesh)
        step = train_lib.jit_train_step(config, graphdef, tx, schedule, shardings, mesh)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
        batch_spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES))
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_spec) for k, v in first.items()}
    else:
        step = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule))
        state = abstract
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in first.items()}
    args = (state, batch, jax.ShapeDtypeStruct((), jnp.int32))
    if pass_lr:
        args += (jax.ShapeDtypeStruct((), jnp.float32),)
    with jax.set_mesh(mesh):
        return step.lower(*args).as_text()


@pytest.mark.parametrize("name,sharded", [("adamw", True), ("adamw", False), ("muon", True), ("muon", False)])
def test_train_steps_of_two_learning_rates_lower_to_the_same_program(monkeypatch, name, sharded):
    use_toy_model(monkeypatch)
    texts = [_lowered_text(_config(name, "cosine", lr), True, sharded) for lr in (1e-3, 3e-3)]
    assert texts[0] == texts[1]
    # Control: with the lr left out (a constant of the program) the two lowerings differ.
    baked = [_lowered_text(_config(name, "cosine", lr), False, sharded) for lr in (1e-3, 3e-3)]
    assert baked[0] != baked[1]

"""The training loop: exact resume after a kill, SIGTERM, non-finite losses, gradient
accumulation, optimizers and schedules, and MQAR learning with configs/tiny.py."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train
from kimi_jax import checkpoint, data, optim, train_lib
from tests.toy_lm import toy_config, use_one_device, use_toy_model


def _losses(workdir) -> dict:
    """{step: loss} from metrics.jsonl (a resumed run's lines replace the killed run's)."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                out[record["step"]] = record["loss"]
    return out


class _Interrupt:
    """Wraps the data iterator: at its `at`-th batch calls `action` (raise, or send a signal)."""

    def __init__(self, monkeypatch, at: int, action):
        real, self.count = data.make_iterator, 0

        def make(config, split):
            it = real(config, split)
            if split != "train":
                return it
            nxt = it.__next__

            class Wrapped(type(it)):
                def __next__(inner):
                    self.count += 1
                    if self.count == at:
                        action()
                    return nxt()
            it.__class__ = Wrapped
            return it
        monkeypatch.setattr(data, "make_iterator", make)


def test_kill_and_resume_reproduces_losses(monkeypatch, tmp_path):
    use_toy_model(monkeypatch)
    config = toy_config(total_steps=8, checkpoint_every_steps=3)
    train.train_and_evaluate(config, str(tmp_path / "straight"))
    reference = _losses(tmp_path / "straight")
    assert sorted(reference) == list(range(1, 9))

    def kill():
        raise KeyboardInterrupt("killed")
    with monkeypatch.context() as m:
        _Interrupt(m, at=5, action=kill)  # dies during step 5: the last checkpoint is step 3
        with pytest.raises(KeyboardInterrupt):
            train.train_and_evaluate(config, str(tmp_path / "killed"))
    assert checkpoint.Checkpointer(str(tmp_path / "killed")).latest_step() == 3
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.')  # a line the kill cut short
    train.train_and_evaluate(config, str(tmp_path / "killed"))
    resumed = _losses(tmp_path / "killed")
    assert resumed == reference  # bitwise: same batches, same state
    # the steps the killed run logged past its checkpoint (4) are not logged twice
    assert _records(tmp_path / "killed") == _records(tmp_path / "straight")


def test_log_and_checkpoint_intervals_must_be_positive(tmp_path):
    for key in ("log_every_steps", "checkpoint_every_steps"):
        with pytest.raises(ValueError, match=key):
            train.train_and_evaluate(toy_config(**{key: 0}), str(tmp_path))


def _records(workdir, keys=("step", "loss", "grad_norm", "lr")) -> list:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: r.get(k) for k in keys} for r in map(json.loads, f)]


def test_sigterm_between_logs_resumes_the_same_log_windows(monkeypatch, tmp_path):
    """Logged every 4 steps, stopped by SIGTERM during step 6: the saved checkpoint carries the
    open window (steps 5-6), so the resumed run logs steps 5-8 as one window, as an uninterrupted
    run does, and metrics.jsonl holds the same records."""
    use_toy_model(monkeypatch)
    use_one_device(monkeypatch)
    config = toy_config(total_steps=12, checkpoint_every_steps=100, log_every_steps=4)
    train.train_and_evaluate(config, str(tmp_path / "straight"))
    with monkeypatch.context() as m:
        _Interrupt(m, at=6, action=lambda: os.kill(os.getpid(), signal.SIGTERM))
        train.train_and_evaluate(config, str(tmp_path / "stopped"))
    assert checkpoint.Checkpointer(str(tmp_path / "stopped")).latest_step() == 6
    assert [r["step"] for r in _records(tmp_path / "stopped")] == [4]  # no record for the open window
    train.train_and_evaluate(config, str(tmp_path / "stopped"))
    assert [r["step"] for r in _records(tmp_path / "straight")] == [4, 8, 12]
    assert _records(tmp_path / "stopped") == _records(tmp_path / "straight")


def test_sigterm_saves_a_loadable_checkpoint_and_exits(monkeypatch, tmp_path):
    use_toy_model(monkeypatch)
    use_one_device(monkeypatch)
    config = toy_config(total_steps=50, checkpoint_every_steps=100)
    before = signal.getsignal(signal.SIGTERM)
    _Interrupt(monkeypatch, at=4, action=lambda: os.kill(os.getpid(), signal.SIGTERM))
    train.train_and_evaluate(config, str(tmp_path))
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    assert ckpt.latest_step() == 4
    model = checkpoint.load_model(config, str(tmp_path))
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, 64) and bool(jnp.all(jnp.isfinite(logits)))
    assert signal.getsignal(signal.SIGTERM) == before  # the loop's handler is removed again
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))


def _tree_bytes(path) -> dict:
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(path) for f in files}


def test_nan_loss_stops_without_touching_the_last_checkpoint(monkeypatch, tmp_path):
    use_toy_model(monkeypatch)
    use_one_device(monkeypatch)
    config = toy_config(total_steps=6, checkpoint_every_steps=3, inject_nan_at_step=5)
    with pytest.raises(train.NonFiniteError, match=r"step 5.*Last good checkpoint: step 3"):
        train.train_and_evaluate(config, str(tmp_path))
    ckpt_dir = str(checkpoint.checkpoint_dir(str(tmp_path)))
    assert os.listdir(ckpt_dir) == ["3"]
    before = _tree_bytes(ckpt_dir)
    # The same run again resumes from step 3, meets the NaN again and still leaves step 3 alone.
    with pytest.raises(train.NonFiniteError, match="step 5"):
        train.train_and_evaluate(config, str(tmp_path))
    assert _tree_bytes(ckpt_dir) == before


def test_skip_nonfinite_updates_keeps_going(monkeypatch, tmp_path):
    use_toy_model(monkeypatch)
    use_one_device(monkeypatch)
    config = toy_config(total_steps=4, inject_nan_at_step=2, skip_nonfinite_updates=True)
    train.train_and_evaluate(config, str(tmp_path))
    losses = _losses(tmp_path)
    assert np.isnan(losses[2]) and all(np.isfinite(losses[s]) for s in (1, 3, 4))
    model = checkpoint.load_model(config, str(tmp_path))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(nnx_state(model)))


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def _one_step(config, batch):
    graphdef, params, _ = train_lib.abstract_model(config)
    tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    state = jax.jit(train_lib.make_init(config, tx))()
    step = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule))
    return step(state, batch, jnp.asarray(1, jnp.int32))


def test_gradient_accumulation_matches_one_big_batch(monkeypatch):
    use_toy_model(monkeypatch)
    config = toy_config(experts=4, **{"model.num_layers": 1})
    batch = {k: jnp.asarray(v) for k, v in next(data.make_iterator(config, "train")).items()}
    state1, m1 = _one_step(config, batch)
    config.optim.grad_accum_steps = 4
    state4, m4 = _one_step(config, batch)
    np.testing.assert_allclose(m1["ce_loss"], m4["ce_loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(state1["params"]), jax.tree.leaves(state4["params"])):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # the balancing update ran: router biases moved
    assert any(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves(state1["rest"]))


def test_schedules():
    config = toy_config(**{"optim.lr": 1.0, "optim.warmup_steps": 10, "optim.min_lr_ratio": 0.1})
    cos = optim.make_schedule(config.optim, 110)
    assert float(cos(0)) == 0.0 and float(cos(10)) == pytest.approx(1.0)
    assert float(cos(60)) == pytest.approx(0.55, abs=1e-3) and float(cos(110)) == pytest.approx(0.1)
    config.optim.schedule, config.optim.decay_fraction = "wsd", 0.2
    wsd = optim.make_schedule(config.optim, 110)
    assert float(wsd(50)) == 1.0 and float(wsd(90)) == pytest.approx(1.0)
    assert float(wsd(100)) == pytest.approx(0.55) and float(wsd(110)) == pytest.approx(0.1)
    config.optim.schedule = "linear"
    with pytest.raises(ValueError, match="Unknown optim.schedule"):
        optim.make_schedule(config.optim, 10)


def test_decay_mask_and_muon_axes(monkeypatch):
    use_toy_model(monkeypatch)
    config = toy_config(experts=4)
    _, params, _ = train_lib.abstract_model(config)
    names, pure = train_lib.param_names(params), params.to_pure_dict()
    mask = optim.decay_mask(pure, names, decay_embeddings=False)
    assert mask["blocks"][0]["wq"] and mask["blocks"][0]["w1"]
    assert not mask["blocks"][0]["norm1"] and not mask["norm"] and not mask["embed"]
    assert optim.decay_mask(pure, names, decay_embeddings=True)["embed"]
    dims = optim.muon_dimension_numbers(pure, names)
    assert dims["embed"] is None and dims["norm"] is None
    assert dims["blocks"][0]["wq"] == optax.contrib.MuonDimensionNumbers(0, (1, 2))
    assert dims["blocks"][0]["wo"] == optax.contrib.MuonDimensionNumbers((0, 1), 2)
    assert dims["blocks"][0]["w1"] == optax.contrib.MuonDimensionNumbers(1, 2)  # experts: batch axis


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizers_reduce_the_loss_on_a_repeated_batch(monkeypatch, name):
    use_toy_model(monkeypatch)
    config = toy_config(**{"optim.name": name, "optim.lr": 3e-3, "optim.schedule": "constant",
                           "optim.z_loss": 1e-4})
    graphdef, params, _ = train_lib.abstract_model(config)
    tx, schedule = optim.make_optimizer(config.optim, 20, train_lib.param_names(params))
    state = jax.jit(train_lib.make_init(config, tx))()
    step = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule))
    batch = {k: jnp.asarray(v) for k, v in next(data.make_iterator(config, "train")).items()}
    losses = []
    for i in range(15):
        state, metrics = step(state, batch, jnp.asarray(i + 1, jnp.int32))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses


def test_unknown_optimizer():
    config = toy_config(**{"optim.name": "sgd"})
    with pytest.raises(ValueError, match="Unknown optim.name"):
        optim.make_optimizer(config.optim, 10, {})


def test_tiny_config_learns_mqar(monkeypatch, tmp_path):
    """configs/tiny.py on a small MQAR setting (L=16, 2 pairs, 16 values): well above chance; and\n    a profile of two of its steps."""
    from configs import tiny

    use_one_device(monkeypatch)  # learning, not sharding (tests/test_muon.py trains it on a mesh)
    config = tiny.get_config()
    config.data.task_kwargs = dict(seq_len=16, num_kv_pairs=2, vocab_size=32)
    config.data.batch_size = 32
    config.optim.lr, config.optim.warmup_steps = 3e-3, 10
    config.total_steps, config.log_every_steps = 60, 20
    config.eval_every_steps = config.checkpoint_every_steps = 60
    config.evals.train_tasks = ""  # held-out accuracy from the eval split only
    config.profile_steps = (58, 59)
    metrics = train.train_and_evaluate(config, str(tmp_path))
    chance = 1 / 16  # values are uniform over half of the 32-token vocabulary
    assert metrics["eval_accuracy"] > 4 * chance, metrics
    assert metrics["loss"] < np.log(16), metrics  # below guessing among the 16 values
    # profile_steps: those steps' device time by model part in WORKDIR/profile/summary.json
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["kernel_ms_per_step"] > 0
    assert "optimizer" in summary["by_part"] and any(p.startswith("mixer_") for p in summary["by_part"])


def test_jitted_init_takes_the_seed_as_an_array():
    """train.py's init gets config.seed as a uint32 array (not a compile-time constant XLA folds):
    the same keys as the seed given as an int, another state for another seed."""
    from configs import tiny

    for seed in (0, 5, 2**32 - 1):
        np.testing.assert_array_equal(jax.random.key_data(jax.random.key(train_lib.seed_array(seed))),
                                      jax.random.key_data(jax.random.key(seed)))
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(ValueError, match="config.seed"):
            train_lib.seed_array(bad)
    config = tiny.get_config("d_model=32,vocab_size=64")
    _, params, _ = train_lib.abstract_model(config)
    tx, _ = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    jitted = jax.jit(train_lib.make_init(config, tx))
    assert len(jitted.lower(train_lib.seed_array(0)).args_info[0]) == 1  # an argument, not a constant
    same, other = (jitted(train_lib.seed_array(s))["params"] for s in (config.seed, config.seed + 1))
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(other)))

"""`tie_embeddings` (Zoology's and GPT-2's output head): the logits are the final hidden state
against the token embedding, the model has no separate head (the parameter count drops by
vocab x d_model), the tied table starts at `init_std`, decoding follows the forward, the train
step updates the one table from both uses, and the MQAR sweep's `tied=True` form reaches the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model_presets import ablation_config
from configs.sweeps import mqar
from kimi_jax import build_model, data, optim, summary, train_lib
from kimi_jax.config import ModelConfig
from kimi_jax.generate import stepwise_logits
from tests.test_mqar_sweep_lr import _trials

ARG = "d_model=32,num_layers=2,vocab_size=64,rope=False,ffn=False,learned_positions=16"


@pytest.fixture(scope="module")
def models():
    return (build_model(ablation_config("softmax", ARG + ",tied=True"), rngs=nnx.Rngs(0)),
            build_model(ablation_config("softmax", ARG), rngs=nnx.Rngs(0)))


def _tokens(shape=(2, 16), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, 64, dtype=jnp.int32)


def test_logits_are_the_hidden_state_against_the_embedding(models, monkeypatch):
    tied, untied = models
    assert tied.head is None and untied.head is not None
    std = float(jnp.std(tied.embed.embedding[...]))
    assert 0.015 < std < 0.025 and float(jnp.std(untied.embed.embedding[...])) > 0.8  # init_std 0.02 vs 1
    seen = []
    norm = type(tied.norm).__call__
    monkeypatch.setattr(type(tied.norm), "__call__", lambda self, x: seen.append(norm(self, x)) or seen[-1])
    logits = tied(_tokens())
    want = jnp.einsum("btd,vd->btv", seen[-1], tied.embed.embedding[...])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_param_count_and_decode(models):
    tied, untied = models
    (t_total, _), (u_total, _) = (summary.count_params(ablation_config("softmax", ARG + s)) for s in (",tied=True", ""))
    assert u_total - t_total == 64 * 32
    tokens = _tokens((2, 8), 1)
    np.testing.assert_allclose(np.asarray(stepwise_logits(tied, tokens)), np.asarray(tied(tokens)),
                               rtol=2e-4, atol=2e-5)


def test_train_step_updates_the_one_table():
    cfg = ablation_config("softmax", ARG + ",tied=True")
    cfg.data.task = "mqar"
    cfg.data.task_kwargs = dict(seq_len=16, num_kv_pairs=2, vocab_size=64)
    cfg.data.batch_size, cfg.total_steps, cfg.optim.warmup_steps = 4, 2, 0
    graphdef, params, _ = train_lib.abstract_model(cfg)
    assert "head" not in params.to_pure_dict()
    tx, schedule = optim.make_optimizer(cfg.optim, cfg.total_steps, train_lib.param_names(params))
    state = jax.jit(train_lib.make_init(cfg, tx))()
    batch = {k: jnp.asarray(v) for k, v in next(data.make_iterator(cfg, "train")).items()}
    before = np.asarray(state["params"]["embed"]["embedding"])
    new, m = jax.jit(train_lib.make_train_step(cfg, graphdef, tx, schedule))(state, batch, jnp.int32(1))
    moved = np.abs(np.asarray(new["params"]["embed"]["embedding"]) - before)
    assert np.isfinite(float(m["loss"])) and moved.max() > 0
    assert (moved.max(axis=1) > 0).sum() > 32  # as a head, rows of tokens absent from the batch move too


def test_checks_and_sweep_form():
    model = ablation_config("softmax", ARG).model.to_dict()
    with pytest.raises(ValueError, match="tie_embeddings"):
        ModelConfig.from_config_dict(dict(model, tie_embeddings=1))
    with pytest.raises(ValueError, match="init_std"):
        ModelConfig.from_config_dict(dict(model, tie_embeddings=True, init_std=0.0))
    base = "gpu_long,mixers=softmax,settings=512x64,widths=64,rope=False,learned_pos=True,mlp=False"
    plain, tied = _trials(base), _trials(base + ",tied=True")
    assert len(tied) == len(plain) == 1 and tied[0].name != plain[0].name
    assert mqar.get_config(tied[0].config.split(":", 1)[1]).model.tie_embeddings is True
    assert mqar.get_config(plain[0].config.split(":", 1)[1]).model.tie_embeddings is False

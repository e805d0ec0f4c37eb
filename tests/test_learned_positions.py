"""Learned absolute positions (`max_position_embeddings`, Zoology's attention models): used by the
forward, restarted at each packed document, followed by decode, bounded with clear errors, left
out of the active parameter count, and respected by the evaluation suite (settings past the table
are skipped with a reason)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model_presets import ablation_config
from kimi_jax import build_model, summary
from kimi_jax.config import ModelConfig
from kimi_jax.generate import stepwise_logits

ARG = "d_model=32,num_layers=2,vocab_size=64,rope=False,ffn=False"


@pytest.fixture(scope="module")
def model():
    return build_model(ablation_config("softmax", ARG + ",learned_positions=16"), rngs=nnx.Rngs(0))


def _tokens(shape, seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, 64, dtype=jnp.int32)


def test_table_shape_and_it_changes_the_output(model):
    assert model.pos_embed.embedding.shape == (16, 32)
    assert model.pos_embed.embedding.get_metadata()["out_sharding"] == (None, "embed")
    tokens = _tokens((2, 12))
    with_pos = model(tokens)
    table = model.pos_embed.embedding[...]
    model.pos_embed.embedding[...] = jnp.zeros_like(table)
    try:
        without = model(tokens)
    finally:
        model.pos_embed.embedding[...] = table
    assert not np.allclose(with_pos, without, atol=1e-3)
    # NoPE attention without the table cannot tell a repeated token's positions apart: with it, it can.
    same = jnp.full((1, 6), 5, jnp.int32)
    logits = model(same)[0]
    assert not np.allclose(logits[1], logits[5], atol=1e-4)


def test_decode_equals_forward(model):
    tokens = _tokens((2, 16), seed=1)
    np.testing.assert_allclose(stepwise_logits(model, tokens), model(tokens), rtol=1e-4, atol=1e-4)
    cache = model.init_cache(2, 16)
    assert len(cache) == 3 and int(cache[-1]["pos"]) == 0
    _, cache = model.decode_step(tokens[:, :1], cache)
    assert int(cache[-1]["pos"]) == 1


def test_positions_restart_at_each_packed_document(model):
    """Row 0 packs [a, b], row 1 packs [b, a]: each document's logits match across rows, which
    needs b's positions to start at 0 in row 0."""
    a, b = _tokens((1, 5), 2)[0], _tokens((1, 7), 3)[0]
    tokens = jnp.stack([jnp.concatenate([a, b]), jnp.concatenate([b, a])])
    segments = jnp.array([[0] * 5 + [1] * 7, [0] * 7 + [1] * 5])
    logits = model(tokens, segment_ids=segments)
    np.testing.assert_allclose(logits[0, 5:], logits[1, :7], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[0, :5], logits[1, 7:], rtol=1e-4, atol=1e-4)


def test_lengths_past_the_table_raise(model):
    with pytest.raises(ValueError, match="T=17 positions.*max_position_embeddings=16"):
        model(_tokens((1, 17)))
    with pytest.raises(ValueError, match="max_len=17 exceeds the learned position table"):
        model.init_cache(1, 17)
    with pytest.raises(ValueError, match="cache has 2 entries; the model needs 3"):
        model.decode_step(_tokens((1, 1)), model.init_cache(1, 4)[:2])
    base = dict(vocab_size=8, d_model=8, num_layers=1, mixer_pattern=("softmax",), dense_layers=1,
                dense_hidden=8, mixers={"softmax": dict(num_heads=1, head_dim=8)})
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="max_position_embeddings must be an int >= 0"):
            ModelConfig.from_config_dict(dict(base, max_position_embeddings=bad))


def test_table_is_counted_in_total_not_active():
    plain = ablation_config("softmax", ARG)
    learned = ablation_config("softmax", ARG + ",learned_positions=16")
    (t0, a0), (t1, a1) = summary.count_params(plain), summary.count_params(learned)
    assert t1 - t0 == 16 * 32 and a1 == a0
    assert summary.param_table(learned)["position embedding"] == (1, 16 * 32)


def test_greedy_fills_the_table_exactly(model):
    """ModelRunner.greedy feeds the prompt and every answer token but the last: a 12-token
    prompt and 5 new tokens fit the 16-position table, and equal the full forward's argmax."""
    from kimi_jax.evaluators.runner import ModelRunner

    prompt = np.asarray(_tokens((2, 12), seed=4))
    new = ModelRunner(model).greedy(prompt, 5)
    seq = prompt
    for _ in range(5):
        nxt = np.asarray(model(jnp.asarray(seq)))[:, -1].argmax(-1)
        seq = np.concatenate([seq, nxt[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(new, seq[:, 12:])


def test_eval_skips_settings_past_the_table(model):
    """eval.py's suite runs what fits the table and records a reason for the rest (task settings
    and decode-timing lengths) instead of failing on the first long one."""
    from kimi_jax.evaluators.suite import evaluate

    config = ablation_config("softmax", ARG + ",learned_positions=16")
    config.data.task = "mqar"
    config.data.task_kwargs = dict(seq_len=16, num_kv_pairs=2, vocab_size=64)
    config.evals.update(dict(num_examples=8, batch_size=8, decode_lengths=(4, 15), decode_steps=2))
    results = evaluate(config, model, ["train_task"], log=lambda *a: None)
    assert list(results["tasks"]["mqar"]) == ["L16_K2"] and not results["skipped"].get("mqar")
    assert results["decode"]["context_len"] == [4] and results["memory"]["context_len"] == [4]
    assert results["skipped"]["decode"] == {"L15": "needs 17 positions; the model's learned position table has 16"}
    config.data.task_kwargs = dict(seq_len=32, num_kv_pairs=2, vocab_size=64)
    results = evaluate(config, model, ["train_task"], log=lambda *a: None)
    assert results["tasks"] == {}
    assert results["skipped"]["mqar"] == {"L32_K2": "needs 32 positions; the model's learned position table has 16"}

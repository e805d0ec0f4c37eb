"""Evaluators: the metric on hand-made logits, and the task evaluation (teacher-forced and greedy
decoding) on an n-gram copying oracle whose predictions a NumPy loop recomputes independently;
then the runner on a real (small) model against a brute-force greedy loop."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from kimi_jax.evaluators import ModelRunner, evaluate, evaluate_task, run_all, score_logits, summarize
from kimi_jax.tasks import make_task


# --------------------------------------------------------------------------------- metric

def test_metric_per_example_then_mean():
    V = 5
    targets = np.array([[1, 2, 3, 4], [0, 1, 2, 3], [4, 4, 4, 4]])
    mask = np.array([[0, 1, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
    preds = np.array([[0, 2, 0, 0], [0, 1, 2, 0], [4, 4, 4, 4]])   # ex0: 1 of 2; ex1: 3 of 3
    probs = np.full((3, 4, V), 0.1)
    np.put_along_axis(probs, preds[..., None], 0.6, axis=-1)
    out = jax.tree.map(np.asarray, score_logits(jnp.log(probs), targets, mask))
    np.testing.assert_array_equal(out["correct"], [1, 3, 0])
    np.testing.assert_array_equal(out["count"], [2, 3, 0])
    np.testing.assert_array_equal(out["all_correct"], [False, True, False])
    np.testing.assert_allclose(out["nll"], [-np.log(0.6) - np.log(0.1), -3 * np.log(0.6), 0], rtol=1e-6)
    s = summarize([out])
    assert s["accuracy"] == pytest.approx(0.75)       # (1/2 + 3/3) / 2, not the token mean 4/5
    assert s["exact"] == 0.5 and s["num_examples"] == 2
    assert s["loss"] == pytest.approx((-4 * np.log(0.6) - np.log(0.1)) / 5, rel=1e-6)
    # Batches combine as one set; a batch with nothing scored is an error alone.
    half = summarize([jax.tree.map(lambda x: x[:1], out), jax.tree.map(lambda x: x[1:], out)])
    assert half == s
    with pytest.raises(ValueError):
        summarize([jax.tree.map(lambda x: x[2:], out)])


def test_metric_full_vocab_argmax():
    # The value is right only if it beats every token, including ids outside the value range.
    logits = jnp.array([[[0.0, 5.0, 4.0]]])
    out = score_logits(logits, jnp.array([[2]]), jnp.array([[True]]))
    assert int(out["correct"][0]) == 0


# ----------------------------------------------------------------------------- the oracle

class NGramOracle(nnx.Module):
    """At position t, find the latest j < t whose last n tokens equal those ending at t and predict
    tokens[j + 1] (0 when none): n = 1 is an induction head (it solves MQAR without filler)."""

    def __init__(self, n: int, vocab_size: int):
        self.n, self.vocab_size = n, vocab_size

    def _logits(self, nxt):
        return 10.0 * jax.nn.one_hot(nxt, self.vocab_size)

    def __call__(self, tokens, segment_ids=None):
        B, T = tokens.shape
        eq = tokens[:, :, None] == tokens[:, None, :]
        match = jnp.ones((B, T, T), bool)
        for k in range(self.n):  # eq shifted k back along both axes
            match &= jnp.pad(eq, ((0, 0), (k, 0), (k, 0)))[:, :T, :T]
        t = jnp.arange(T)
        valid = (t[None, :] < t[:, None]) & (t[None, :] >= self.n - 1) & (t[:, None] >= self.n - 1)
        j = jnp.max(jnp.where(match & valid, t, -1), axis=-1)
        nxt = jnp.take_along_axis(tokens, jnp.clip(j + 1, 0, T - 1), axis=1)
        return self._logits(jnp.where(j >= 0, nxt, 0))

    def init_cache(self, batch_size, max_len):
        return {"buf": jnp.zeros((batch_size, max_len), jnp.int32), "pos": jnp.zeros((), jnp.int32)}

    def decode_step(self, tokens, cache):
        buf = jax.lax.dynamic_update_slice(cache["buf"], tokens.astype(jnp.int32), (0, cache["pos"]))
        pos, L = cache["pos"], buf.shape[1]
        t = jnp.arange(L)
        match = (t < pos) & (t >= self.n - 1) & (pos >= self.n - 1)
        for k in range(self.n):
            mine = jax.lax.dynamic_slice(buf, (0, jnp.maximum(pos - k, 0)), (buf.shape[0], 1))
            match = match & (jnp.roll(buf, k, axis=1) == mine)
        j = jnp.max(jnp.where(match, t, -1), axis=-1)
        nxt = jnp.take_along_axis(buf, jnp.clip(j + 1, 0, L - 1)[:, None], axis=1)[:, 0]
        return self._logits(jnp.where(j >= 0, nxt, 0))[:, None], {"buf": buf, "pos": pos + 1}


def oracle_np(seq, n):
    """NumPy loop of the oracle: its prediction at every position of seq [T]."""
    out = np.zeros(len(seq), int)
    for t in range(n - 1, len(seq)):
        for j in range(t - 1, n - 2, -1):
            if all(seq[t - k] == seq[j - k] for k in range(n)):
                out[t] = seq[j + 1]
                break
    return out


def expected_accuracy(data, n):
    accs, exact = [], []
    for x, y, m in zip(data["inputs"], data["targets"], data["loss_mask"]):
        hit = oracle_np(x, n)[m] == y[m]
        accs.append(hit.mean())
        exact.append(hit.all())
    return np.mean(accs), np.mean(exact)


def greedy_np(prompt, num_new, n):
    seq = list(prompt)
    for _ in range(num_new):
        seq.append(oracle_np(np.array(seq), n)[-1])
    return seq[len(prompt):]


@pytest.mark.parametrize("name,settings,n", [
    ("mqar", dict(seq_len=64, num_kv_pairs=4, vocab_size=128, random_non_queries=False), 1),
    ("mqar", dict(seq_len=64, num_kv_pairs=8, vocab_size=96), 1),      # random filler collides
    ("mqar_kimi", dict(seq_len=64, vocab_size=64), 1),
    ("palindrome", dict(seq_len=32, vocab_size=8), 2),
])
def test_teacher_forced_accuracy_matches_numpy_oracle(name, settings, n):
    task = make_task(name, **settings)
    model = NGramOracle(n, task.vocab_size)
    got = evaluate_task(ModelRunner(model), task, num_examples=40, batch_size=16, seed=1)
    acc, exact = expected_accuracy(task.generate(1, 40), n)
    assert got["accuracy"] == pytest.approx(acc) and got["exact"] == pytest.approx(exact)
    if name != "palindrome" and settings.get("random_non_queries", True) is False:
        assert acc == 1.0
    assert got["num_examples"] == 40 and got["seq_len"] == task.seq_len


def test_greedy_generation_matches_numpy_and_teacher_forced():
    task = make_task("phonebook", seq_len=256)
    model = NGramOracle(8, task.vocab_size)
    runner = ModelRunner(model)
    data = task.generate(3, 12)
    full = np.concatenate([data["inputs"], data["targets"][:, -1:]], axis=1)
    new = runner.greedy(full[:5, :task.prompt_len], task.answer_len)
    for row, gen in zip(full[:5], new):
        np.testing.assert_array_equal(gen, greedy_np(row[:task.prompt_len], task.answer_len, 8))
    by_gen = evaluate_task(runner, task, num_examples=12, batch_size=8, seed=3, generation="generate")
    by_tf = evaluate_task(runner, task, num_examples=12, batch_size=8, seed=3,
                          generation="teacher_forced")
    assert 0.5 < by_gen["accuracy"] == by_tf["accuracy"] == by_gen["exact"]
    assert by_gen["match_all"] >= by_gen["exact"] and "match_all" not in by_tf
    with pytest.raises(ValueError, match="Unknown generation"):
        evaluate_task(runner, task, num_examples=2, batch_size=2, seed=0, generation="beam")


def _config(model_vocab: int, **data):
    from configs.evals import evals_defaults

    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(vocab_size=model_vocab))
    config.data = ml_collections.ConfigDict(dict(kind="task", task="mqar", task_kwargs=data))
    evals_defaults(config)
    config.evals.num_examples = 16
    config.evals.batch_size = 16
    config.evals.decode_lengths = (8,)
    config.evals.decode_steps = 2
    return config


def test_suite_inherits_training_task_and_skips_what_cannot_run():
    config = _config(64, seq_len=32, num_kv_pairs=2, vocab_size=48, random_non_queries=False)
    config.evals.suite = {"mqar": [dict(seq_len=32, num_kv_pairs=2), dict(seq_len=64, num_kv_pairs=4)],
                          "induction_heads": [dict(seq_len=32)]}
    logs = []
    res = evaluate(config, NGramOracle(1, 64), ["train_task", "mqar", "induction_heads", "phonebook"],
                   log=logs.append)
    # train_task and the first mqar setting coincide (evaluated once); L=64 needs vocab > 64.
    assert set(res["tasks"]["mqar"]) == {"L32_K2"} and res["tasks"]["mqar"]["L32_K2"]["accuracy"] == 1.0
    assert "mqar" in res["skipped"] and "induction_heads" in res["tasks"]
    assert res["tasks"]["induction_heads"]["L32"]["accuracy"] == 1.0   # n = 1 oracle copies
    assert "model vocab" in next(iter(res["skipped"]["phonebook"].values()))
    assert res["memory"]["allocated_bytes"] == [8 * 4 + 4] and len(res["decode"]["seconds_per_token"]) == 1
    assert run_all(config, NGramOracle(1, 64), step=0) == {
        "eval/mqar/L32_K2/accuracy": 1.0, "eval/mqar/L32_K2/exact": 1.0,
        "eval/mqar/L32_K2/loss": pytest.approx(res["tasks"]["mqar"]["L32_K2"]["loss"])}
    with pytest.raises(ValueError, match="Unknown eval task"):
        evaluate(config, NGramOracle(1, 64), ["nope"])


# -------------------------------------------------------------------------- a real model

def test_runner_greedy_equals_forward_argmax_on_a_model():
    from configs.model_presets import ablation_config
    from kimi_jax import build_model

    config = ablation_config("softmax", "d_model=32,num_layers=1,vocab_size=64")
    model = build_model(config, rngs=nnx.Rngs(0))
    runner = ModelRunner(model)
    prompt = np.random.RandomState(0).randint(0, 64, size=(2, 6)).astype(np.int32)
    new = runner.greedy(prompt, 3)
    seq = prompt
    for _ in range(3):  # brute force: full forward on the growing sequence
        nxt = np.asarray(model(jnp.asarray(seq)))[:, -1].argmax(-1)
        seq = np.concatenate([seq, nxt[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(new, seq[:, 6:])
    assert runner.cache_bytes(1, 64) > runner.cache_bytes(1, 32) > 0      # a KV cache grows
    assert runner.decode_seconds_per_token(8, steps=2) > 0


def test_runners_of_one_structure_share_compiled_programs():
    from kimi_jax.evaluators import runner as runner_lib

    x = np.zeros((2, 8), np.int32)
    ModelRunner(NGramOracle(3, 16)).score(x, x, x > 0)
    before = runner_lib._score._cache_size()
    ModelRunner(NGramOracle(3, 16)).score(x + 1, x, x > 0)     # new runner, same structure
    assert runner_lib._score._cache_size() == before
    ModelRunner(NGramOracle(2, 16)).score(x, x, x > 0)         # another structure compiles
    assert runner_lib._score._cache_size() == before + 1

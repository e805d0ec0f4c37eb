"""Task generators against hand-worked examples: positions, labels and which positions are
scored, plus the invariants each task definition promises."""

import numpy as np
import pytest

from kimi_jax.tasks import IGNORE, make_task
from kimi_jax.tasks.base import from_labels
from kimi_jax.tasks.mqar import layout


# ----------------------------------------------------------------------------------------- MQAR

def test_mqar_layout_matches_zoology_docstring_example():
    # keys (2, 4) -> values (8, 7); key 4 queried at gap 1, key 2 at gap 4; L = 16.
    inputs, labels = layout(np.array([[2, 4]]), np.array([[8, 7]]), np.array([[4, 1]]), 16)
    np.testing.assert_array_equal(inputs[0], [2, 8, 4, 7, 0, 0, 4, 0, 0, 0, 0, 0, 2, 0, 0, 0])
    expected = np.full(16, IGNORE)
    expected[6], expected[12] = 7, 8
    np.testing.assert_array_equal(labels[0], expected)


def test_mqar_targets_and_mask_from_labels():
    inputs, labels = layout(np.array([[2, 4]]), np.array([[8, 7]]), np.array([[4, 1]]), 16)
    out = from_labels(inputs, labels)
    np.testing.assert_array_equal(np.flatnonzero(out["loss_mask"][0]), [6, 12])
    # Scored: the value; elsewhere the next input token (0 after the last position).
    np.testing.assert_array_equal(out["targets"][0], [8, 4, 7, 0, 0, 4, 7, 0, 0, 0, 0, 2, 8, 0, 0, 0])


def test_mqar_layout_two_passes_tiles_context():
    inputs, labels = layout(np.array([[2, 4]]), np.array([[8, 7]]), np.array([[0, 2]]), 16,
                            num_passes=2)
    np.testing.assert_array_equal(inputs[0, :8], [2, 8, 4, 7, 2, 8, 4, 7])
    np.testing.assert_array_equal(np.flatnonzero(labels[0] != IGNORE), [8, 12])
    assert inputs[0, 8] == 2 and labels[0, 8] == 8 and inputs[0, 12] == 4 and labels[0, 12] == 7


@pytest.mark.parametrize("random_fill", [False, True])
def test_mqar_generator_invariants(random_fill):
    L, K, V, N = 64, 4, 128, 200
    task = make_task("mqar", seq_len=L, num_kv_pairs=K, vocab_size=V,
                     random_non_queries=random_fill)
    b = task.generate(seed=3, num_examples=N)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    assert x.shape == (N, L) and x.dtype == np.int32 and m.dtype == np.bool_
    assert task.setting == "L64_K4" and task.vocab_size == V and task.seq_len == L
    assert (m.sum(1) == K).all()
    keys, values = x[:, 0:2 * K:2], x[:, 1:2 * K:2]
    assert ((keys >= 1) & (keys < V // 2)).all() and ((values >= V // 2) & (values < V)).all()
    for i in range(N):
        assert len(set(keys[i])) == K and len(set(values[i])) == K
        pos = np.flatnonzero(m[i])
        assert (pos >= 2 * K).all() and ((pos - 2 * K) % 2 == 0).all()
        # Every key queried once; the label at the query is that key's value.
        assert sorted(x[i, pos]) == sorted(keys[i])
        lookup = dict(zip(keys[i], values[i]))
        assert [lookup[k] for k in x[i, pos]] == list(y[i, pos])
        rest = np.ones(L, bool)
        rest[:2 * K] = False
        rest[pos] = False
        if not random_fill:
            assert (x[i, rest] == 0).all()
    if random_fill:
        assert (x[:, 2 * K:] != 0).mean() > 0.9  # filler is uniform over the whole vocab


def test_mqar_deterministic_in_seed():
    task = make_task("mqar", seq_len=32, num_kv_pairs=4, vocab_size=64)
    a, b, c = task.generate(1, 8), task.generate(1, 8), task.generate(2, 8)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_mqar_power_law_puts_queries_early():
    uniform = make_task("mqar", seq_len=16, num_kv_pairs=2, vocab_size=32, power_a=1.0)
    np.testing.assert_allclose(uniform.gap_probs(), np.full(6, 1 / 6))
    skewed = make_task("mqar", seq_len=16, num_kv_pairs=2, vocab_size=32)  # a = 0.01
    p = skewed.gap_probs()
    g = np.arange(1, 7.0)
    np.testing.assert_allclose(p, g ** -0.99 / (g ** -0.99).sum())
    # Empirically: mean query offset far below the uniform mean.
    task = make_task("mqar", seq_len=256, num_kv_pairs=4, vocab_size=512)
    pos = np.nonzero(task.generate(0, 300)["loss_mask"])[1] - 8
    assert pos.mean() < 0.5 * (256 - 8) / 2


@pytest.mark.parametrize("settings", [
    dict(seq_len=15, num_kv_pairs=2),                   # odd length
    dict(seq_len=16, num_kv_pairs=5, vocab_size=64),    # 4K > L
    dict(seq_len=64, num_kv_pairs=4, vocab_size=64),    # V <= L
    dict(seq_len=64, num_kv_pairs=4, colour="red"),     # unknown setting
])
def test_mqar_bad_settings_raise(settings):
    with pytest.raises(ValueError):
        make_task("mqar", **settings)


def test_unknown_task_raises():
    with pytest.raises(ValueError, match="Unknown task"):
        make_task("nope")

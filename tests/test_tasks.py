"""Task generators against hand-worked examples: positions, labels and which positions are
scored, plus the invariants each task definition promises."""

import re

import numpy as np
import pytest

from kimi_jax.tasks import IGNORE, make_task
from kimi_jax.tasks.base import from_labels
from kimi_jax.tasks.mqar import distinct_uniform, layout, weighted_without_replacement


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


def _chi2(counts, expected):
    """Pearson's statistic and a bound about 7 standard deviations above its mean (dof)."""
    counts, expected = np.asarray(counts, float).ravel(), np.asarray(expected, float).ravel()
    dof = counts.size - 1
    return ((counts - expected) ** 2 / expected).sum(), dof + 7 * np.sqrt(2 * dof)


def _tuple_counts(rows, m):
    """Counts of each ordered tuple in rows [n, k] of ints < m, as a flat array of m ** k."""
    code = (rows * m ** np.arange(rows.shape[1])[::-1]).sum(axis=1)
    return np.bincount(code, minlength=m ** rows.shape[1])


@pytest.mark.parametrize("k,m", [(3, 5), (4, 4), (2, 40)])
def test_distinct_uniform_is_uniform_over_ordered_tuples(k, m):
    # Every ordered k-tuple of distinct values equally likely, tuples with a repeat never; (3, 5)
    # and (4, 4) mostly take the redraw path, (2, 40) mostly keeps the first draw.
    n = 60_000
    rows = distinct_uniform(np.random.RandomState(0), n, k, m)
    assert rows.shape == (n, k) and rows.min() >= 0 and rows.max() < m
    counts = _tuple_counts(rows, m)
    tuples = np.array(np.unravel_index(np.arange(m ** k), (m,) * k)).T
    distinct = np.array([len(set(t)) == k for t in tuples])
    assert counts[~distinct].sum() == 0
    stat, bound = _chi2(counts[distinct], np.full(distinct.sum(), n / distinct.sum()))
    assert stat < bound, (stat, bound)


def test_weighted_without_replacement_matches_sequential_draws():
    # P(i, j, l) = p_i * p_j / (1 - p_i) * p_l / (1 - p_i - p_j), the law of choice(replace=False, p).
    p = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    n, k, m = 60_000, 3, len(p)
    rows = weighted_without_replacement(np.random.RandomState(1), n, k, p)
    counts = _tuple_counts(rows, m)
    expected = np.zeros(m ** k)
    for i in range(m):
        for j in range(m):
            for q in range(m):
                if len({i, j, q}) == k:
                    expected[(i * m + j) * m + q] = p[i] * p[j] / (1 - p[i]) * p[q] / (1 - p[i] - p[j])
    np.testing.assert_allclose(expected.sum(), 1.0)
    assert counts[expected == 0].sum() == 0
    stat, bound = _chi2(counts[expected > 0], n * expected[expected > 0])
    assert stat < bound, (stat, bound)


def _gaps_by_slot(batch, K):
    """gaps [N, K] read back from generated examples: gap of the key in context slot s."""
    x, m = batch["inputs"], batch["loss_mask"]
    qpos = np.sort(np.nonzero(m)[1].reshape(len(x), K), axis=1)
    qkeys = np.take_along_axis(x, qpos, axis=1)
    hit = qkeys[:, None, :] == x[:, 0:2 * K:2, None]        # [N, slot, query]
    assert (hit.sum(axis=2) == 1).all()
    return (np.take_along_axis(qpos, hit.argmax(axis=2), axis=1) - 2 * K) // 2


@pytest.mark.parametrize("power_a", [0.01, 0.5])
def test_mqar_query_gaps_follow_sequential_power_law(power_a):
    # The first key's gap is the first draw: law p. The second key's gap is the second draw:
    # P(j) = sum_{i != j} p_i p_j / (1 - p_i).
    K, N = 3, 30_000
    task = make_task("mqar", seq_len=32, num_kv_pairs=K, vocab_size=64, power_a=power_a)
    p = task.gap_probs()
    gaps = _gaps_by_slot(task.generate(7, N), K)
    assert len(p) == 13 and gaps.min() >= 0 and gaps.max() < len(p)
    assert (np.sort(gaps, axis=1)[:, 1:] != np.sort(gaps, axis=1)[:, :-1]).all()
    second = p * ((p / (1 - p)).sum() - p / (1 - p))
    for slot, law in ((0, p), (1, second)):
        stat, bound = _chi2(np.bincount(gaps[:, slot], minlength=len(p)), N * law)
        assert stat < bound, (slot, stat, bound)


@pytest.mark.parametrize("L,K,V", [(32, 4, 64), (32, 8, 34)])
def test_mqar_keys_and_values_uniform_in_each_slot(L, K, V):
    # Per context slot, each key (value) equally likely; (32, 8, 34) has K * K > V / 2, where
    # most rows are redrawn without replacement.
    N = 20_000
    x = make_task("mqar", seq_len=L, num_kv_pairs=K, vocab_size=V).generate(11, N)["inputs"]
    for tokens, lo, hi in ((x[:, 0:2 * K:2], 1, V // 2), (x[:, 1:2 * K:2], V // 2, V)):
        assert tokens.min() >= lo and tokens.max() < hi
        srt = np.sort(tokens, axis=1)
        assert (srt[:, 1:] != srt[:, :-1]).all()
        counts = np.stack([np.bincount(tokens[:, s] - lo, minlength=hi - lo) for s in range(K)])
        stat, bound = _chi2(counts, np.full(counts.shape, N / (hi - lo)))
        assert stat < bound, (stat, bound)


@pytest.mark.parametrize("num_passes,random_fill", [(1, True), (2, False)])
def test_mqar_queries_each_key_once_at_scale(num_passes, random_fill):
    L, K, V, N = 256, 16, 8192, 1024
    C = 2 * K * num_passes
    b = make_task("mqar", seq_len=L, num_kv_pairs=K, vocab_size=V, num_passes=num_passes,
                  random_non_queries=random_fill).generate(3, N)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    assert (m.sum(axis=1) == K).all() and not m[:, :C].any()
    keys, values = x[:, 0:2 * K:2], x[:, 1:2 * K:2]
    np.testing.assert_array_equal(x[:, :C], np.tile(x[:, :2 * K], num_passes))
    qpos = np.nonzero(m)[1].reshape(N, K)
    assert ((qpos - C) % 2 == 0).all()
    qkeys = np.take_along_axis(x, qpos, axis=1)
    np.testing.assert_array_equal(np.sort(qkeys, axis=1), np.sort(keys, axis=1))
    slot = (qkeys[:, :, None] == keys[:, None, :]).argmax(axis=2)
    np.testing.assert_array_equal(np.take_along_axis(y, qpos, axis=1),
                                  np.take_along_axis(values, slot, axis=1))
    if not random_fill:
        filler = np.ones_like(m)
        filler[:, :C] = False
        filler[m] = False
        assert (x[filler] == 0).all()


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


# ------------------------------------------------------------------------------- Kimi tasks

def test_palindrome_hand_example():
    b = make_task("palindrome", seq_len=8, vocab_size=10).generate(0, 50)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    data = x[:, :4]
    assert ((data >= 2) & (data < 10)).all() and (x[:, 4] == 1).all()
    np.testing.assert_array_equal(x[:, 5:], data[:, ::-1][:, :3])       # xn .. x2
    np.testing.assert_array_equal(m[0], [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(y[:, 4:], data[:, ::-1])              # SEP->xn .. x2->x1


def test_mqar_kimi_queries_after_separator():
    task = make_task("mqar_kimi", seq_len=16, vocab_size=32)             # K = 5
    b = task.generate(0, 20)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    assert task.num_kv_pairs == 5 and (x[:, 10] == 1).all()
    np.testing.assert_array_equal(np.flatnonzero(m[0]), np.arange(11, 16))
    for i in range(20):
        keys, values = x[i, 0:10:2], x[i, 1:10:2]
        assert ((keys >= 2) & (keys < 17)).all() and ((values >= 17) & (values < 32)).all()
        assert sorted(x[i, 11:]) == sorted(keys)                          # each key once
        lookup = dict(zip(keys, values))
        assert [lookup[k] for k in x[i, 11:]] == list(y[i, 11:])


def test_stack_pops_return_the_top_of_their_stack():
    task = make_task("stack", seq_len=300, vocab_size=20, num_stacks=3)
    b = task.generate(0, 10)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    assert m.sum() > 50
    for i in range(10):
        stacks = {s: [] for s in range(3, 6)}
        for j in range(0, 300 - 2, 3):
            op, sid, val = x[i, j:j + 3]
            assert op in (1, 2) and 3 <= sid < 6 and 6 <= val < 20
            assert m[i, j + 1] == (op == 2)
            if op == 1:
                stacks[sid].append(val)
            else:
                assert stacks[sid].pop() == val == y[i, j + 1]


def test_stack_hand_sequence_from_layout():
    # With one stack and pop_prob 1, ops alternate PUSH a, POP a, PUSH b, POP b, ...
    b = make_task("stack", seq_len=12, vocab_size=8, num_stacks=1, pop_prob=1.0).generate(0, 1)
    x, m = b["inputs"][0], b["loss_mask"][0]
    assert list(x[[0, 3, 6, 9]]) == [1, 2, 1, 2] and (x[[1, 4, 7, 10]] == 3).all()
    assert x[2] == x[5] and x[8] == x[11]
    np.testing.assert_array_equal(np.flatnonzero(m), [4, 10])


# ----------------------------------------------------------------------------- Mamba tasks

def test_selective_copying_hand_example():
    b = make_task("selective_copying", seq_len=12, num_tokens=3, vocab_size=6).generate(0, 30)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    for i in range(30):
        region = x[i, :9]
        data = region[region != 0]
        assert len(data) == 3 and ((data >= 2) & (data < 6)).all()
        assert x[i, 9] == 1
        np.testing.assert_array_equal(x[i, 10:], data[:2])
        np.testing.assert_array_equal(y[i, 9:], data)
        np.testing.assert_array_equal(np.flatnonzero(m[i]), [9, 10, 11])


@pytest.mark.parametrize("num_triggers", [1, 3])
def test_induction_heads_answer_follows_every_trigger(num_triggers):
    L = 2 * num_triggers + 2  # tightest length: pairs must tile without overlap
    b = make_task("induction_heads", seq_len=L, vocab_size=5,
                  num_triggers=num_triggers).generate(0, 200)
    x, y, m = b["inputs"], b["targets"], b["loss_mask"]
    assert (m.sum(1) == 1).all() and m[:, -1].all() and (x[:, -1] == 0).all()
    for i in range(200):
        trig = np.flatnonzero(x[i, :-1] == 0)
        assert len(trig) == num_triggers
        assert (x[i, trig + 1] == y[i, -1]).all() and y[i, -1] != 0
    b2 = make_task("induction_heads", seq_len=64, vocab_size=16).generate(0, 500)
    first = np.argmax(b2["inputs"] == 0, axis=1)
    assert first.min() < 8 and first.max() > 50                         # trigger anywhere


# --------------------------------------------------------------------------- text tasks

from kimi_jax.tasks.niah import VARIANTS  # noqa: E402
from kimi_jax.tasks.text import decode, fill, score_generation  # noqa: E402


def test_fill_is_exact():
    assert fill(["aaa", "bb", "cccc"], 6) == ["aaa", "bb"]
    assert fill(["aaa", "bb", "cccc"], 8) == ["aaa", "bb", "c"]
    assert fill(["aaa", "bb", "cccc"], 7) == ["aaa", "bb "]
    assert fill(["aaaaa"], 3) == ["aaa"]
    assert " ".join(fill(["x" * 9] * 5, 37)) == " ".join(["x" * 9] * 3) + " " + "x" * 7


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_niah_prompt_needles_and_answer(variant):
    task = make_task(variant, seq_len=1024)
    hay, ktype, vtype, n_keys, n_values, n_queries = VARIANTS[variant]
    b = task.generate(7, 3)
    texts = task.texts(7, 3)
    for i, (prompt, answer) in enumerate(texts):
        full = decode(np.append(b["inputs"][i], b["targets"][i, -1]))
        assert full == prompt + answer and len(prompt) == task.prompt_len
        np.testing.assert_array_equal(np.flatnonzero(b["loss_mask"][i]),
                                      np.arange(task.prompt_len - 1, 1024))
        refs = task.references(answer)
        assert len(refs) == n_values * n_queries
        value_len = 7 if vtype == "numbers" else 36
        assert all(len(r) == value_len for r in refs)
        # Each answer value sits in exactly one needle, whose key is among the queried keys.
        for r in refs:
            hits = re.findall(f"One of the special magic {vtype} for (\\S+) is: {r}\\.", prompt)
            assert len(hits) == 1 and prompt.count(r) == 1
            assert hits[0] in prompt.split("\nWhat ")[1]                     # a queried key
        needles = prompt.count("One of the special magic")
        if hay == "needle":
            assert needles > 5
        else:
            assert needles == n_keys * n_values
        assert (hay == "noise") == ("The grass is green." in prompt)
        question = prompt[prompt.index("\nWhat"):]
        assert question.endswith(" is" if n_values * n_queries == 1 else " are")


def test_niah_too_short_raises():
    with pytest.raises(ValueError, match="too short"):
        make_task("niah_multiquery", seq_len=300)


def test_phonebook_lookup():
    task = make_task("phonebook", seq_len=400)
    for prompt, answer in task.texts(0, 20):
        assert len(prompt) + len(answer) == 401
        book, shots, query = prompt.strip("\n").split("\n\n")
        entries = dict(line.split(": ") for line in book.split("\n"))
        assert len(entries) == len(book.split("\n")) >= 3                 # distinct names
        assert all(len(v) == 10 and v[0] in "6789" and v.isdigit() for v in entries.values())
        assert all(s.split(": ")[0] in entries for s in shots.split("\n"))
        assert query.endswith(":") and answer == " " + entries[query[:-1]]


def test_score_generation():
    assert score_generation(" 1234567", " 1234567", ["1234567"]) == (1.0, 1.0)
    assert score_generation(" 1234568", " 1234567", ["1234567"]) == (0.0, 0.0)
    assert score_generation(" 2, 1, 3", " 1, 2, 3", ["1", "2", "3"]) == (0.0, 1.0)
    assert score_generation(" AB-cd", " ab-cd", ["ab-cd"]) == (0.0, 1.0)
    assert score_generation(" 1, 9", " 1, 2", ["1", "2"]) == (0.0, 0.5)


def test_every_registered_task_generates_deterministically():
    from kimi_jax.tasks import TASKS
    small = {"mqar": {}, "phonebook": dict(seq_len=400)}
    for name in TASKS:
        settings = small.get(name, dict(seq_len=1024) if name.startswith("niah") else dict(seq_len=64))
        task = make_task(name, **settings)
        a, b = task.generate(5, 3), task.generate(5, 3)
        for k in ("inputs", "targets", "loss_mask"):
            np.testing.assert_array_equal(a[k], b[k])
        assert a["loss_mask"].any(), name

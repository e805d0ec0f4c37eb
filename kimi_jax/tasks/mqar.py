"""Multi-Query Associative Recall (MQAR) in the Zoology form (Arora et al., 2023).

Layout of one example of length L with K key-value pairs (C = 2K context tokens):

    k1 v1 k2 v2 ... kK vK | q . q . . . q . . .
    '---- context C ----' '--- query region L - C ---'

Keys come from [1, V/2) and values from [V/2, V), K distinct of each per example; token 0 is
the filler. Every key is queried exactly once, in random order: key i is written at query-region
offset 2*gap_i, where the K gaps are drawn without replacement from 0..(L-C)/2-1 with
p(gap) ∝ a * (gap + 1) ** (a - 1) (a = `power_a`; 0.01 puts queries near the region start).
The label (value of the queried key) sits at the position of the query key itself, so a model
predicts it as the next token; exactly K positions per example are scored. With
`random_non_queries` every filler 0 becomes a token uniform over the whole vocabulary (collisions
with keys stay unlabeled).

The draws follow Zoology's distributions (keys and values uniform without replacement, gaps
sequentially without replacement with probabilities p, as `RandomState.choice(replace=False,
p=p)` draws them) but are vectorised over all N examples, so the random stream, and hence the
examples of a given `seed`, differ from Zoology's; they stay deterministic in `seed`.
"""

from __future__ import annotations

import numpy as np

from kimi_jax.tasks.base import IGNORE, Task, from_labels, require


class MQAR(Task):
    name = "mqar"

    def __init__(self, seq_len: int = 64, num_kv_pairs: int = 4, vocab_size: int = 8192,
                 power_a: float = 0.01, num_passes: int = 1, random_non_queries: bool = True):
        L, K, V = int(seq_len), int(num_kv_pairs), int(vocab_size)
        require(L % 2 == 0, f"mqar: seq_len must be even, got {L}")
        require(K >= 1, f"mqar: num_kv_pairs must be >= 1, got {K}")
        require(num_passes >= 1, f"mqar: num_passes must be >= 1, got {num_passes}")
        require(V > L, f"mqar: vocab_size ({V}) must exceed seq_len ({L})")
        require(V // 2 - 1 >= K, f"mqar: vocab_size {V} has fewer than {K} keys")
        require(2 * K * num_passes + 2 * K <= L,
                f"mqar: seq_len {L} too short for {K} pairs x {num_passes} passes plus {K} queries")
        require(power_a > 0, f"mqar: power_a must be > 0, got {power_a}")
        super().__init__(vocab_size=V, seq_len=L, settings=dict(
            seq_len=L, num_kv_pairs=K, vocab_size=V, power_a=float(power_a),
            num_passes=int(num_passes), random_non_queries=bool(random_non_queries)))
        self.num_kv_pairs = K
        self.num_passes = int(num_passes)
        self.power_a = float(power_a)
        self.random_non_queries = bool(random_non_queries)

    @property
    def setting(self) -> str:
        return f"L{self.seq_len}_K{self.num_kv_pairs}"

    def gap_probs(self) -> np.ndarray:
        """p(gap) over gap = 0 .. space-1, the power law of the query placement."""
        space = (self.seq_len - self.context_len) // 2
        g = np.arange(1, space + 1, dtype=np.float64)
        p = self.power_a * g ** (self.power_a - 1)
        return p / p.sum()

    @property
    def context_len(self) -> int:
        return 2 * self.num_kv_pairs * self.num_passes

    def _generate(self, rng, num_examples):
        N, L, K, V = num_examples, self.seq_len, self.num_kv_pairs, self.vocab_size
        keys = 1 + distinct_uniform(rng, N, K, V // 2 - 1)
        values = V // 2 + distinct_uniform(rng, N, K, V - V // 2)
        gaps = weighted_without_replacement(rng, N, K, self.gap_probs())
        inputs, labels = layout(keys, values, gaps, L, self.num_passes)
        if self.random_non_queries:
            fill = rng.randint(0, V, size=inputs.shape, dtype=np.int32)
            np.copyto(inputs, fill, where=inputs == 0)
        return from_labels(inputs, labels)


def distinct_uniform(rng: np.random.RandomState, n: int, k: int, m: int) -> np.ndarray:
    """[n, k] rows of k distinct ints from 0..m-1, each row a uniformly random ordered k-tuple
    (the law of `rng.choice(m, k, replace=False)`), without the O(m) work per row of `choice`.

    Rows are drawn i.i.d. uniform and kept when distinct: a kept row is uniform over the distinct
    tuples, and so is a redrawn one, so mixing them stays exact. Rows with a repeat (few when
    k * k << m) are redrawn by `_floyd`, which always succeeds."""
    out = rng.randint(0, m, size=(n, k))
    s = np.sort(out, axis=1)
    repeat = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
    if repeat.size:
        out[repeat] = _floyd(rng, repeat.size, k, m)
    return out


def _floyd(rng: np.random.RandomState, n: int, k: int, m: int) -> np.ndarray:
    """[n, k] uniform ordered k-tuples of distinct ints from 0..m-1 in O(n k^2): Floyd's
    algorithm, one column per step over all rows, gives a uniform k-subset; its column order is
    biased (late columns hold the large fallbacks), so each row is then shuffled."""
    out = np.empty((n, k), dtype=np.int64)
    for i, j in enumerate(range(m - k, m)):
        t = rng.randint(0, j + 1, size=n)
        taken = (out[:, :i] == t[:, None]).any(axis=1)
        out[:, i] = np.where(taken, j, t)
    order = np.argsort(rng.random_sample((n, k)), axis=1)
    return np.take_along_axis(out, order, axis=1)


def weighted_without_replacement(rng: np.random.RandomState, n: int, k: int,
                                 p: np.ndarray) -> np.ndarray:
    """[n, k] rows of k distinct indices into p, drawn one after another without replacement with
    probabilities p renormalised over what is left (the law of `rng.choice(len(p), k,
    replace=False, p=p)`, order included).

    Exponential clocks: item i rings at E_i / p_i with E_i ~ Exp(1); the first ring is item i with
    probability p_i, and by memorylessness each next ring follows p over the items left, so the k
    earliest rings in time order are the sequential draw (the Gumbel-top-k trick in other form)."""
    p = np.asarray(p, dtype=np.float64)
    clocks = -np.log1p(-rng.random_sample((n, len(p)))) / p   # Exp(1) / p, rates p
    first = np.argpartition(clocks, k - 1, axis=1)[:, :k]
    order = np.argsort(np.take_along_axis(clocks, first, axis=1), axis=1)
    return np.take_along_axis(first, order, axis=1)


def layout(keys: np.ndarray, values: np.ndarray, gaps: np.ndarray, seq_len: int,
           num_passes: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Place keys/values/gaps [N, K] into inputs [N, L] (filler 0) and labels [N, L] (IGNORE
    except the value of each queried key at the query position)."""
    N, K = keys.shape
    C = 2 * K * num_passes
    if values.shape != (N, K) or gaps.shape != (N, K):
        raise ValueError(f"keys {keys.shape}, values {values.shape}, gaps {gaps.shape} must match")
    if C + 2 * int(gaps.max()) >= seq_len:
        raise ValueError(f"gap {int(gaps.max())} puts a query past seq_len {seq_len}")
    inputs = np.zeros((N, seq_len), dtype=np.int64)
    inputs[:, 0:C:2] = np.tile(keys, num_passes)
    inputs[:, 1:C:2] = np.tile(values, num_passes)
    rows = np.arange(N)[:, None]
    inputs[rows, C + 2 * gaps] = keys
    labels = np.full((N, seq_len), IGNORE, dtype=np.int64)
    labels[rows, C + 2 * gaps] = values
    return inputs, labels

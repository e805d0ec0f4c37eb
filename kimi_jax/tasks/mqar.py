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
with keys stay unlabeled). The draws happen in Zoology's order (keys, values, gaps per example,
then filler) from a RandomState seeded with `seed`.
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
        key_choices = np.arange(1, V // 2)
        value_choices = np.arange(V // 2, V)
        keys = np.stack([rng.choice(key_choices, size=K, replace=False) for _ in range(N)])
        values = np.stack([rng.choice(value_choices, size=K, replace=False) for _ in range(N)])
        p = self.gap_probs()
        gap_choices = np.arange(len(p))
        gaps = np.stack([rng.choice(gap_choices, size=K, replace=False, p=p) for _ in range(N)])
        inputs, labels = layout(keys, values, gaps, L, self.num_passes)
        if self.random_non_queries:
            fill = rng.randint(0, V, size=inputs.shape)
            inputs = np.where(inputs == 0, fill, inputs)
        return from_labels(inputs, labels)


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
    kvs = np.zeros((N, C), dtype=np.int64)
    kvs[:, 0::2] = np.tile(keys, num_passes)
    kvs[:, 1::2] = np.tile(values, num_passes)
    queries = np.zeros((N, seq_len - C), dtype=np.int64)
    np.put_along_axis(queries, 2 * gaps, keys, axis=1)
    labels = np.full((N, seq_len), IGNORE, dtype=np.int64)
    np.put_along_axis(labels, C + 2 * gaps, values, axis=1)
    return np.concatenate([kvs, queries], axis=1), labels

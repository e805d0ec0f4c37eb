"""Kimi Linear's synthetic tasks (Kimi Team 2025, §5.1): Palindrome, MQAR with a separator, Stack.

The paper fixes the layouts but not vocabulary sizes, pair counts or stack depth; the defaults
here are ours and recorded in each task's `settings`. Token 0 is padding (never scored) and the
low ids are the special tokens of each task. All three are next-token tasks over one sequence
`s` of length L + 1: `inputs = s[:-1]`, labels at the scored positions.
"""

from __future__ import annotations

import numpy as np

from kimi_jax.tasks.base import IGNORE, Task, from_labels, require

PAD, SEP = 0, 1


class Palindrome(Task):
    """`x1 .. xn <SEP> xn .. x1`: reproduce the tokens reversed after the separator.

    n = L / 2 data tokens uniform over [2, V). Inputs [x1..xn, SEP, xn..x2]; scored are the n
    positions from SEP on (their next token is the reversal), so L = 2n."""

    name = "palindrome"

    def __init__(self, seq_len: int = 256, vocab_size: int = 128):
        require(seq_len >= 2 and seq_len % 2 == 0, f"palindrome: seq_len must be even >= 2, got {seq_len}")
        require(vocab_size >= 3, f"palindrome: vocab_size must be >= 3, got {vocab_size}")
        super().__init__(vocab_size=vocab_size, seq_len=seq_len,
                         settings=dict(seq_len=int(seq_len), vocab_size=int(vocab_size)))

    def _generate(self, rng, num_examples):
        n = self.seq_len // 2
        x = rng.randint(2, self.vocab_size, size=(num_examples, n))
        s = np.concatenate([x, np.full((num_examples, 1), SEP), x[:, ::-1]], axis=1)
        labels = np.full((num_examples, self.seq_len), IGNORE)
        labels[:, n:] = s[:, n + 1:]
        return from_labels(s[:, :-1], labels)


class KimiMQAR(Task):
    """`k1 v1 .. kK vK <SEP> q1 .. qQ [PAD..]`: the value of each query key is its label.

    Queries follow the separator back to back (the paper's example `A 1 C 3 <SEP> C A` -> targets
    `3 1`), so the label at a query is not the next input token. Keys are K distinct ids from
    [2, 2 + (V-2)/2), values from the upper half (drawn with replacement: two keys may share a
    value). `num_queries` distinct keys are queried in random order; by default K = (L - 1) // 3
    and every key is queried once, so the task grows with L as in the paper's length sweep."""

    name = "mqar_kimi"

    def __init__(self, seq_len: int = 256, vocab_size: int = 8192, num_kv_pairs: int | None = None,
                 num_queries: int | None = None):
        K = (seq_len - 1) // 3 if num_kv_pairs is None else int(num_kv_pairs)
        Q = K if num_queries is None else int(num_queries)
        require(K >= 1 and 1 <= Q <= K, f"mqar_kimi: need 1 <= num_queries ({Q}) <= num_kv_pairs ({K})")
        require(2 * K + 1 + Q <= seq_len, f"mqar_kimi: {K} pairs + SEP + {Q} queries exceed seq_len {seq_len}")
        require((vocab_size - 2) // 2 >= K, f"mqar_kimi: vocab_size {vocab_size} has fewer than {K} keys")
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, settings=dict(
            seq_len=int(seq_len), vocab_size=int(vocab_size), num_kv_pairs=K, num_queries=Q))
        self.num_kv_pairs, self.num_queries = K, Q

    @property
    def setting(self) -> str:
        return f"L{self.seq_len}_K{self.num_kv_pairs}"

    def _generate(self, rng, num_examples):
        N, L, K, Q = num_examples, self.seq_len, self.num_kv_pairs, self.num_queries
        half = (self.vocab_size - 2) // 2
        keys = np.stack([rng.choice(half, size=K, replace=False) for _ in range(N)]) + 2
        values = rng.randint(2 + half, self.vocab_size, size=(N, K))
        order = np.stack([rng.permutation(K)[:Q] for _ in range(N)])
        inputs = np.full((N, L), PAD)
        inputs[:, 0:2 * K:2], inputs[:, 1:2 * K:2] = keys, values
        inputs[:, 2 * K] = SEP
        q0 = 2 * K + 1
        inputs[:, q0:q0 + Q] = np.take_along_axis(keys, order, axis=1)
        labels = np.full((N, L), IGNORE)
        labels[:, q0:q0 + Q] = np.take_along_axis(values, order, axis=1)
        return from_labels(inputs, labels)


class Stack(Task):
    """Independent LIFO stacks: ops `<PUSH> id x` and `<POP> id x` (x = the popped element).

    Each op picks a stack id uniformly from `num_stacks`; it is a POP with probability `pop_prob`
    when that stack is non-empty, else a PUSH of a value uniform over the value ids. Scored are the
    id tokens of POPs: their next token is the top of that stack. Ids: 0 pad, 1 PUSH, 2 POP,
    stacks [3, 3 + S), values [3 + S, V). Ops are cut at L + 1 tokens."""

    name = "stack"
    PUSH, POP = 1, 2

    def __init__(self, seq_len: int = 256, vocab_size: int = 128, num_stacks: int = 64,
                 pop_prob: float = 0.5):
        require(num_stacks >= 1, f"stack: num_stacks must be >= 1, got {num_stacks}")
        require(vocab_size > 3 + num_stacks, f"stack: vocab_size {vocab_size} leaves no value ids "
                f"after 3 specials and {num_stacks} stack ids")
        require(0.0 <= pop_prob <= 1.0, f"stack: pop_prob must be in [0, 1], got {pop_prob}")
        require(seq_len >= 3, f"stack: seq_len must be >= 3, got {seq_len}")
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, settings=dict(
            seq_len=int(seq_len), vocab_size=int(vocab_size), num_stacks=int(num_stacks),
            pop_prob=float(pop_prob)))
        self.num_stacks, self.pop_prob = int(num_stacks), float(pop_prob)

    def _generate(self, rng, num_examples):
        L, S = self.seq_len, self.num_stacks
        n_ops = -(-(L + 1) // 3)
        ids = rng.randint(0, S, size=(num_examples, n_ops))
        coins = rng.random_sample((num_examples, n_ops))
        pushed = rng.randint(3 + S, self.vocab_size, size=(num_examples, n_ops))
        s = np.zeros((num_examples, 3 * n_ops), dtype=np.int64)
        labels = np.full((num_examples, 3 * n_ops), IGNORE)
        for i in range(num_examples):
            stacks: list[list[int]] = [[] for _ in range(S)]
            for j in range(n_ops):
                sid = ids[i, j]
                if stacks[sid] and coins[i, j] < self.pop_prob:
                    op, x = self.POP, stacks[sid].pop()
                    labels[i, 3 * j + 1] = x
                else:
                    op, x = self.PUSH, int(pushed[i, j])
                    stacks[sid].append(x)
                s[i, 3 * j:3 * j + 3] = (op, 3 + sid, x)
        return from_labels(s[:, :L], labels[:, :L])

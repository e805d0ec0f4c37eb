"""Mamba's selective copying and induction heads (Gu & Dao 2023, §4.1 and App. E.1).

Both are single-sequence next-token tasks; token 0 is the blank / noise token.
"""

from __future__ import annotations

import numpy as np

from kimi_jax.tasks.base import IGNORE, Task, from_labels, require


class SelectiveCopying(Task):
    """`n` data tokens at random positions of a blank region, then `<SEP>`; reproduce them in order.

    Sequence s = region (L - n, blanks 0 with the data tokens at sorted random positions) + SEP +
    d1..dn, inputs = s[:-1]; the n scored positions are SEP and d1..d(n-1) (next tokens d1..dn).
    Ids: 0 blank, 1 SEP, data [2, V) (Mamba: V = 16 including the blank, n = 16, L = 4096)."""

    name = "selective_copying"

    def __init__(self, seq_len: int = 256, num_tokens: int = 16, vocab_size: int = 16):
        require(num_tokens >= 1, f"selective_copying: num_tokens must be >= 1, got {num_tokens}")
        require(vocab_size >= 3, f"selective_copying: vocab_size must be >= 3, got {vocab_size}")
        require(seq_len >= 2 * num_tokens,
                f"selective_copying: seq_len {seq_len} < 2 * num_tokens ({num_tokens})")
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, settings=dict(
            seq_len=int(seq_len), num_tokens=int(num_tokens), vocab_size=int(vocab_size)))
        self.num_tokens = int(num_tokens)

    def _generate(self, rng, num_examples):
        N, L, n = num_examples, self.seq_len, self.num_tokens
        region = L - n
        data = rng.randint(2, self.vocab_size, size=(N, n))
        pos = np.sort(np.stack([rng.choice(region, size=n, replace=False) for _ in range(N)]), axis=1)
        s = np.zeros((N, L + 1), dtype=np.int64)
        np.put_along_axis(s, pos, data, axis=1)
        s[:, region] = 1
        s[:, region + 1:] = data
        labels = np.full((N, L), IGNORE)
        labels[:, region:] = s[:, region + 1:]
        return from_labels(s[:, :-1], labels)


class InductionHeads(Task):
    """Random tokens with a trigger token inserted `num_triggers` times, each time followed by the
    same answer token; the sequence ends with the trigger, whose label is the answer.

    Ids: 0 trigger, others [1, V). Only the last position is scored. Train at one L and evaluate
    at longer L for length extrapolation (Mamba: V = 16, train L = 256, test up to 2^20)."""

    name = "induction_heads"

    def __init__(self, seq_len: int = 256, vocab_size: int = 16, num_triggers: int = 1):
        require(vocab_size >= 3, f"induction_heads: vocab_size must be >= 3, got {vocab_size}")
        require(num_triggers >= 1, f"induction_heads: num_triggers must be >= 1, got {num_triggers}")
        require(seq_len >= 2 * num_triggers + 2,
                f"induction_heads: seq_len {seq_len} too short for {num_triggers} trigger pairs")
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, settings=dict(
            seq_len=int(seq_len), vocab_size=int(vocab_size), num_triggers=int(num_triggers)))
        self.num_triggers = int(num_triggers)

    def _generate(self, rng, num_examples):
        N, L, m = num_examples, self.seq_len, self.num_triggers
        x = rng.randint(1, self.vocab_size, size=(N, L))
        answer = rng.randint(1, self.vocab_size, size=N)
        # Non-overlapping trigger pairs in [0, L - 1): choose m slots of a shrunken line and
        # spread them so that slot i occupies positions (p_i, p_i + 1).
        free = L - 1 - 2 * m
        slots = np.sort(np.stack([rng.choice(free + m, size=m, replace=False) for _ in range(N)]), 1)
        starts = slots + np.arange(m)  # each earlier pair pushes later ones by one position
        for i in range(N):
            x[i, starts[i]] = 0
            x[i, starts[i] + 1] = answer[i]
        x[:, -1] = 0
        labels = np.full((N, L), IGNORE)
        labels[:, -1] = answer
        return from_labels(x, labels)

"""Phonebook lookup (Jelassi et al. 2024, "Repeat After Me"), byte-level and fixed-length.

A book of `"{First Last}: {number}"` lines (10-digit numbers whose first digit is 6-9, names drawn
by census frequency from the `names` package lists, all distinct), then two entries of the book as
few-shot examples, then `"{name}:"` of a third entry; the answer is `" {number}"`. The book holds
as many entries as fit in seq_len; the prompt is left-padded with newlines to its exact length.
"""

from __future__ import annotations

import functools

import numpy as np

from kimi_jax.tasks.base import require
from kimi_jax.tasks.text import TextTask, name_table

NUMBER_LEN = 10


class Phonebook(TextTask):
    name = "phonebook"

    def __init__(self, seq_len: int = 512, min_entries: int = 3):
        first, last = name_table("first")[0], name_table("last")[0]
        longest = max(map(len, first)) + 1 + max(map(len, last)) + 2 + NUMBER_LEN
        super().__init__(seq_len=seq_len, answer_len=1 + NUMBER_LEN,
                         settings=dict(seq_len=int(seq_len), min_entries=int(min_entries)))
        require(min_entries >= 3, f"phonebook: min_entries must be >= 3, got {min_entries}")
        self.min_entries = int(min_entries)
        # Worst case: the few-shot block repeats two entries, plus the query name and separators.
        require(self.prompt_len >= (min_entries + 3) * (longest + 1) + 4,
                f"phonebook: seq_len {seq_len} may hold fewer than {min_entries} entries")

    @property
    def setting(self) -> str:
        return str(self.seq_len)

    def _name(self, rng) -> str:
        """First and last name, each drawn by census frequency (inverse-CDF sampling)."""
        (first, cf), (last, cl) = _cdf("first"), _cdf("last")
        u = rng.random_sample(2)
        i = min(int(np.searchsorted(cf, u[0])), len(first) - 1)
        j = min(int(np.searchsorted(cl, u[1])), len(last) - 1)
        return f"{first[i]} {last[j]}"

    def _entry(self, rng, taken: set[str]) -> tuple[str, str]:
        while True:
            name = self._name(rng)
            if name not in taken:
                taken.add(name)
                digits = rng.randint(0, 10, NUMBER_LEN - 1)
                return name, str(rng.randint(6, 10)) + "".join(map(str, digits))

    def _example(self, rng):
        taken: set[str] = set()
        shots = [self._entry(rng, taken) for _ in range(3)]  # two examples, then the query
        tail = ("\n\n" + "\n".join(f"{n}: {v}" for n, v in shots[:2]) + "\n\n" + shots[2][0] + ":")
        budget = self.prompt_len - len(tail)
        lines = [f"{n}: {v}" for n, v in shots]
        used = sum(map(len, lines)) + len(lines) - 1
        while True:
            line = "{}: {}".format(*self._entry(rng, taken))
            if used + 1 + len(line) > budget:
                break
            lines.append(line)
            used += 1 + len(line)
        lines = [lines[i] for i in rng.permutation(len(lines))]
        book = "\n".join(lines)
        prompt = "\n" * (budget - len(book)) + book + tail
        return prompt, " " + shots[2][1]


@functools.cache
def _cdf(kind: str) -> tuple[tuple[str, ...], np.ndarray]:
    names, p = name_table(kind)
    return names, np.cumsum(p)

"""Needle-in-a-haystack in RULER's form (Hsieh et al. 2024), offline and byte-level.

Eight variants (RULER `synthetic.yaml`): S-NIAH-1/2/3, MK-NIAH-1/2/3, MV-NIAH and MQ-NIAH, with
RULER's needle sentence, base-model prompt, keys (wonderwords `adjective-noun`, or uuids) and
values (7-digit numbers or uuids). The haystacks are RULER's noise sentences, all-distractor
needles, or, where RULER uses Paul Graham essays (a download), locally generated synthetic prose:
those variants are labelled `essay=synthetic` in their settings and are not RULER-identical.
The prompt is sized so that prompt + answer is exactly seq_len + 1 bytes; the answer is
" v1" or " v1, v2, ..." (values of the queried keys in needle order).
"""

from __future__ import annotations

import numpy as np

from kimi_jax.tasks.base import require
from kimi_jax.tasks.text import (TextTask, fill, noise_sentences, prose_sentences, random_number,
                                 random_uuid, random_word_key)

# name: (haystack, key type, value type, keys, values per key, queries)
VARIANTS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
RANDOM = {"words": random_word_key, "numbers": random_number, "uuids": random_uuid}
VALUE_LEN = {"numbers": 7, "uuids": 36}
DEPTHS = np.round(np.linspace(0, 100, 40)).astype(int)  # RULER's essay insertion depths, %
NEEDLE = "One of the special magic {type} for {key} is: {value}."
SINGLE = ("A special magic {t} is hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the {t} afterwards.\n")
MULTI = ("Some special magic {t} are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the {t} afterwards.\n")
QUESTION_SINGLE = ("\nWhat is the special magic {t} for {q} mentioned in the provided text? "
                   "The special magic {t} for {q} mentioned in the provided text is")
QUESTION_MULTI = ("\nWhat are all the special magic {t} for {q} mentioned in the provided text? "
                  "The special magic {t} for {q} mentioned in the provided text are")


class NIAH(TextTask):
    """One RULER NIAH variant at one context length (seq_len bytes)."""

    def __init__(self, variant: str, seq_len: int = 1024):
        if variant not in VARIANTS:
            raise ValueError(f"Unknown NIAH variant {variant!r}; expected one of {sorted(VARIANTS)}")
        self.name = variant
        hay, ktype, vtype, n_keys, n_values, n_queries = VARIANTS[variant]
        self.haystack, self.key_type, self.value_type = hay, ktype, vtype
        self.num_keys, self.num_values, self.num_queries = n_keys, n_values, n_queries
        n_answers = n_values * n_queries
        answer_len = 1 + n_answers * VALUE_LEN[vtype] + 2 * (n_answers - 1)
        settings = dict(seq_len=int(seq_len))
        if hay == "essay":
            settings["essay"] = "synthetic"
        super().__init__(seq_len=seq_len, answer_len=answer_len, settings=settings)
        self.singular = n_answers == 1
        self.type_word = vtype[:-1] if self.singular else vtype
        # Smallest context that holds the needles and one haystack sentence: checked up front.
        needle_len = len(NEEDLE.format(type=vtype, key="x" * 36, value="x" * VALUE_LEN[vtype]))
        longest_query = ", ".join(["x" * 40] * n_queries) + (", and" if n_queries > 1 else "")
        fixed = len(self._header()) + len(self._question(longest_query))
        require(self.prompt_len >= fixed + n_keys * n_values * (needle_len + 1) + 16,
                f"{variant}: seq_len {seq_len} is too short for the prompt and needles")

    @property
    def setting(self) -> str:
        return str(self.seq_len)

    def _header(self) -> str:
        return (SINGLE if self.singular else MULTI).format(t=self.type_word)

    def _question(self, query: str) -> str:
        return (QUESTION_SINGLE if self.singular else QUESTION_MULTI).format(t=self.type_word, q=query)

    def _needle(self, key: str, value: str) -> str:
        return NEEDLE.format(type=self.value_type, key=key, value=value)

    def _example(self, rng):
        keys: list[str] = []
        while len(keys) < self.num_keys:
            k = RANDOM[self.key_type](rng)
            if k not in keys:
                keys.append(k)
        values = [[RANDOM[self.value_type](rng) for _ in range(self.num_values)] for _ in keys]
        needles = [self._needle(k, v) for k, vs in zip(keys, values) for v in vs]
        needles = [needles[i] for i in rng.permutation(len(needles))]
        asked = sorted(rng.choice(self.num_keys, size=self.num_queries, replace=False))
        asked = [asked[i] for i in rng.permutation(len(asked))]
        queries = [keys[i] for i in asked]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        # Answer: values of the queried keys, each key's values in needle order.
        order = {n: i for i, n in enumerate(needles)}
        answers = [v for i in asked
                   for v in sorted(values[i], key=lambda v, k=keys[i]: order[self._needle(k, v)])]
        answer = " " + ", ".join(answers)

        header, question = self._header(), self._question(query)
        budget = self.prompt_len - len(header) - len(question)
        context = self._context(rng, needles, set(keys), budget)
        return header + context + question, answer

    def _context(self, rng, needles: list[str], keys: set[str], budget: int) -> str:
        """Haystack sentences with the needles inserted, exactly `budget` characters."""
        sep = " " if self.haystack == "essay" else "\n"
        hay_budget = budget - sum(len(n) + len(sep) for n in needles)
        # Over-generate sentences (every sentence is longer than 8 characters), keep what fits.
        count = hay_budget // 8 + 1
        if self.haystack == "noise":
            sentences = noise_sentences(rng, count)
        elif self.haystack == "essay":
            sentences = prose_sentences(rng, min(count, hay_budget // 20 + 1))
        else:
            sentences = self._distractors(rng, keys, min(count, hay_budget // 40 + 1))
        hay = fill(sentences, hay_budget, sep)
        if self.haystack == "essay":  # RULER: sorted insertion depths, sentence boundaries
            depths = rng.choice(DEPTHS, size=len(needles), replace=False)
            at = sorted(int(len(hay) * d / 100) for d in depths)
        else:  # RULER: random sentence indices
            at = sorted(rng.choice(len(hay) + 1, size=len(needles), replace=len(hay) + 1 < len(needles)))
        for offset, (pos, needle) in enumerate(zip(at, needles)):
            hay.insert(pos + offset, needle)
        return sep.join(hay)

    def _distractors(self, rng, keys: set[str], count: int) -> list[str]:
        out = []
        while len(out) < count:
            k = RANDOM[self.key_type](rng)
            if k not in keys:
                out.append(self._needle(k, RANDOM[self.value_type](rng)))
        return out

    def references(self, answer: str) -> list[str]:
        return [v.strip() for v in answer.split(",")]

"""Text pieces of the byte-level tasks (needle-in-a-haystack, phonebook): the byte codec, the
RULER word keys, the synthetic haystacks and the name lists, all offline and deterministic.

A text task encodes one string `prompt + answer` of L + 1 bytes (ASCII only, so one byte per
character) as a next-token task: the answer positions are scored, and a greedy generation of
`answer_len` tokens from the first `prompt_len` tokens is the generation-mode evaluation.
"""

from __future__ import annotations

import functools
import os
import uuid

import numpy as np

from kimi_jax.data.tokenizers import ByteTokenizer
from kimi_jax.tasks.base import IGNORE, Task, from_labels, require

TOKENIZER = ByteTokenizer()  # the project's byte-level tokenizer: UTF-8 bytes after 3 specials
BYTE_VOCAB = TOKENIZER.vocab_size


def encode(text: str) -> np.ndarray:
    """ASCII text -> token ids [len] (one per character)."""
    if not text.isascii():
        raise ValueError(f"text tasks are ASCII-only; got {text[:40]!r}...")
    return TOKENIZER.encode(text)


def decode(ids) -> str:
    """Token ids -> text, one character per id: ids that are not bytes (specials, or ids past the
    byte range of a model with a larger vocab) become U+FFFD so lengths and positions survive."""
    off = TOKENIZER.offset
    return "".join(chr(int(i) - off) if off <= int(i) < off + 256 else "\ufffd" for i in ids)


def _word_file(package: str, *parts: str) -> list[str]:
    module = __import__(package)
    path = os.path.join(os.path.dirname(module.__file__), *parts)
    with open(path, encoding="utf-8") as f:
        return [w.strip() for w in f if w.strip()]


def random_word_key(rng) -> str:
    """RULER's word key `adjective-noun`, uniform over the wonderwords adjective x noun lists
    (RULER materialises the sorted product; sampling each part uniformly is the same law)."""
    adj, noun = vocabulary("adjective"), vocabulary("noun")
    return f"{adj[rng.randint(len(adj))]}-{noun[rng.randint(len(noun))]}"


@functools.cache
def vocabulary(kind: str) -> tuple[str, ...]:
    """Plain wonderwords words of one part of speech (for the synthetic prose)."""
    files = {"adjective": "adjectivelist.txt", "noun": "nounlist.txt", "verb": "verblist.txt"}
    if kind not in files:
        raise ValueError(f"Unknown word kind {kind!r}; expected one of {sorted(files)}")
    return tuple(w for w in _word_file("wonderwords", "assets", files[kind]) if _plain(w))


def _plain(word: str) -> bool:
    return word.isascii() and word.replace("-", "").isalpha()


@functools.cache
def name_table(kind: str) -> tuple[tuple[str, ...], np.ndarray]:
    """(names, probabilities) from the `names` package's census lists (kind: first, last),
    truncated like `names.get_name` to the first 90% of cumulative frequency."""
    files = {"first": ("dist.male.first", "dist.female.first"), "last": ("dist.all.last",)}
    if kind not in files:
        raise ValueError(f"Unknown name kind {kind!r}; expected one of {sorted(files)}")
    weights: dict[str, float] = {}
    for fname in files[kind]:
        for line in _word_file("names", fname):
            name, freq, cumulative, _ = line.split()
            if float(cumulative) - float(freq) < 90.0:
                key = name.capitalize()
                weights[key] = weights.get(key, 0.0) + float(freq)
    names = tuple(sorted(weights))
    p = np.array([weights[n] for n in names])
    return names, p / p.sum()


def random_number(rng) -> str:
    """RULER's number value: 7 digits, uniform in [10^6, 10^7)."""
    return str(rng.randint(10**6, 10**7))


def random_uuid(rng) -> str:
    """RULER's uuid value: a version-4 UUID from 128 random bits."""
    bits = int.from_bytes(rng.bytes(16), "big")
    return str(uuid.UUID(int=bits, version=4))


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def noise_sentences(rng, count: int) -> list[str]:
    """RULER's noise haystack: the same five sentences repeated."""
    del rng
    return [NOISE] * count


def prose_sentences(rng, count: int) -> list[str]:
    """Synthetic prose (an offline stand-in for RULER's essay haystack; not the same task):
    grammatical sentences from the wonderwords adjective/noun/verb lists."""
    adj, noun, verb = vocabulary("adjective"), vocabulary("noun"), vocabulary("verb")
    templates = (
        "The {a} {n} will {v} the {n2}.",
        "Every {n} can {v} a {a} {n2}.",
        "Some {a} {n}s {v} without any {n2}.",
        "Nobody expected the {n} to {v} so {a} a {n2}.",
        "A {a} {n} is easier to {v} than a {a2} {n2}.",
    )
    out = []
    for _ in range(count):
        t = templates[rng.randint(len(templates))]
        out.append(t.format(a=adj[rng.randint(len(adj))], a2=adj[rng.randint(len(adj))],
                            n=noun[rng.randint(len(noun))], n2=noun[rng.randint(len(noun))],
                            v=verb[rng.randint(len(verb))]))
    return out


def fill(sentences, budget: int, sep: str = " ") -> list[str]:
    """Sentences whose `sep`-join is exactly `budget` characters (budget >= 1): the longest prefix
    of `sentences` that fits, then a cut-off piece of the next one (or spaces) for the rest."""
    sentences = iter(sentences)
    out, used = [], 0
    for s in sentences:
        extra = len(s) + (len(sep) if out else 0)
        if used + extra > budget:
            rest = budget - used - (len(sep) if out else 0)
            if rest > 0:
                out.append(s[:rest])
                used = budget
            break
        out.append(s)
        used += extra
    if not out:
        return [" " * budget]
    out[-1] += " " * (budget - used)
    return out


class TextTask(Task):
    """Base of byte-level tasks: subclasses implement `_example(rng) -> (prompt, answer)` with
    len(prompt) + len(answer) == seq_len + 1 and answer length `answer_len` (fixed per task), and
    `references(answer) -> list[str]` (the strings a generation must contain)."""

    mode = "generate"

    def __init__(self, *, seq_len: int, answer_len: int, settings: dict):
        require(seq_len > answer_len, f"{self.name}: seq_len {seq_len} <= answer length {answer_len}")
        super().__init__(vocab_size=BYTE_VOCAB, seq_len=seq_len, settings=settings)
        self.answer_len = int(answer_len)

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt; the generation from it has `answer_len` tokens."""
        return self.seq_len + 1 - self.answer_len

    def _example(self, rng) -> tuple[str, str]:
        raise NotImplementedError

    def references(self, answer: str) -> list[str]:
        return [answer.strip().rstrip(".")]

    def texts(self, seed: int, num_examples: int) -> list[tuple[str, str]]:
        """The (prompt, answer) strings behind `generate(seed, num_examples)`."""
        rng = np.random.RandomState(int(seed) % (2**32))
        return [self._example(rng) for _ in range(num_examples)]

    def _generate(self, rng, num_examples):
        rows = []
        for _ in range(num_examples):
            prompt, answer = self._example(rng)
            if len(prompt) != self.prompt_len or len(answer) != self.answer_len:
                raise AssertionError(f"{self.name}: built prompt {len(prompt)} + answer {len(answer)}"
                                     f" bytes, expected {self.prompt_len} + {self.answer_len}")
            rows.append(encode(prompt + answer))
        s = np.stack(rows)
        labels = np.full((num_examples, self.seq_len), IGNORE)
        labels[:, self.prompt_len - 1:] = s[:, self.prompt_len:]
        return from_labels(s[:, :-1], labels)


def score_generation(generated: str, answer: str, references: list[str]) -> tuple[float, float]:
    """(exact, match_all) of one greedy generation: exact = it equals the answer string;
    match_all = RULER's fraction of references found in it as case-insensitive substrings."""
    found = sum(ref.lower() in generated.lower() for ref in references)
    return float(generated == answer), found / max(len(references), 1)

"""The `Task` interface shared by every synthetic task family.

A task is a deterministic generator of fixed-length token sequences. `generate(seed, n)` returns
NumPy arrays `inputs` [N, L] int32, `targets` [N, L] int32 (the label of the next token at each
position) and `loss_mask` [N, L] bool (the positions that are trained on and scored). Accuracy of a
model on a task is measured per example over `loss_mask`, then averaged over examples (Zoology's
metric), so every task is scored by the same evaluator.
"""

from __future__ import annotations

import numpy as np

IGNORE = -100  # Label of unscored positions in the reference generators (PyTorch convention).


class Task:
    """Base class: subclasses set `name`, `vocab_size`, `seq_len`, `settings` and implement
    `_generate(rng, num_examples)`. `setting` is the short string used as a results key."""

    name: str = ""
    # "teacher_forced": argmax of the full-sequence forward at `loss_mask` positions.
    # "generate": greedy decoding from a prompt (see `kimi_jax.tasks.text`).
    mode: str = "teacher_forced"

    def __init__(self, *, vocab_size: int, seq_len: int, settings: dict):
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.settings = dict(settings)

    @property
    def setting(self) -> str:
        return f"L{self.seq_len}"

    def generate(self, seed: int, num_examples: int) -> dict:
        """`{"inputs", "targets", "loss_mask"}` as NumPy arrays [N, L]; deterministic in `seed`."""
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        rng = np.random.RandomState(int(seed) % (2**32))
        batch = self._generate(rng, int(num_examples))
        check_batch(batch, num_examples, self.seq_len, self.vocab_size, self.name)
        return batch

    def _generate(self, rng: np.random.RandomState, num_examples: int) -> dict:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{type(self).__name__}({args})"


def from_labels(inputs: np.ndarray, labels: np.ndarray) -> dict:
    """Build the task dict from inputs [N, L] and reference labels [N, L] that hold IGNORE where a
    position is not scored. Unscored positions get the next input token as target (0 at the end),
    so a trainer may also supervise every token if it chooses to."""
    inputs = np.asarray(inputs)
    labels = np.asarray(labels)
    if inputs.shape != labels.shape or inputs.ndim != 2:
        raise ValueError(f"inputs and labels must both be [N, L]; got {inputs.shape}, {labels.shape}")
    next_tokens = np.zeros_like(inputs)
    next_tokens[:, :-1] = inputs[:, 1:]
    mask = labels != IGNORE
    targets = np.where(mask, labels, next_tokens)
    return {
        "inputs": inputs.astype(np.int32),
        "targets": targets.astype(np.int32),
        "loss_mask": mask,
    }


def check_batch(batch: dict, num_examples: int, seq_len: int, vocab_size: int, name: str) -> None:
    """Guard every generator's output: shapes, dtypes and token range."""
    for key, dtype in (("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.bool_)):
        arr = batch[key]
        if arr.shape != (num_examples, seq_len) or arr.dtype != dtype:
            raise AssertionError(
                f"{name}: {key} is {arr.dtype}{list(arr.shape)}, "
                f"expected {np.dtype(dtype)}[{num_examples}, {seq_len}]")
    for key in ("inputs", "targets"):
        lo, hi = int(batch[key].min()), int(batch[key].max())
        if lo < 0 or hi >= vocab_size:
            raise AssertionError(f"{name}: {key} out of range [{lo}, {hi}] for vocab {vocab_size}")


def require(cond: bool, message: str) -> None:
    """Raise the ValueError of an invalid task setting."""
    if not cond:
        raise ValueError(message)

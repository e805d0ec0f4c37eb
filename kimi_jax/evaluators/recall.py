"""Accuracy of a model on one task setting: teacher-forced argmax for token tasks, greedy
generation for the byte-level text tasks (NIAH, phonebook)."""

from __future__ import annotations

import numpy as np

from kimi_jax.evaluators.runner import ModelRunner
from kimi_jax.evaluators.scoring import summarize
from kimi_jax.tasks import Task
from kimi_jax.tasks.text import TextTask, decode, score_generation

GENERATION = ("generate", "teacher_forced")


def batches(num_examples: int, batch_size: int):
    """Index arrays of fixed size `batch_size` covering range(num_examples); the last one is
    padded by repeating index 0 (callers drop the padded rows)."""
    for start in range(0, num_examples, batch_size):
        idx = np.arange(start, min(start + batch_size, num_examples))
        yield np.concatenate([idx, np.zeros(batch_size - len(idx), int)]), len(idx)


def evaluate_task(runner: ModelRunner, task: Task, *, num_examples: int, batch_size: int,
                  seed: int, generation: str = "generate") -> dict:
    """Metrics of one task setting on `num_examples` examples of `task.generate(seed, ...)`.

    Always: `accuracy` (Zoology: per example over scored positions, then the mean), `exact`,
    `loss`, `seq_len`. Text tasks: `accuracy` is the exact match of the greedy answer, with
    `token_accuracy` and RULER's `match_all` beside it. generation="teacher_forced" takes the
    exact match from one forward pass instead (identical for greedy decoding: the generation
    equals the answer iff every teacher-forced argmax is right) and leaves out match_all."""
    if generation not in GENERATION:
        raise ValueError(f"Unknown generation {generation!r}; expected one of {GENERATION}")
    data = task.generate(seed, num_examples)
    parts = []
    for idx, n in batches(num_examples, batch_size):
        mask = data["loss_mask"][idx].copy()
        mask[n:] = False  # padded rows are not scored
        parts.append(runner.score(data["inputs"][idx], data["targets"][idx], mask))
    out = summarize(parts)
    out["seq_len"] = task.seq_len
    if task.mode == "generate":
        out["token_accuracy"] = out["accuracy"]
        out["accuracy"] = out["exact"]
        if generation == "generate":
            out.update(generation_scores(runner, task, data, batch_size))
    return out


def generation_scores(runner: ModelRunner, task: TextTask, data: dict, batch_size: int) -> dict:
    """Greedy-decode each answer from its prompt; `exact` and RULER's `match_all` averaged."""
    P, A = task.prompt_len, task.answer_len
    full = np.concatenate([data["inputs"], data["targets"][:, -1:]], axis=1)
    exact, match = [], []
    for idx, n in batches(len(full), batch_size):
        new = runner.greedy(full[idx, :P], A)[:n]
        for row, gen in zip(full[idx[:n]], new):
            answer = decode(row[P:])
            e, m = score_generation(decode(gen), answer, task.references(answer))
            exact.append(e)
            match.append(m)
    return {"accuracy": float(np.mean(exact)), "exact": float(np.mean(exact)),
            "match_all": float(np.mean(match))}

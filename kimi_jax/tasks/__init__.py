"""Synthetic recall tasks: the one registry and `make_task(name, **settings) -> Task`.

Every task returns `{"inputs", "targets", "loss_mask"}` NumPy arrays [N, L] from
`task.generate(seed, num_examples)`; see `kimi_jax.tasks.base`. Token tasks (`mode ==
"teacher_forced"`) are scored by the argmax at the masked positions; byte-level text tasks
(`mode == "generate"`, `kimi_jax.tasks.text`) by greedy generation of the answer.
"""

from __future__ import annotations

import functools
from typing import Callable

from kimi_jax.tasks.base import IGNORE, Task
from kimi_jax.tasks.copying import InductionHeads, SelectiveCopying
from kimi_jax.tasks.kimi import KimiMQAR, Palindrome, Stack
from kimi_jax.tasks.mqar import MQAR
from kimi_jax.tasks.niah import NIAH, VARIANTS
from kimi_jax.tasks.phonebook import Phonebook

TASKS: dict[str, Callable[..., Task]] = {
    "mqar": MQAR,
    "mqar_kimi": KimiMQAR,
    "palindrome": Palindrome,
    "stack": Stack,
    "selective_copying": SelectiveCopying,
    "induction_heads": InductionHeads,
    "phonebook": Phonebook,
    **{variant: functools.partial(NIAH, variant) for variant in VARIANTS},
}


def make_task(name: str, **settings) -> Task:
    """Build the task `name` with keyword `settings` (those of the task class's __init__)."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; expected one of {sorted(TASKS)}")
    try:
        return TASKS[name](**settings)
    except TypeError as e:  # unknown keyword: name the task and its settings
        raise ValueError(f"Bad settings {sorted(settings)} for task {name!r}: {e}") from None


__all__ = ["IGNORE", "TASKS", "Task", "make_task"]

"""Synthetic recall tasks: the one registry and `make_task(name, **settings) -> Task`.

Every task returns `{"inputs", "targets", "loss_mask"}` NumPy arrays [N, L] from
`task.generate(seed, num_examples)`; see `kimi_jax.tasks.base`.
"""

from __future__ import annotations

from kimi_jax.tasks.base import IGNORE, Task
from kimi_jax.tasks.mqar import MQAR

TASKS: dict[str, type[Task]] = {
    "mqar": MQAR,
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

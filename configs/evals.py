"""`config.evals`: what eval.py and the in-training evaluation run (kimi_jax/evaluators).

The suite maps a task name (kimi_jax.tasks.TASKS) to its list of settings, each the keyword
arguments of `make_task`: a preset of `kimi_jax/evaluators/presets.py` ("cpu" by default,
`--config.evals.preset=paper` for the published lengths) updated with `config.evals.suite`.
Settings of the training task (`config.data.task`) start from `config.data.task_kwargs`, so
MQAR is scored on the vocabulary the model was trained on; other token tasks take
`vocab_size = min(task default, model vocab)` unless a setting names it. Byte tasks need
`config.model.vocab_size >= 259` (the byte tokenizer) and are skipped otherwise.
"""

from __future__ import annotations

import ml_collections


def evals_defaults(config: ml_collections.ConfigDict) -> None:
    ev = ml_collections.ConfigDict()
    # Seed of every eval set (far from the small seeds training data uses).
    ev.seed = 987_654_321
    ev.num_examples = 256            # token tasks, per setting
    ev.generate_num_examples = 64    # byte tasks (greedy decoding), per setting
    ev.batch_size = 32
    # "generate": greedy decoding through decode_step; "teacher_forced": the same exact match
    # from one forward pass (no match_all).
    ev.generation = "generate"
    ev.preset = "cpu"
    ev.suite = ml_collections.ConfigDict()  # {task: [make_task kwargs, ...]} over the preset
    # Comma-separated entries eval.py runs (its --tasks flag overrides): suite task names and
    # "train_task" (the training task at its own settings); "" = train_task + the whole suite.
    ev.tasks = ""
    # Decode time per token and cache memory against context length.
    ev.decode_lengths = (128, 512)
    ev.decode_batch_size = 1
    ev.decode_steps = 8
    # In-training evaluation (`kimi_jax.evaluators.run_all`), same syntax as `tasks`.
    ev.train_tasks = "train_task"
    ev.train_num_examples = 128
    config.evals = ev

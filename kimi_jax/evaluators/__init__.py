"""Evaluators shared by eval.py and the training loop.

`evaluate(config, model, names)` runs suite entries of `config.evals` and returns nested results;
`run_all(config, model, step)` is the in-training hook (flat metrics of the training task);
`evaluate_task(runner, task, ...)` scores one task setting; `score_logits`/`summarize` are the
metric on known predictions.
"""

from kimi_jax.evaluators.recall import evaluate_task
from kimi_jax.evaluators.runner import ModelRunner
from kimi_jax.evaluators.scoring import score_logits, summarize
from kimi_jax.evaluators.suite import evals_config, evaluate, run_all, state_bytes_at

__all__ = ["ModelRunner", "evals_config", "evaluate", "evaluate_task", "run_all", "score_logits",
           "state_bytes_at", "summarize"]

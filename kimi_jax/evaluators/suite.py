"""The evaluation suite of a config: which task settings to build for a model, running them, the
cache memory and decode time, and `run_all` for the in-training evaluation."""

from __future__ import annotations

import inspect
import logging

import ml_collections

from kimi_jax.evaluators.presets import suite
from kimi_jax.evaluators.recall import evaluate_task
from kimi_jax.evaluators.runner import ModelRunner
from kimi_jax.model import Model
from kimi_jax.tasks import TASKS, make_task

TRAIN_TASK = "train_task"


def evals_config(config) -> ml_collections.ConfigDict:
    """`config.evals`, or the defaults for a config built before evals existed."""
    if "evals" in config:
        return config.evals
    from configs.evals import evals_defaults

    tmp = ml_collections.ConfigDict()
    evals_defaults(tmp)
    return tmp.evals


def train_task(config) -> tuple[str, dict] | None:
    """(name, settings) of the synthetic task the config trains on, if it trains on one."""
    data = config.get("data")
    if data is None or data.get("kind", "task") not in ("task", "tfds_task"):
        return None
    return data.task, dict(data.get("task_kwargs", {}))


def entries(config, spec: str) -> list[str]:
    """Suite entry names of a comma-separated spec; "" = the training task, then the suite."""
    names = [n for n in spec.split(",") if n]
    if names:
        return names
    return ([TRAIN_TASK] if train_task(config) else []) + list(suite(evals_config(config)))


def task_settings(config, names) -> list[tuple[str, dict]]:
    """(task name, make_task kwargs) for every setting of the named suite entries, in order and
    without repeats."""
    tasks, out = suite(evals_config(config)), []
    trained = train_task(config)
    for name in names:
        if name == TRAIN_TASK:
            if trained is None:
                raise ValueError(f"{TRAIN_TASK!r} asked for, but config.data trains on no task")
            found = [trained]
        elif name in tasks:
            base = trained[1] if trained and trained[0] == name else {}
            found = [(name, {**base, **dict(s)}) for s in tasks[name]]
        else:
            raise ValueError(f"Unknown eval task {name!r}; expected one of {sorted(tasks)} "
                             f"or {TRAIN_TASK!r}")
        out.extend(f for f in found if f not in out)
    return out


def build(name: str, settings: dict, model_vocab: int):
    """(task, None) or (None, reason it cannot run on a model with `model_vocab` tokens)."""
    params = inspect.signature(TASKS[name]).parameters
    if "vocab_size" in params and "vocab_size" not in settings:
        default = params["vocab_size"].default
        settings = {**settings, "vocab_size": min(default, model_vocab)}
    try:
        task = make_task(name, **settings)
    except ValueError as e:
        return None, str(e)
    if task.vocab_size > model_vocab:
        return None, f"task vocab {task.vocab_size} > model vocab {model_vocab}"
    return task, None


def model_vocab(config) -> int:
    return int(config.model.vocab_size)


def position_limit(config) -> int:
    """Positions the model can take (its learned position table's length), 0 = unbounded."""
    return int(config.model.get("max_position_embeddings", 0) or 0)


def positions_needed(task, generation: str) -> int:
    """Positions a setting runs through: its sequence, or for greedy generation the decode
    cache `ModelRunner.greedy` fills (the prompt and every answer token but the last)."""
    if task.mode == "generate" and generation == "generate":
        return max(task.seq_len, task.prompt_len + task.answer_len - 1)
    return task.seq_len


def evaluate(config, model, names=None, *, log=logging.info) -> dict:
    """Run the suite entries `names` (default `config.evals.tasks`) on `model`.

    Returns {"tasks": {task: {setting: metrics}}, "skipped": {task: {setting: reason}},
    "decode": {...}, "memory": {...}} (see eval.py for the files written from it)."""
    ev = evals_config(config)
    names = names or entries(config, ev.tasks)
    runner, limit = ModelRunner(model), position_limit(config)
    results = {"tasks": {}, "skipped": {}}
    for name, settings in task_settings(config, names):
        task, reason = build(name, settings, model_vocab(config))
        key = task.setting if task else ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
        if task is not None and limit and positions_needed(task, ev.generation) > limit:
            task, reason = None, (f"needs {positions_needed(task, ev.generation)} positions; the model's "
                                  f"learned position table has {limit}")
        if task is None:
            log(f"skip {name} {key}: {reason}")
            results["skipped"].setdefault(name, {})[key] = reason
            continue
        n = ev.generate_num_examples if task.mode == "generate" else ev.num_examples
        metrics = evaluate_task(runner, task, num_examples=n, batch_size=ev.batch_size,
                                seed=ev.seed, generation=ev.generation)
        log(f"{name} {key}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        results["tasks"].setdefault(task.name, {})[key] = metrics
    lengths = list(ev.decode_lengths)
    if limit:  # decode timing at L fills a cache of L + decode_steps positions
        for L in [L for L in lengths if L + ev.decode_steps > limit]:
            reason = f"needs {L + ev.decode_steps} positions; the model's learned position table has {limit}"
            log(f"skip decode L{L}: {reason}")
            results["skipped"].setdefault("decode", {})[f"L{L}"] = reason
            lengths.remove(L)
    if not lengths:
        return results
    results["memory"] = memory(config, runner, lengths, formula=isinstance(model, Model))
    results["decode"] = {
        "context_len": lengths,
        "seconds_per_token": [runner.decode_seconds_per_token(L, batch_size=ev.decode_batch_size,
                                                              steps=ev.decode_steps)
                              for L in lengths],
        "batch_size": ev.decode_batch_size,
    }
    return results


def memory(config, runner: ModelRunner, lengths, *, formula: bool = True) -> dict:
    """Decode-cache bytes per sequence: what `init_cache(1, L)` allocates at each length, and with
    `formula` (a model built from config.model) `kimi_jax.summary.cache_bytes(config)`."""
    out = {"context_len": list(lengths),
           "allocated_bytes": [runner.cache_bytes(1, L) for L in lengths]}
    if not formula:
        return out
    from kimi_jax.summary import cache_bytes

    per_token, state = cache_bytes(config)
    out.update(bytes_per_token=int(per_token), state_bytes=int(state))
    return out


def state_bytes_at(memory: dict, seq_len: int) -> float:
    """Cache bytes of one sequence of `seq_len` tokens (formula if known, else interpolated)."""
    if "bytes_per_token" in memory:
        return float(memory["bytes_per_token"] * seq_len + memory["state_bytes"])
    lens, alloc = memory["context_len"], memory["allocated_bytes"]
    if len(lens) < 2:
        return float(alloc[0])
    slope = (alloc[-1] - alloc[0]) / (lens[-1] - lens[0])
    return float(alloc[0] + slope * (seq_len - lens[0]))


def run_all(config, model, step: int | None = None) -> dict:
    """In-training evaluation: flat {"eval/<task>/<setting>/<metric>": value} for the entries of
    `config.evals.train_tasks` (default: the training task at its own settings)."""
    ev = evals_config(config)
    runner = ModelRunner(model)
    out = {}
    for name, settings in task_settings(config, entries(config, ev.train_tasks)):
        task, reason = build(name, settings, model_vocab(config))
        if task is None:
            logging.warning("step %s: cannot evaluate %s %s: %s", step, name, settings, reason)
            continue
        metrics = evaluate_task(runner, task, num_examples=ev.train_num_examples,
                                batch_size=ev.batch_size, seed=ev.seed, generation="teacher_forced")
        for k in ("accuracy", "exact", "loss"):
            out[f"eval/{task.name}/{task.setting}/{k}"] = metrics[k]
    return out

"""Pieces shared by the sweep configs: the trial schedule and its evaluation settings."""

from __future__ import annotations

import ml_collections

# Keys of every trial arg besides the grid keys (see `trial_arg`).
TRIAL_ARGS = dict(trial=False, tiny=False, steps=1000, batch_size=32, eval_examples=1000,
                  decode_timing=True, final_only=False)
TINY = dict(steps=4, batch_size=8, eval_examples=16, decode_timing=False)


def trial_arg(grid_keys, arg) -> str:
    """The arg template of one trial: grid keys as `{key}` placeholders, fixed keys as values."""
    fixed = {k: arg[k] for k in TRIAL_ARGS if k not in ("trial", "tiny") and k not in grid_keys}
    return ",".join(["trial", *(f"{k}={{{k}}}" for k in grid_keys), *(f"{k}={v}" for k, v in fixed.items())])


def schedule(config: ml_collections.ConfigDict, arg, seq_len: int) -> None:
    """AdamW with 5% warmup and cosine decay to 0 over `arg.steps`, weight decay 0.1 (Zoology);
    in-training eval and checkpoints 5 times per run; eval.py on `arg.eval_examples` examples.
    `arg.final_only`: no in-training eval and one checkpoint at the end (eval.py still needs it),
    which saves a compile and the checkpoint writes of short runs."""
    steps = arg.steps
    config.total_steps = steps
    config.data.batch_size = arg.batch_size
    config.optim.update(dict(warmup_steps=max(steps // 20, 1), schedule="cosine", min_lr_ratio=0.0,
                             weight_decay=0.1))
    config.log_every_steps = max(steps // 50, 1)
    every = max(steps // 5, 1) if steps >= 50 else steps
    config.eval_every_steps = config.checkpoint_every_steps = every
    if arg.final_only:
        config.eval_every_steps, config.checkpoint_every_steps, config.keep_checkpoints = 0, steps, 1
    config.evals.num_examples = config.evals.train_num_examples = arg.eval_examples
    config.evals.batch_size = min(config.evals.batch_size, arg.eval_examples)
    config.evals.decode_lengths = (seq_len,) if arg.decode_timing else ()

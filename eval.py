"""Evaluate trained models on the recall suite.

    python eval.py --config configs/<name>.py[:arg] --workdir DIR [--tasks a,b] [--config.x=y]
    python eval.py --config configs/<name>.py --workdir A,B --outdir CMP

For each workdir: loads its latest checkpoint (`kimi_jax.load_model`), runs the suite entries of
`config.evals` (or --tasks: task names of the suite, or "train_task"), and writes DIR/eval/:
results.json ({task: {setting: accuracy in [0, 1]}}), metrics.json (loss per length, exact
match, RULER match_all, cache memory, decode time per token), results.md and PNG plots. With
several workdirs (all built from the same --config) a comparison with one line per model goes
to --outdir (default: the first workdir's eval/compare).
"""

from __future__ import annotations

import json
import logging
import os

from absl import app, flags
from ml_collections import config_flags

from kimi_jax import kernel_settings, logging_utils
from kimi_jax.evaluators import evaluate
from kimi_jax.evaluators.report import write, write_comparison

config_flags.DEFINE_config_file("config", None, "Config file (configs/<name>.py[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Training workdir, or several separated by commas.")
flags.DEFINE_string("tasks", "", "Comma-separated suite entries (default: config.evals.tasks).")
flags.DEFINE_string("outdir", "", "Where the comparison of several workdirs goes.")
flags.DEFINE_bool("reuse", False, "Reuse DIR/eval/metrics.json where it exists instead of evaluating.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def evaluate_workdir(config, workdir: str, names) -> dict:
    from kimi_jax import load_model
    from kimi_jax.checkpoint import Checkpointer

    ckpt = Checkpointer(workdir, async_save=False)
    step = ckpt.latest_step()
    ckpt.close()
    model = load_model(config, workdir)
    logging.info("evaluating %s at step %s", workdir, step)
    with kernel_settings.applied(kernel_settings.parse(config.get("kernel_settings", ""))):
        results = evaluate(config, model, names)
    results["workdir"], results["step"] = os.path.abspath(workdir), step
    return results


def main(argv):
    del argv
    logging.getLogger().setLevel(logging.INFO)
    logging_utils.quiet_library_logs(FLAGS["verbosity"].present)
    config = FLAGS.config
    names = [n for n in FLAGS.tasks.split(",") if n] or None
    workdirs = [w for w in FLAGS.workdir.split(",") if w]
    runs = {}
    for workdir in workdirs:
        outdir = os.path.join(workdir, "eval")
        cached = os.path.join(outdir, "metrics.json")
        if FLAGS.reuse and os.path.exists(cached):
            with open(cached) as f:
                results = json.load(f)
        else:
            results = evaluate_workdir(config, workdir, names)
        label = os.path.basename(os.path.normpath(workdir))
        write(outdir, results, label)
        runs[label if label not in runs else workdir] = results
        print(f"{workdir}: " + json.dumps({t: {s: round(m["accuracy"], 4) for s, m in per.items()}
                                           for t, per in results["tasks"].items()}))
    if len(workdirs) > 1:
        outdir = FLAGS.outdir or os.path.join(workdirs[0], "eval", "compare")
        write_comparison(outdir, runs)
        print(f"comparison of {len(runs)} models in {outdir}")


if __name__ == "__main__":
    app.run(main)

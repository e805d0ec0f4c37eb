"""Grid sweeps: every trial is a normal train.py + eval.py run in its own workdir.

    python sweep.py --config configs/sweeps/mqar.py[:arg] --workdir DIR [--parallel N]
        [--devices 0,1,...] [--launcher "srun -N 4 --ntasks-per-node=1"] [--dry_run]

The sweep config (configs/sweeps/*.py) names a trial config file and an arg template, grid axes
(lists; dict entries expand into several template keys), `--config.<key>=<value>` overrides per
trial, and how a trial is scored (an entry of its eval/results.json; an empty `score_setting`
takes the task's only entry). Trials whose
DIR/trials/<name>/DONE exists are skipped, so a restarted sweep continues. `--parallel N` runs N
trials at once on this machine; `--devices` gives each running trial one of the listed devices
(through `--device_env`, CUDA_VISIBLE_DEVICES by default). On a TPU pod slice or a multi-host GPU
cluster every trial must run on the whole slice: `--launcher` is the same launch train.py uses
there (a command prefix, or a template with {cmd}, e.g. gcloud's `--worker=all --command '{cmd}'`),
and trials run one after another. Writes DIR/summary.json, DIR/summary.md and DIR/summary.png:
the best score over `select_over` (the learning rate) per remaining grid point.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from absl import app, flags
from ml_collections import config_flags


def _define_flags():
    """Defined only when run as a program, so importing this module (tests) leaves the
    global absl flags free for train.py and eval.py."""
    config_flags.DEFINE_config_file("config", None, "Sweep config (configs/sweeps/<name>.py[:arg]).")
    flags.DEFINE_string("workdir", None, "Sweep directory (one sub-directory per trial).")
    flags.DEFINE_integer("parallel", 1, "Trials run at once on this machine.")
    flags.DEFINE_string("devices", "", "Comma-separated device ids handed out one per running trial.")
    flags.DEFINE_string("device_env", "CUDA_VISIBLE_DEVICES", "Variable that pins a trial to its device.")
    flags.DEFINE_string("launcher", "", "Multi-host launch prefix or template with {cmd}.")
    flags.DEFINE_bool("dry_run", False, "Print the trial commands and stop.")
    flags.mark_flags_as_required(["config", "workdir"])


FLAGS = flags.FLAGS


# ------------------------------------------------------------------------------------- grid
def expand(axes) -> list[dict]:
    """Every combination of the axes, as flat dicts: a dict-valued entry contributes its keys
    (and its own name under the axis name, for grouping)."""
    names = list(axes)
    points = []
    for combo in itertools.product(*(list(axes[n]) for n in names)):
        point = {}
        for name, value in zip(names, combo):
            if isinstance(value, dict) or hasattr(value, "items"):
                point.update(dict(value))
                point[name] = "_".join(f"{k}{v}" for k, v in dict(value).items())
            else:
                point[name] = value
        points.append(point)
    return points


def trial_name(point: dict, axes) -> str:
    return "-".join(f"{n}={point[n]}" for n in axes).replace("/", "_")


class Trial:
    """One grid point: its workdir, config spec, overrides and score key."""

    def __init__(self, sweep, point: dict, root: str):
        self.point = point
        self.name = trial_name(point, sweep.axes)
        self.workdir = os.path.join(root, "trials", self.name)
        self.config = f"{sweep.trial_config}:{sweep.trial_arg.format(**point)}"
        self.overrides = [f"--config.{k}={str(v).format(**point)}" for k, v in sweep.overrides]
        self.eval_tasks = sweep.eval_tasks
        self.score_key = (sweep.score_task.format(**point), sweep.score_setting.format(**point))

    def commands(self, python: str = sys.executable) -> list[list[str]]:
        base = ["--config", self.config, "--workdir", self.workdir]
        return [[python, "train.py", *base, *self.overrides],
                [python, "eval.py", *base, *self.overrides, "--tasks", self.eval_tasks]]

    @property
    def done_file(self) -> str:
        return os.path.join(self.workdir, "DONE")

    def done(self) -> bool:
        return os.path.exists(self.done_file)

    def score(self) -> float | None:
        path = os.path.join(self.workdir, "eval", "results.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            per = json.load(f).get(self.score_key[0], {})
        if not self.score_key[1]:  # "": the task's only setting (eval of the trained task alone)
            if len(per) > 1:
                raise ValueError(f"{path}: several settings {sorted(per)}; set score_setting")
            return next(iter(per.values()), None)
        return per.get(self.score_key[1])


def make_trials(sweep, root: str) -> list[Trial]:
    trials = [Trial(sweep, p, root) for p in expand(sweep.axes)]
    names = [t.name for t in trials]
    if len(set(names)) != len(names):
        raise ValueError("sweep: two grid points share a trial name; make the axes distinct")
    return trials


# ------------------------------------------------------------------------------------- run
class SubprocessRunner:
    """Runs a trial's commands, logging to <workdir>/{train,eval}.log; returns success."""

    def __init__(self, launcher: str = "", device_env: str = "CUDA_VISIBLE_DEVICES"):
        self.launcher, self.device_env = launcher, device_env

    def wrap(self, cmd: list[str]) -> list[str]:
        if not self.launcher:
            return cmd
        if "{cmd}" in self.launcher:
            return ["bash", "-c", self.launcher.format(cmd=shlex.join(cmd))]
        return [*shlex.split(self.launcher), *cmd]

    def __call__(self, trial: Trial, device: str | None) -> bool:
        os.makedirs(trial.workdir, exist_ok=True)
        env = dict(os.environ)
        if device is not None:
            env[self.device_env] = device
        for cmd, log in zip(trial.commands(), ("train.log", "eval.log")):
            with open(os.path.join(trial.workdir, log), "w") as f:
                rc = subprocess.run(self.wrap(cmd), stdout=f, stderr=subprocess.STDOUT, env=env).returncode
            if rc != 0:
                print(f"[sweep] {trial.name}: {cmd[1]} exited {rc} (see {trial.workdir}/{log})", flush=True)
                return False
        return True


def run_trials(trials: list[Trial], runner, *, parallel: int = 1, devices=()) -> dict:
    """Run the trials not yet done, `parallel` at a time, each holding one device of `devices`
    while it runs; returns {name: "done" | "skipped" | "failed"}."""
    status = {t.name: "skipped" for t in trials if t.done()}
    todo = [t for t in trials if not t.done()]
    if devices and parallel > len(devices):
        raise ValueError(f"--parallel {parallel} exceeds the {len(devices)} devices given")
    free: queue.Queue = queue.Queue()
    for d in devices or [None] * parallel:
        free.put(d)

    def one(trial: Trial) -> tuple[str, bool]:
        device = free.get()
        try:
            start = time.time()
            ok = runner(trial, device)
            if ok:
                with open(trial.done_file, "w") as f:
                    json.dump({"point": trial.point, "seconds": time.time() - start}, f)
            print(f"[sweep] {trial.name}: {'done' if ok else 'FAILED'} score={trial.score()}", flush=True)
            return trial.name, ok
        finally:
            free.put(device)

    with ThreadPoolExecutor(max_workers=max(parallel, 1)) as pool:
        for name, ok in pool.map(one, todo):
            status[name] = "done" if ok else "failed"
    return status


# --------------------------------------------------------------------------------- summary
def summarize(sweep, trials: list[Trial]) -> list[dict]:
    """Rows: one per grid point without `select_over` (with the keys of its settings), holding the
    best score over `select_over` and the value that reached it."""
    best: dict[tuple, dict] = {}
    keys = [n for n in sweep.axes if n != sweep.select_over]
    for t in trials:
        score = t.score() if t.done() else None
        group = tuple(t.point[k] for k in keys)
        fixed = {k: v for k, v in t.point.items() if k != sweep.select_over}
        row = best.setdefault(group, {**fixed, "score": None, sweep.select_over: None, "trials": 0})
        row["trials"] += 1
        if score is not None and (row["score"] is None or score > row["score"]):
            row["score"], row[sweep.select_over] = score, t.point[sweep.select_over]
    return list(best.values())


def write_summary(sweep, rows: list[dict], root: str) -> None:
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    keys = [k for k in rows[0] if k not in ("score", sweep.select_over, "trials")] if rows else []
    lines = ["| " + " | ".join(keys) + f" | best {sweep.select_over} | score |",
             "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.3f}"
        lines.append("| " + " | ".join(str(r[k]) for k in keys) + f" | {r[sweep.select_over]} | {score} |")
    with open(os.path.join(root, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_summary(sweep, rows, os.path.join(root, "summary.png"))


def plot_summary(sweep, rows: list[dict], path: str) -> None:
    """One panel per `plot.panel` value, x = `plot.x`, one line per `plot.line` value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, line, panel = sweep.plot["x"], sweep.plot["line"], sweep.plot["panel"]
    panels = list(dict.fromkeys(r[panel] for r in rows))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4 * max(len(panels), 1), 3.2), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for name in dict.fromkeys(r[line] for r in rows):
            pts = sorted((r[x], r["score"]) for r in rows
                         if r[panel] == p and r[line] == name and r["score"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=str(name))
        ax.set_title(str(p), fontsize=9)
        ax.set_xlabel(x)
        ax.set_ylabel("accuracy (best lr)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xscale("log", base=2)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv):
    del argv
    sweep, root = FLAGS.config, FLAGS.workdir
    trials = make_trials(sweep, root)
    if FLAGS.dry_run:
        for t in trials:
            for cmd in t.commands():
                print(shlex.join(cmd))
        return
    if FLAGS.launcher and FLAGS.parallel > 1:
        raise ValueError("--launcher runs each trial on the whole slice; use --parallel 1")
    os.makedirs(root, exist_ok=True)
    devices = [d for d in FLAGS.devices.split(",") if d]
    status = run_trials(trials, SubprocessRunner(FLAGS.launcher, FLAGS.device_env),
                        parallel=FLAGS.parallel, devices=devices)
    rows = summarize(sweep, trials)
    write_summary(sweep, rows, root)
    counts = {s: list(status.values()).count(s) for s in ("done", "skipped", "failed")}
    print(f"[sweep] {len(trials)} trials: {counts}; summary in {root}/summary.md")
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    _define_flags()
    app.run(main)

"""Grid sweeps: every trial is a normal train.py + eval.py run in its own workdir.

    python sweep.py --config configs/sweeps/mqar.py[:arg] --workdir DIR [--parallel N]
        [--devices 0,1,...] [--launcher "srun -N 4 --ntasks-per-node=1"] [--compile_cache off] [--dry_run]

The sweep config (configs/sweeps/*.py) names a trial config file and an arg template, grid axes
(lists; dict entries expand into several template keys), `--config.<key>=<value>` overrides per
trial, and how a trial is scored (an entry of its eval/results.json; an empty `score_setting`
takes the task's only entry). Trials whose DIR/trials/<name>/DONE exists are skipped, so a
restarted sweep continues. `--parallel N` runs N trials at once on this machine (default: one
per device slot); `--devices` gives each running trial one of the listed devices
(through `--device_env`, CUDA_VISIBLE_DEVICES by default), `--trials_per_device N` lets N trials
share each one (small models leave a GPU mostly idle; their cost is process start, compiling and
host-side data), each then without preallocation and with 0.9/N of the device memory (JAX's
XLA_PYTHON_CLIENT_* variables). `--deadline_s` bounds the sweep's wall time: no trial starts after
it, running ones are stopped (SIGTERM, as does a SIGTERM to the sweep) and the summary is written
from the trials that finished, marked partial (how many of each point's trials it holds). A
stopped trial's train.py saves a checkpoint on SIGTERM, so the same sweep run again in the same
DIR resumes it from there (long trials can span several time-limited jobs). The trials share a persistent XLA compilation cache,
DIR/xla_cache by default (`--compile_cache PATH`, relative to DIR, or `off`; handed to each trial
through JAX's JAX_COMPILATION_CACHE_DIR variables), and run in an order that puts the trials of one
grid point (differing only in `select_over`) apart, so that a later one finds the programs an
earlier one compiled instead of compiling them at the same time. A sweep config may set `cost`, a
function of a trial's grid point (e.g. tokens per step): the trials that start at once are placed
longest first on the device with the least cost so far, and each later one takes a slot on the
device whose running trials cost least, so heavy and light points spread over the devices. A
failed trial is recorded, with the tail of its log, in
DIR/status.json and DIR/summary.md, and the sweep goes on. On a TPU pod slice or a multi-host GPU
cluster every trial must run on the whole slice: `--launcher` is the same launch train.py uses
there (a command prefix, or a template with {cmd}, e.g. gcloud's `--worker=all --command '{cmd}'`),
and trials run one after another. Trials call train.py and eval.py, and a relative trial config,
by this checkout's absolute path (so a sweep runs from any directory; under a launcher every host
needs the checkout at that path). Writes DIR/summary.json, DIR/summary.md and DIR/summary.png
(the best score over `select_over`, the learning rate, per remaining grid point) and
DIR/status.json (every trial: status, score, wall times of train.py and eval.py).
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import sys
import threading

from absl import app, flags
from ml_collections import config_flags

from kimi_jax.sweep_run import (  # noqa: F401  (device_slots, log_tail, SlotPool, wave_devices: this script's API)
    LOG_TAIL_LINES,
    SlotPool,
    SubprocessRunner,
    device_slots,
    log_tail,
    run_trials,
    total_times,
    wave_devices,
)


def _define_flags():
    """Defined only when run as a program, so importing this module (tests) leaves the
    global absl flags free for train.py and eval.py."""
    config_flags.DEFINE_config_file("config", None, "Sweep config (configs/sweeps/<name>.py[:arg]).")
    flags.DEFINE_string("workdir", None, "Sweep directory (one sub-directory per trial).")
    flags.DEFINE_integer("parallel", 0, "Trials run at once on this machine (0: one per device slot, else 1).")
    flags.DEFINE_string("devices", "", "Comma-separated device ids handed out one per running trial.")
    flags.DEFINE_integer("trials_per_device", 1, "Trials sharing each device of --devices.")
    flags.DEFINE_float("mem_fraction", 0.0, "Device memory fraction per shared trial (0: 0.9 / trials_per_device).")
    flags.DEFINE_float("deadline_s", 0.0, "Wall-clock budget of the sweep in seconds (0: none).")
    flags.DEFINE_string("device_env", "CUDA_VISIBLE_DEVICES", "Variable that pins a trial to its device.")
    flags.DEFINE_string("launcher", "", "Multi-host launch prefix or template with {cmd}.")
    flags.DEFINE_string("compile_cache", "xla_cache", "Compilation cache shared by the trials: a directory "
                        "(relative: under --workdir) or 'off'.")
    flags.DEFINE_float("compile_cache_min_s", 0.0, "Compiles shorter than this (seconds) are not cached.")
    flags.DEFINE_bool("dry_run", False, "Print the trial commands and stop.")
    flags.mark_flags_as_required(["config", "workdir"])


FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.abspath(__file__))


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


def repo_path(path: str) -> str:
    """A trial config file as an absolute path: from the working directory if it is there, else
    from this repo (the trials' commands then work from any directory)."""
    if os.path.exists(path):
        return os.path.abspath(path)
    inside = os.path.join(REPO, path)
    return inside if os.path.exists(inside) else path


def trial_name(point: dict, axes) -> str:
    return "-".join(f"{n}={point[n]}" for n in axes).replace("/", "_")


class Trial:
    """One grid point: its workdir, config spec, overrides and score key."""

    def __init__(self, sweep, point: dict, root: str):
        self.point = point
        self.name = trial_name(point, sweep.axes)
        self.workdir = os.path.join(root, "trials", self.name)
        self.config = f"{repo_path(sweep.trial_config)}:{sweep.trial_arg.format(**point)}"
        self.overrides = [f"--config.{k}={str(v).format(**point)}" for k, v in sweep.overrides]
        self.eval_tasks = sweep.eval_tasks
        self.score_key = (sweep.score_task.format(**point), sweep.score_setting.format(**point))

    def commands(self, python: str = sys.executable) -> list[list[str]]:
        """train.py and eval.py by absolute path, so trials run from any working directory."""
        base = ["--config", self.config, "--workdir", self.workdir]
        return [[python, os.path.join(REPO, "train.py"), *base, *self.overrides],
                [python, os.path.join(REPO, "eval.py"), *base, *self.overrides, "--tasks", self.eval_tasks]]

    @property
    def done_file(self) -> str:
        return os.path.join(self.workdir, "DONE")

    @property
    def failed_file(self) -> str:
        return os.path.join(self.workdir, "FAILED")

    def failure(self) -> dict:
        """What the runner recorded of the last failed attempt ({} if none)."""
        if not os.path.exists(self.failed_file):
            return {}
        with open(self.failed_file) as f:
            return json.load(f)

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


def run_order(trials: list[Trial], select_over: str) -> list[Trial]:
    """The trials with those of one grid point (equal but for `select_over`: the same model, the
    same compiled programs) spread apart: every point's first trial, then every point's second...
    With a shared compilation cache a point's later trials then start after its first one has
    compiled (instead of compiling alongside it), and a deadline leaves one trial of each point
    rather than every trial of the first points."""
    seen: dict[tuple, int] = {}
    rank = []
    for i, t in enumerate(trials):
        group = tuple(sorted((k, str(v)) for k, v in t.point.items() if k != select_over))
        rank.append((seen.get(group, 0), i))
        seen[group] = seen.get(group, 0) + 1
    return [trials[i] for _, i in sorted(rank)]


def compile_cache_env(path: str, min_compile_s: float = 0.0) -> dict:
    """Environment that points JAX's persistent compilation cache of a trial at `path` ("" or
    "off": none). Every entry is kept (no size floor; `min_compile_s` 0 by default, since compiles
    that are fast alone take seconds when many trials share the host's cores)."""
    if not path or path == "off":
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": os.path.abspath(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(float(min_compile_s)),
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def trial_records(trials: list[Trial], status: dict) -> dict:
    """{name: status, score, seconds and per-command times (and `total_times` over the attempts
    of a trial run more than once), and for a failure its reason and log tail}: what
    DIR/status.json keeps of every trial."""
    records = {}
    for t in trials:
        rec = {"status": status.get(t.name, "not_run"), "score": t.score() if t.done() else None}
        for path, keys in ((t.done_file, ("seconds", "device")), (os.path.join(t.workdir, "times.json"), None)):
            if os.path.exists(path):
                with open(path) as f:
                    data = json.load(f)
                rec.update({k: data[k] for k in keys if k in data} if keys else {"times": data})
        if "earlier" in rec.get("times", {}):  # run more than once (resumed or retried)
            rec["total_times"] = total_times(rec["times"])
        if rec["status"] in ("failed", "stopped"):
            rec.update({k: v for k, v in t.failure().items() if k in ("reason", "tail")})
        records[t.name] = rec
    return records


# --------------------------------------------------------------------------------- summary
def summarize(sweep, trials: list[Trial]) -> list[dict]:
    """Rows: one per grid point without `select_over` (with the keys of its settings), holding the
    best score over `select_over` among its `finished` of `trials` trials and the value that
    reached it."""
    best: dict[tuple, dict] = {}
    keys = [n for n in sweep.axes if n != sweep.select_over]
    for t in trials:
        score = t.score() if t.done() else None
        group = tuple(t.point[k] for k in keys)
        fixed = {k: v for k, v in t.point.items() if k != sweep.select_over}
        row = best.setdefault(group, {**fixed, "score": None, sweep.select_over: None, "trials": 0, "finished": 0})
        row["trials"] += 1
        row["finished"] += score is not None
        if score is not None and (row["score"] is None or score > row["score"]):
            row["score"], row[sweep.select_over] = score, t.point[sweep.select_over]
    return list(best.values())


def partial_note(rows: list[dict]) -> str:
    """"" when every trial finished, else what the summary is missing (a deadline, failures)."""
    finished, total = sum(r.get("finished", r["trials"]) for r in rows), sum(r["trials"] for r in rows)
    if finished == total:
        return ""
    return (f"Partial: {finished} of {total} trials finished; a score marked (k/n) is the best of the k "
            f"finished trials of its n.")


def write_summary(sweep, rows: list[dict], root: str, records: dict | None = None) -> None:
    """summary.json (the rows), summary.md (their table, marked as partial when trials did not
    finish, then those trials with the last line of their log), summary.png; with `records`,
    status.json (every trial)."""
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    if records is not None:
        with open(os.path.join(root, "status.json"), "w") as f:
            json.dump(records, f, indent=2)
    keys = [k for k in rows[0] if k not in ("score", sweep.select_over, "trials", "finished")] if rows else []
    note = partial_note(rows)
    lines = ([note, ""] if note else []) + ["| " + " | ".join(keys) + f" | best {sweep.select_over} | score |",
                                            "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.3f}"
        if r.get("finished", r["trials"]) < r["trials"]:
            score += f" ({r['finished']}/{r['trials']})"
        lines.append("| " + " | ".join(str(r[k]) for k in keys) + f" | {r[sweep.select_over]} | {score} |")
    missing = {n: r for n, r in (records or {}).items() if r["status"] not in ("done", "skipped")}
    if missing:
        lines += ["", f"Not finished ({len(missing)}; logs in status.json):", ""]
        for name, r in missing.items():
            last = (r.get("tail") or "").strip().splitlines()[-1:] or [""]
            detail = f"{r.get('reason', '')} {last[0][:200]}".strip()
            lines.append(f"- {name}: {r['status']}" + (f", {detail}" if detail else ""))
    with open(os.path.join(root, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_summary(sweep, rows, os.path.join(root, "summary.png"))


def plot_summary(sweep, rows: list[dict], path: str, reference=()) -> list[str]:
    """One panel per `plot.panel` value, x = `plot.x`, one line per `plot.line` value; with a
    single `plot.x` value (one width, say) one bar per `plot.line` value instead. `reference`:
    (label, {panel value: {x value: score}}) pairs, e.g. published figures, drawn dashed in grey
    beside ours (markers on the bars' panels). Returns the legend labels of the first panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, line, panel = sweep.plot["x"], sweep.plot["line"], sweep.plot["panel"]
    panels = list(dict.fromkeys(r[panel] for r in rows))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4 * max(len(panels), 1), 3.2), squeeze=False)
    names = list(dict.fromkeys(r[line] for r in rows))
    xs = list(dict.fromkeys(r[x] for r in rows))
    for ax, p in zip(axes[0], panels):
        for i, name in enumerate(names):
            pts = sorted((r[x], r["score"]) for r in rows
                         if r[panel] == p and r[line] == name and r["score"] is not None)
            if pts and len(xs) == 1:
                ax.bar(i, pts[0][1], color=f"C{i}")
                ax.text(i, pts[0][1] + 0.01, f"{pts[0][1]:.2f}", ha="center", va="bottom", fontsize=7)
            elif pts:
                ax.plot(*zip(*pts), marker="o", label=str(name), color=f"C{i}")
        for j, (label, table) in enumerate(reference):
            pts = sorted((k, v) for k, v in table.get(p, {}).items() if k in xs)
            style = dict(color=str(0.15 + 0.15 * j), linestyle="--", linewidth=1, marker="xs^v+"[j % 5],
                         markersize=4, label=label)
            if pts and len(xs) == 1:
                ax.plot([-0.4, len(names) - 0.6], [pts[0][1]] * 2, **style)
            elif pts:
                ax.plot(*zip(*pts), **style)
        ax.set_title(str(p) + (f" ({x}={xs[0]})" if len(xs) == 1 else ""), fontsize=9)
        ax.set_ylabel("accuracy (best lr)")
        ax.set_ylim(-0.02, 1.08)
        if len(xs) == 1:
            ax.set_xticks(range(len(names)), [str(n) for n in names], rotation=30, ha="right", fontsize=8)
        else:
            ax.set_xlabel(x)
            ax.set_xscale("log", base=2)
    labels = []
    if (len(xs) > 1 and any(r["score"] is not None for r in rows)) or reference:
        axes[0][0].legend(fontsize=6)
        labels = [t.get_text() for t in axes[0][0].get_legend().get_texts()]
    note = partial_note(rows)
    if note:
        fig.suptitle(note.split(";")[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels


def host_warning(parallel: int, cores: int) -> str:
    """A warning when concurrent trials get fewer than 2 host cores each: every trial drives its
    device and generates its data on the host. Measured on two H200s with 32 cores: 16 trials at
    once ran their steps in 11-30 ms; 24 at once in 70-100 ms, and 20 of 24 missed the deadline."""
    if parallel <= max(cores // 2, 1):
        return ""
    return (f"[sweep] warning: {parallel} trials at once on {cores} host cores (< 2 cores each); trials "
            f"will be host-bound and much slower, fewer at a time (--trials_per_device) may finish sooner")


def main(argv):
    del argv
    sweep, root = FLAGS.config, os.path.abspath(FLAGS.workdir)
    trials = make_trials(sweep, root)
    if FLAGS.dry_run:
        for t in trials:
            for cmd in t.commands():
                print(shlex.join(cmd))
        return
    devices = [d for d in FLAGS.devices.split(",") if d]
    slots = device_slots(devices, FLAGS.trials_per_device)
    parallel = FLAGS.parallel or max(len(slots), 1)
    if FLAGS.launcher and parallel > 1:
        raise ValueError("--launcher runs each trial on the whole slice; use --parallel 1")
    warning = host_warning(parallel, os.cpu_count() or 1)
    if warning:
        print(warning, flush=True)
    os.makedirs(root, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if FLAGS.deadline_s:
        timer = threading.Timer(FLAGS.deadline_s, stop.set)
        timer.daemon = True
        timer.start()
    cache = "" if FLAGS.compile_cache in ("", "off") else os.path.join(root, FLAGS.compile_cache)
    runner = SubprocessRunner(FLAGS.launcher, FLAGS.device_env, stop=stop, mem_fraction=FLAGS.mem_fraction,
                              share=FLAGS.trials_per_device if devices else 1,
                              extra_env=compile_cache_env(cache, FLAGS.compile_cache_min_s))
    print(f"[sweep] {len(trials)} trials, {parallel} at a time on {slots or 'this machine'}; "
          f"compilation cache {cache or 'off'}", flush=True)
    order = run_order(trials, sweep.select_over) if cache else trials
    status = run_trials(order, runner, parallel=parallel, devices=slots, stop=stop, cost=sweep.get("cost"))
    rows = summarize(sweep, trials)
    write_summary(sweep, rows, root, trial_records(trials, status))
    counts = {s: list(status.values()).count(s) for s in ("done", "skipped", "failed", "stopped", "not_run")}
    print(f"[sweep] {len(trials)} trials: {counts}; summary in {root}/summary.md", flush=True)
    if counts["failed"] or counts["stopped"] or counts["not_run"]:
        sys.exit(1)


if __name__ == "__main__":
    _define_flags()
    app.run(main)

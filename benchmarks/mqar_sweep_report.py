"""Turn an MQAR sweep directory into committed results: a JSON record and a markdown table of our
best-lr accuracies beside the published Zoology figures.

    python benchmarks/mqar_sweep_report.py --sweep_dir DIR --config configs/sweeps/mqar.py:gpu \
        --out_dir benchmarks/results --name mqar_sweep_h200_20261129

Reads DIR/summary.json (best lr per mixer, width and setting), DIR/status.json (every trial: status,
score, wall times) and the sweep config (grid, steps, batches); writes OUT/NAME.json,
OUT/NAME.md and OUT/NAME.png (DIR/summary.png). The record names the device the trials trained on
(each train.log's mesh line) and the package versions of the machine the report runs on; run it
where the sweep ran to have both from one machine (elsewhere, `env.report_machine` says so).
Published figures are as read in the sources (Zoology Fig. 2 has no table: values are plot
readings, about +-0.03).

    python benchmarks/mqar_sweep_report.py --merge A.json B.json ... --name NAME

merges records of one budget written by separate runs (pieces of a grid that fit a job each) into
one record, table and plot. The records must agree on the steps, evaluation size, the axis the
best is taken over, the batch per setting and the device. A cell measured by several keeps the
latest score at its best lr (a re-run at the same lr replaces the earlier one; a run at another
lr wins only with a higher score, so pieces run at different learning rates merge into Zoology's
best-of-lrs), and each row names its source record.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Zoology (Arora et al. 2023) Fig. 2, HazyResearch/zoology assets/figure2.png: MQAR accuracy at
# (L, K) and d_model, 2 layers without MLP, best of 4 learning rates, 64 epochs of 100k examples.
ZOOLOGY_FIG2 = {
    "attention": {(64, 4): dict.fromkeys((64, 128, 256), "0.97-1.0"),
                  **{s: dict.fromkeys((64, 128, 256), "0.98") for s in ((128, 8), (256, 16), (512, 64))}},
    "BaseConv": {(64, 4): {64: 0.69, 128: 0.92, 256: 0.94}, (128, 8): {64: 0.37, 128: 0.61, 256: 0.83},
                 (256, 16): {64: 0.15, 128: 0.33, 256: 0.80}, (512, 64): {64: 0.02, 128: 0.03, 256: 0.04}},
    "H3": {(64, 4): {64: 0.91, 128: 0.97, 256: 0.97}, (128, 8): {64: 0.25, 128: 0.72, 256: 0.89},
           (256, 16): {64: 0.06, 128: 0.63, 256: 0.61}, (512, 64): {64: 0.02, 128: 0.03, 256: 0.03}},
    "RWKV": {(64, 4): {64: 0.74, 128: 0.92, 256: 0.95}, (128, 8): {64: 0.18, 128: 0.50, 256: 0.74},
             (256, 16): {64: 0.06, 128: 0.07, 256: 0.67}, (512, 64): {64: 0.02, 128: 0.03, 256: 0.16}},
    "Hyena": {(64, 4): {64: 0.51, 128: 0.74, 256: 0.83}, (128, 8): {64: 0.20, 128: 0.62, 256: 0.73},
              (256, 16): {64: 0.05, 128: 0.14, 256: 0.53}, (512, 64): {64: 0.02, 128: 0.04, 256: 0.11}},
}
ZOOLOGY_SOURCE = "Zoology (Arora et al. 2023) Fig. 2, plot readings (attention: 0.97-1.0 at every width)"
# Published points outside our settings, quoted beside the table.
OTHER_PUBLISHED = [
    "DeltaNet (Yang et al. 2024), MQAR at L=512, K=64 (Zoology's hardest setting), d_model 64/128/256/512: "
    "DeltaNet 1.00/1.00/1.00/1.00, Mamba 0.81/1.00/1.00/1.00, GLA 0.22/0.95/1.00/1.00, "
    "RetNet 0.05/0.87/0.96/0.97 (plot readings).",
    "Zoology README recall-memory trade-off (Based test mix up to L=1024): Gated DeltaNet 0.89 at about "
    "1.7e4 state elements and 0.99 from 6.6e4; DeltaNet 0.79 at 9e3, 0.96 at 3.5e4 (plot readings).",
    "Neither source has plain (unnormalised, ungated) linear attention in this grid; Zoology's "
    "sub-quadratic baselines above need d_model growing with L, while attention solves every setting.",
]
MIXER_NAMES = {"softmax": "softmax attention", "linear": "linear attention", "deltanet": "DeltaNet",
               "gated_deltanet": "Gated DeltaNet", "kda": "KDA", "hybrid": "KDA:MLA 3:1 hybrid"}
VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "ml-collections")


def environment() -> dict:
    """Date, devices and package versions of the machine this runs on."""
    import jax

    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    devices = jax.devices()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": devices[0].device_kind, "device_count": len(devices),
            "platform": devices[0].platform, "python": platform.python_version(), "versions": versions}


MESH_LINE = re.compile(r"^mesh \{.*\} over (\d+) (.+) device\(s\), ", re.M)


def trial_devices(sweep_dir: str, names) -> tuple[str, int] | None:
    """(device kind, device count) the trials trained on, from each train.log's mesh line (None: no
    log names one); trials that ran on different kinds or counts are an error."""
    seen = {}
    for name in names:
        path = os.path.join(sweep_dir, "trials", name, "train.log")
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            match = MESH_LINE.search(f.read())
        if match:
            seen[name] = (match.group(2), int(match.group(1)))
    if len(set(seen.values())) > 1:
        raise ValueError(f"trials of {sweep_dir} trained on different devices: {seen}")
    return next(iter(seen.values()), None)


def trial_environment(env: dict, trained: tuple[str, int] | None) -> dict:
    """`env` (this machine) with the device the trials trained on, and this machine kept as
    `report_machine` where they differ."""
    if trained is None or trained == (env["device"], env["device_count"]):
        return env
    here = {k: env[k] for k in ("device", "device_count", "platform")}
    kind, count = trained
    platform_ = "cpu" if kind == "cpu" else "tpu" if "TPU" in kind else "gpu"
    return {**env, "device": kind, "device_count": count, "platform": platform_, "report_machine": here}


def load_sweep(spec: str):
    """(config module, its sweep config) of the sweep config file `path[:arg]` (path relative to the repo)."""
    sys.path.insert(0, ROOT)
    import importlib.util

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("sweep_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module, module.get_config(arg or None)


def portable_spec(spec: str) -> str:
    """`spec` with an absolute config path cut to its `configs/...` part, so committed records
    name the config as a checkout does, not the directory a report ran in."""
    path, sep, arg = spec.partition(":")
    if os.path.isabs(path):
        parts = path.split(os.sep)
        if "configs" not in parts:
            raise ValueError(f"config {path!r}: pass it relative to the repository root (configs/...)")
        path = "/".join(parts[len(parts) - 1 - parts[::-1].index("configs"):])
    return path + sep + arg


def sweep_description(spec: str) -> dict:
    """Grid and schedule of the sweep config `path[:arg]` (the values of its first trial)."""
    module, sweep = load_sweep(spec)
    spec = portable_spec(spec)
    axes = {k: [dict(v) if hasattr(v, "items") else v for v in vals] for k, vals in sweep.axes.items()}
    batches, steps = {}, None
    for setting in axes.get("setting", [{}]):
        point = {}
        for k, vals in axes.items():  # dict-valued entries expand into their keys, as in sweep.py
            if k == "setting":
                continue
            point.update(vals[0] if isinstance(vals[0], dict) else {k: vals[0]})
        point.update(setting)
        config = module.get_config(sweep.trial_arg.format(**point))
        batches[f"L{config.data.task_kwargs.seq_len}_K{config.data.task_kwargs.num_kv_pairs}"] = config.data.batch_size
        steps, eval_examples = config.total_steps, config.evals.num_examples
    return {"config": spec, "axes": axes, "steps": steps, "batch_size": batches, "eval_examples": eval_examples,
            "select_over": sweep.select_over}


def last_train_metrics(sweep_dir: str, name: str) -> dict | None:
    """The last line of a trial's metrics.jsonl: its final training loss/accuracy and step time."""
    path = os.path.join(sweep_dir, "trials", name, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        return None
    last = json.loads(lines[-1])
    return {k: last[k] for k in ("step", "loss", "accuracy", "step_time_ms", "tokens_per_sec") if k in last}


def trial_costs(status: dict) -> dict:
    """Median and max wall seconds of train.py and eval.py over the finished trials (summed over
    the attempts of a trial that was resumed)."""
    out = {}
    for program in ("train.py", "eval.py"):
        times = [r.get("total_times", r.get("times", {}))[program] for r in status.values()
                 if r.get("status") == "done" and program in r.get("total_times", r.get("times", {}))]
        if times:
            out[program] = {"median_s": round(statistics.median(times), 1), "max_s": round(max(times), 1)}
    return out


def _fmt(value) -> str:
    return value if isinstance(value, str) else f"{value:.2f}"


def markdown(rows: list[dict], record: dict) -> str:
    """Our best-lr accuracy per mixer (rows) and setting x width (columns), then Zoology's figures
    for the same cells, then the other published points."""
    settings = list(dict.fromkeys((r["seq_len"], r["num_kv_pairs"]) for r in rows))
    widths = sorted({r["d_model"] for r in rows})
    cols = [(s, d) for s in settings for d in widths]
    head = "| model | source | " + " | ".join(f"L={L} K={K} d={d}" for (L, K), d in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    # Grid axes beyond mixer, width and setting (e.g. softmax_forms' form and steps) split the rows.
    sweep = record["sweep"]
    extra = [k for k in sweep["axes"] if k not in ("mixer", "d_model", "setting", sweep["select_over"])]
    line_key = lambda r: (r["mixer"],) + tuple(r[k] for k in extra)
    ours = {line_key(r) + (r["seq_len"], r["num_kv_pairs"], r["d_model"]): r for r in rows}
    env = record["env"]
    steps = "" if "steps" in extra else f", {sweep['steps']} steps"
    label = f"ours ({env['device']}{steps})"
    for key in dict.fromkeys(line_key(r) for r in rows):
        cells = []
        for (L, K), d in cols:
            r = ours.get(key + (L, K, d))
            cells.append("-" if r is None or r["score"] is None else f"{r['score']:.2f}")
        name = MIXER_NAMES.get(key[0], key[0]) + "".join(f", {k} {v}" for k, v in zip(extra, key[1:]))
        lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    for model, table in ZOOLOGY_FIG2.items():
        cells = [f"≈{_fmt(table[s][d])}" if s in table and d in table[s] else "-" for s, d in cols]
        lines.append(f"| {model} | Zoology Fig. 2 | " + " | ".join(cells) + " |")
    lines += ["", f"Ours: {_selection(rows, sweep['axes'][sweep['select_over']], sweep['select_over'])}, accuracy on "
              f"{sweep['eval_examples']} held-out examples, {sweep['axes'].get('steps', sweep['steps'])} steps at batch "
              f"{sweep['batch_size']} ({record['trials_finished']}/{record['trials_total']} trials finished). "
              f"Published: {ZOOLOGY_SOURCE}.", ""]
    if record.get("merged_from"):
        lines[-2] += f" Merged from {len(record['merged_from'])} runs: {', '.join(record['merged_from'])}."
    lines += [f"- {note}" for note in OTHER_PUBLISHED]
    return "\n".join(lines) + "\n"


def _selection(rows: list[dict], values: list, sel: str) -> str:
    """Which `sel` values each cell's best was taken over: one phrase when every cell ran at the
    same ones, else the most common set and the cells that ran at others."""
    sets = [tuple(r[f"{sel}_tried"]) for r in rows if f"{sel}_tried" in r]
    if not sets or len(set(sets)) == 1:
        return f"best of {sel} {list(sets[0]) if sets else values} per cell"
    common = max(set(sets), key=sets.count)
    others = [f"{MIXER_NAMES.get(r['mixer'], r['mixer'])} L={r['seq_len']} K={r['num_kv_pairs']} d={r['d_model']}: "
              f"best of {list(r[f'{sel}_tried'])} ({r[sel]})" for r in rows if tuple(r.get(f"{sel}_tried", common)) != common]
    return f"best of {sel} {list(common)} per cell, except {'; '.join(others)}"


def _row_key(row: dict, extra) -> tuple:
    return (row["mixer"], row["d_model"], row["seq_len"], row["num_kv_pairs"]) + tuple(row.get(k) for k in extra)


def merge(paths: list[str]) -> dict:
    """One record from the records at `paths` (see the module docstring); raises ValueError naming
    the first record whose budget differs from the first one's."""
    if not paths:
        raise ValueError("--merge needs at least one record")
    records = [(os.path.basename(path), json.load(open(path))) for path in paths]
    first_name, first = records[0]
    same = ("steps", "eval_examples", "select_over")
    batches, axes = {}, {}
    for name, rec in records:
        for key in same:
            if rec["sweep"][key] != first["sweep"][key]:
                raise ValueError(f"cannot merge {name}: sweep {key}={rec['sweep'][key]!r}, but "
                                 f"{first_name} has {first['sweep'][key]!r}")
        if rec["env"]["device"] != first["env"]["device"]:
            raise ValueError(f"cannot merge {name}: device {rec['env']['device']!r}, {first_name}: {first['env']['device']!r}")
        for setting, batch in rec["sweep"]["batch_size"].items():
            if batches.setdefault(setting, batch) != batch:
                raise ValueError(f"cannot merge {name}: batch {batch} at {setting}, another record has {batches[setting]}")
        for axis, values in rec["sweep"]["axes"].items():
            merged = axes.setdefault(axis, [])
            merged += [v for v in values if v not in merged]
    extra = [k for k in axes if k not in ("mixer", "d_model", "setting", first["sweep"]["select_over"])]
    cells, tried, sel = {}, {}, first["sweep"]["select_over"]
    for name, rec in sorted(records, key=lambda nr: nr[1]["env"]["date"]):
        for row in rec["rows"]:
            key = _row_key(row, extra)
            old = cells.get(key)
            # A later run of the cell's lr replaces it (a re-run); a run at another lr replaces it
            # only with a higher score (the best lr over all runs); an unscored row never replaces.
            if old is None or row["score"] is not None and (
                    old["score"] is None or row.get(sel) == old.get(sel) or row["score"] > old["score"]):
                cells[key] = {**row, "source": name}
            # The values a cell was run at: all of its record's axis when the row holds a trial of
            # each, else only the row's own.
            values = rec["sweep"]["axes"][sel] if row.get("trials") == len(rec["sweep"]["axes"][sel]) else [row.get(sel)]
            tried.setdefault(key, set()).update(values)
    for key, row in cells.items():
        row[f"{sel}_tried"] = sorted(tried[key])
    order = list(MIXER_NAMES)
    rows = sorted(cells.values(), key=lambda r: (r["seq_len"], r["num_kv_pairs"], r["d_model"],
                                                 order.index(r["mixer"]) if r["mixer"] in order else len(order)))
    env = {**first["env"], "date": max(rec["env"]["date"] for _, rec in records),
           "runs": {name: rec["env"] for name, rec in records}}
    sweep = {"config": [rec["sweep"]["config"] for _, rec in records], "axes": axes, "steps": first["sweep"]["steps"],
             "batch_size": batches, "eval_examples": first["sweep"]["eval_examples"],
             "select_over": first["sweep"]["select_over"]}
    return {"env": env, "sweep": sweep, "rows": rows, "merged_from": [name for name, _ in records],
            "trials_total": sum(rec["trials_total"] for _, rec in records),
            "trials_finished": sum(rec["trials_finished"] for _, rec in records),
            "published": first["published"]}


def published_lines(rows: list[dict]) -> list[tuple[str, dict]]:
    """Zoology's Fig. 2 models as plot references: (label, {setting: {d_model: accuracy}}) for the
    settings among `rows` (a range such as attention's "0.97-1.0" drawn at its middle)."""
    settings = {(r["seq_len"], r["num_kv_pairs"]): r["setting"] for r in rows}
    value = lambda v: sum(map(float, v.split("-"))) / len(v.split("-")) if isinstance(v, str) else v  # noqa: E731
    return [(f"{model} (Zoology Fig. 2)", {settings[s]: {d: value(v) for d, v in by_d.items()}
                                          for s, by_d in table.items() if s in settings})
            for model, table in ZOOLOGY_FIG2.items()]


def _plot(record: dict, path: str) -> list[str]:
    """The sweep summary plot (sweep.plot_summary) of a report or merged record, laid out as its
    (first) config says, with Zoology's published curves beside ours."""
    import types

    config = record["sweep"]["config"]
    _, sweep = load_sweep(config[0] if isinstance(config, list) else config)
    import sweep as sweep_lib  # the repo's sweep.py (load_sweep put the repo on the path)

    plot = dict(sweep.plot)
    zoology_layout = plot["x"] == "d_model" and plot["panel"] == "setting"  # Fig. 2's axes
    return sweep_lib.plot_summary(types.SimpleNamespace(plot=plot), record["rows"], path,
                                  reference=published_lines(record["rows"]) if zoology_layout else ())


def write(record: dict, out_dir: str, name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(markdown(record["rows"], record))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep_dir", default="")
    p.add_argument("--merge", nargs="+", default=None, help="report JSONs of one budget to merge (no --sweep_dir)")
    p.add_argument("--config", default="configs/sweeps/mqar.py:gpu")
    p.add_argument("--out_dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--name", default="")
    args = p.parse_args(argv)
    if args.merge is not None:
        if args.sweep_dir or not args.name:
            p.error("--merge takes report JSONs and --name, not --sweep_dir")
        record = merge(args.merge)
        write(record, args.out_dir, args.name)
        _plot(record, os.path.join(args.out_dir, f"{args.name}.png"))
        print(f"{args.out_dir}/{args.name}.{{json,md,png}}: {len(record['rows'])} cells from {len(args.merge)} records")
        return record
    if not args.sweep_dir:
        p.error("--sweep_dir or --merge is required")
    with open(os.path.join(args.sweep_dir, "summary.json")) as f:
        rows = json.load(f)
    status_path = os.path.join(args.sweep_dir, "status.json")
    status = json.load(open(status_path)) if os.path.exists(status_path) else {}
    env = trial_environment(environment(), trial_devices(args.sweep_dir, status))
    name = args.name or f"mqar_sweep_{env['device'].split()[-1].lower()}_{env['date'][:10].replace('-', '')}"
    record = {
        "env": env, "sweep": sweep_description(args.config), "rows": rows,
        "trials_total": len(status), "trials_finished": sum(r["status"] in ("done", "skipped") for r in status.values()),
        "trial_costs": trial_costs(status),
        "trials": {n: {**{k: v for k, v in r.items() if k != "tail"},
                       "last_train": last_train_metrics(args.sweep_dir, n)} for n, r in status.items()},
        "published": {"zoology_fig2": {m: {f"L{L}_K{K}": v for (L, K), v in t.items()} for m, t in ZOOLOGY_FIG2.items()},
                      "source": ZOOLOGY_SOURCE, "other": OTHER_PUBLISHED},
    }
    write(record, args.out_dir, name)
    if rows:
        _plot(record, os.path.join(args.out_dir, f"{name}.png"))
    print(f"{args.out_dir}/{name}.{{json,md,png}}: {record['trials_finished']}/{record['trials_total']} trials")
    return record


if __name__ == "__main__":
    main()

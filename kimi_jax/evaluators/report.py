"""Files written from evaluation results: results.json (the contract: {task: {setting:
accuracy}}), metrics.json (everything), results.md (tables) and PNG plots, for one model or a
comparison of several (one line per model)."""

from __future__ import annotations

import json
import math
import os

from kimi_jax.evaluators.suite import state_bytes_at


def accuracies(results: dict) -> dict:
    """{task: {setting: accuracy in [0, 1]}} (the results.json contract)."""
    return {task: {setting: m["accuracy"] for setting, m in per.items()}
            for task, per in results["tasks"].items()}


def write(outdir: str, results: dict, label: str = "model") -> None:
    """results.json, metrics.json, results.md and the plots of one model into outdir."""
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(accuracies(results), f, indent=2, sort_keys=True)
    with open(os.path.join(outdir, "metrics.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    write_comparison(outdir, {label: results})


def write_comparison(outdir: str, runs: dict) -> None:
    """results.md and the plots of several models ({label: results}) into outdir."""
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "results.md"), "w") as f:
        f.write(markdown(runs))
    plot(outdir, runs)


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(runs: dict) -> str:
    """Accuracy table (task x setting, one column per model), then loss, memory, decode time."""
    labels = list(runs)
    rows = sorted({(t, s) for r in runs.values() for t, per in r["tasks"].items() for s in per},
                  key=lambda ts: (ts[0], runs_seq_len(runs, *ts), ts[1]))
    out = ["## Accuracy (task x setting)", "",
           "| task | setting | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for t, s in rows:
        cells = [_fmt(r["tasks"].get(t, {}).get(s, {}).get("accuracy")) for r in runs.values()]
        out.append(f"| {t} | {s} | " + " | ".join(cells) + " |")
    out += ["", "## Loss per scored token (per length)", "",
            "| task | setting | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for t, s in rows:
        cells = [_fmt(r["tasks"].get(t, {}).get(s, {}).get("loss")) for r in runs.values()]
        out.append(f"| {t} | {s} | " + " | ".join(cells) + " |")
    extra = [(t, s, k) for t, s in rows for k in ("match_all", "token_accuracy")
             if any(k in r["tasks"].get(t, {}).get(s, {}) for r in runs.values())]
    if extra:
        out += ["", "## Text tasks: RULER match_all and teacher-forced token accuracy", "",
                "| task | setting | metric | " + " | ".join(labels) + " |",
                "|---|---|---|" + "---|" * len(labels)]
        for t, s, k in extra:
            cells = [_fmt(r["tasks"].get(t, {}).get(s, {}).get(k)) for r in runs.values()]
            out.append(f"| {t} | {s} | {k} | " + " | ".join(cells) + " |")
    out += ["", "## Decode cache and time per token", "",
            "| model | context | cache bytes (allocated) | ms / token |", "|---|---|---|---|"]
    for label, r in runs.items():
        mem, dec = r.get("memory", {}), r.get("decode", {})
        for i, L in enumerate(dec.get("context_len", [])):
            alloc = mem.get("allocated_bytes", [None] * (i + 1))[i]
            out.append(f"| {label} | {L} | {alloc} | {_fmt(dec['seconds_per_token'][i] * 1e3, 2)} |")
        if "bytes_per_token" in mem:
            out.append(f"| {label} | formula | {mem['bytes_per_token']} B/token + "
                       f"{mem['state_bytes']} B state | |")
    skipped = [(label, t, s, why) for label, r in runs.items()
               for t, per in r.get("skipped", {}).items() for s, why in per.items()]
    if skipped:
        out += ["", "## Skipped", "", "| model | task | setting | reason |", "|---|---|---|---|"]
        out += [f"| {label} | {t} | {s} | {why} |" for label, t, s, why in skipped]
    return "\n".join(out) + "\n"


def runs_seq_len(runs: dict, task: str, setting: str) -> int:
    for r in runs.values():
        if setting in r["tasks"].get(task, {}):
            return r["tasks"][task][setting]["seq_len"]
    return 0


def plot(outdir: str, runs: dict) -> list[str]:
    """accuracy_vs_length.png, accuracy_vs_state.png, loss_vs_length.png, decode_time.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for r in runs.values() for t in r["tasks"]})
    written = []

    def grid(metric: str, xkey: str, fname: str, ylabel: str, logx: bool):
        if not tasks:
            return
        cols = min(4, len(tasks))
        nrows = math.ceil(len(tasks) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
        for ax, task in zip(axes.flat, tasks):
            for label, r in runs.items():
                if xkey == "state_bytes" and "memory" not in r:
                    continue
                pts = sorted((_x(r, m, xkey), m[metric]) for m in r["tasks"].get(task, {}).values()
                             if metric in m)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            ax.set_title(task, fontsize=9)
            ax.set_xlabel("decode cache bytes / sequence" if xkey == "state_bytes" else xkey)
            ax.set_ylabel(ylabel)
            if metric == "accuracy":
                ax.set_ylim(-0.02, 1.02)
            if logx:
                ax.set_xscale("log", base=2)
        for ax in list(axes.flat)[len(tasks):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(outdir, fname)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    grid("accuracy", "seq_len", "accuracy_vs_length.png", "accuracy", True)
    grid("accuracy", "state_bytes", "accuracy_vs_state.png", "accuracy", True)
    grid("loss", "seq_len", "loss_vs_length.png", "loss / scored token", True)
    if not any(r.get("decode") for r in runs.values()):
        return written
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, r in runs.items():
        dec = r.get("decode")
        if dec:
            ax.plot(dec["context_len"], [s * 1e3 for s in dec["seconds_per_token"]], marker="o",
                    label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_ylabel("ms / token (decode)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(outdir, "decode_time.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def _x(results: dict, metrics: dict, key: str) -> float:
    if key == "state_bytes":
        return state_bytes_at(results["memory"], metrics["seq_len"])
    return metrics[key]

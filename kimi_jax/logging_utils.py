"""Training logs: a console progress line, `metrics.jsonl` and TensorBoard event files (through
tensorboardX, no TensorFlow), plus the device peak-FLOP table for MFU."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import numpy as np

# Dense bf16 peak FLOP/s per device. H200: measured matmul throughput on the project's machine;
# the others are vendor figures. `config.peak_flops` overrides.
PEAK_FLOPS = {
    "h200": 790e12,
    "h100": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def quiet_library_logs(verbosity_given: bool) -> None:
    """Keep absl's INFO records off the console unless `verbosity_given` (the user passed -v /
    --verbosity): Orbax logs each checkpoint save and restore at INFO through absl, about 100
    lines per save, which bury the progress line. Only the "absl" logger (the one `absl.logging`
    calls write to) is raised to WARNING: warnings and errors still show, and records of Python's
    own `logging` (eval.py's progress lines) are untouched."""
    if not verbosity_given:
        import logging

        logging.getLogger("absl").setLevel(logging.WARNING)


def peak_flops_per_device(override: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: `override` when set, else looked up by device kind (None on CPU
    and unknown devices, where MFU is not reported)."""
    if override:
        return float(override)
    kind = jax.devices()[0].device_kind.lower()
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if name in kind:
            return PEAK_FLOPS[name]
    return None


def flops_per_token(config, seq_len: int, num_params: int) -> float:
    """Training FLOPs per token from `kimi_jax.summary` when it has the model; else 6 * params."""
    try:
        from kimi_jax import summary

        return float(summary.train_flops_per_token(config, seq_len))
    except (ImportError, AttributeError, NotImplementedError, ValueError) as e:
        print(f"MFU uses 6 * params FLOPs per token: kimi_jax.summary cannot count this model ({e})",
              file=sys.stderr)
        return 6.0 * num_params


def json_value(v):
    """A metric as JSON: a number, or nested lists for arrays (e.g. per-expert loads)."""
    v = np.asarray(v)
    return v.item() if v.size == 1 else v.tolist()


def _step_of(line: str) -> float:
    """The step of a `metrics.jsonl` line; infinite for a line a killed run left half-written."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class MetricsLogger:
    """Appends one JSON object per logged step to `metrics.jsonl`, mirrors scalars to TensorBoard,
    and prints a progress line. Only process 0 writes. A run resumed from step `resume_step`
    first drops the records after it (logged by the earlier run past its last checkpoint, and
    logged again now), in `metrics.jsonl` and in TensorBoard (`purge_step`)."""

    def __init__(self, workdir: str, total_steps: int, *, tensorboard: bool = True, resume_step: int = 0):
        self.total_steps, self.active = total_steps, jax.process_index() == 0
        self.start = time.time()
        self.writer = None
        if self.active:
            os.makedirs(workdir, exist_ok=True)
            self.path = os.path.join(workdir, "metrics.jsonl")
            if os.path.exists(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if _step_of(line) <= resume_step]
                with open(self.path, "w") as f:
                    f.writelines(kept)
            if tensorboard:
                from tensorboardX import SummaryWriter

                self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

    def write(self, step: int, metrics: dict, *, console: bool = True) -> None:
        if not self.active:
            return
        record = {"step": int(step), **{k: json_value(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if console:
            print(self.progress_line(step, record), file=sys.stderr, flush=True)

    def progress_line(self, step: int, record: dict) -> str:
        """"[####------] 400/1000  loss 1.234  tok/s 1.2e+05  step 45.1ms  MFU 31.0%  eta 2m10s"."""
        frac = step / max(self.total_steps, 1)
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        parts = [f"[{bar}] {step}/{self.total_steps}"]
        for key, fmt in (("loss", "loss {:.4f}"), ("eval_loss", "eval_loss {:.4f}"),
                         ("eval_accuracy", "eval_acc {:.3f}"), ("tokens_per_sec", "tok/s {:.3g}"),
                         ("step_time_ms", "step {:.1f}ms"), ("mfu", "MFU {:.1%}")):
            if isinstance(record.get(key), (int, float)):
                parts.append(fmt.format(record[key]))
        if "step_time_ms" in record:
            eta = (self.total_steps - step) * record["step_time_ms"] / 1000
            parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
        return "  ".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def moe_load_metrics(load) -> dict:
    """Per-expert load [L, E] (fraction of routed tokens) as scalars: for each MoE layer the
    busiest and idlest expert relative to a perfectly balanced load (1.0)."""
    load = np.asarray(load, np.float64)
    if load.size == 0:
        return {}
    rel = load * load.shape[1] / np.maximum(load.sum(axis=1, keepdims=True), 1e-12)
    out = {"moe/max_load": float(rel.max()), "moe/min_load": float(rel.min())}
    for i, row in enumerate(rel):
        out[f"moe/layer{i}_max_load"] = float(row.max())
        out[f"moe/layer{i}_min_load"] = float(row.min())
    return out

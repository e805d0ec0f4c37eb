"""Rows, tables and the JSON of `benchmarks/moe.py`: the recorder that rewrites both after every
measurement, the per-row markdown and the summary of the fastest Pallas step per workload."""

from __future__ import annotations

import json
import os
import time

import jax.numpy as jnp

from benchmarks.common import PEAK_TFLOPS, markdown_table
from kernels.gmm.pallas_gpu import Blocks


def rel_rms(ref, got):
    """Relative RMS difference of two arrays (f32), on the device."""
    ref, got = jnp.asarray(ref, jnp.float32), jnp.asarray(got, jnp.float32)
    return float(jnp.sqrt(jnp.mean((ref - got) ** 2) / jnp.maximum(jnp.mean(ref ** 2), 1e-30)))


class Recorder:
    """Keeps the rows and rewrites <out>/<stem>.json and .md after every row."""

    def __init__(self, out_dir, stem, meta):
        self.rows, self.meta, self.t0 = [], meta, time.perf_counter()
        os.makedirs(out_dir, exist_ok=True)
        self.json_path = os.path.join(out_dir, stem + ".json")
        self.md_path = os.path.join(out_dir, stem + ".md")

    def add(self, row, flops):
        tf = None if row["ms"] is None else flops / (row["ms"] * 1e-3) / 1e12
        row.update(gflop=flops / 1e9, tflops=tf, peak_frac=None if tf is None else tf / PEAK_TFLOPS)
        self.rows.append(row)
        elapsed = time.perf_counter() - self.t0
        shown = "failed: " + str(row["error"]) if row["ms"] is None else \
            f"{row['ms']:.3f} ms {tf:.1f} TFLOP/s ({100 * row['peak_frac']:.1f}%)"
        if row.get("check"):
            shown += f" rel_rms vs {row['check']['against']} {row['check']['rel_rms']}"
        print(f"[{elapsed:6.1f}s] {row['workload']} {row['kind']} {row['name']} {row['impl']} "
              f"{row.get('blocks') or ''} compile {row['compile_s']}s: {shown}", flush=True)
        with open(self.json_path, "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1)
        with open(self.md_path, "w") as f:
            f.write(f"MoE routed experts, {self.meta['device']}, jax {self.meta['jax']}, "
                    f"{self.meta['date']}\n\n{markdown(self.rows)}")

    def elapsed(self):
        return time.perf_counter() - self.t0


def _blocks_str(b):
    if b is None:
        return None
    if isinstance(b, Blocks):
        return (f"{b.bm}x{b.bn}x{b.bk}/{b.stages}/band{b.band}" + ("/ws" if b.wgs == 2 else "")
                + ("/chain" if b.chain else ""))
    return " ".join(_blocks_str(x) for x in b)


def _speedups(rows):
    """{(workload, kind, name, baseline): ms} of every baseline that ran."""
    base = {}
    for r in rows:
        if r["impl"] != "pallas_gpu" and r["ms"] is not None:
            base[(r["workload"], r["kind"], r["name"], r["impl"])] = r["ms"]
    return base


def _ratio(base, r, impl):
    key = (r["workload"], r["kind"], r["name"], impl)
    if r["impl"] != "pallas_gpu" or r["ms"] is None or key not in base:
        return "–"
    return f"{base[key] / r['ms']:.2f}x"


def _gate_up_note(r) -> str:
    notes = [f"gate/up {r['gate_up']}"] if r.get("gate_up", "separate") != "separate" else []
    notes += [f"{r['pair_sort']} sort"] if r.get("pair_sort", "auto") != "auto" else []  # "auto": the default
    return f" ({', '.join(notes)})" if notes else ""


def summary(rows) -> str:
    """The fastest Pallas fwd+bwd step per workload and part, against both baselines."""
    base, best = _speedups(rows), {}
    for r in rows:
        if r["kind"] == "step" and r["impl"] == "pallas_gpu" and r["ms"] is not None:
            key = (r["workload"], r["name"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    header = ["workload", "step (fwd+bwd)", "rows x D x F, E", "pallas ms",
              "TFLOP/s (% of 790)", "vs ragged_dot", "vs padded_bmm", "tiles fwd / dlhs / drhs"]
    body = [[r["workload"], r["name"] + _gate_up_note(r), f"{r['rows']} x {r['d']} x {r['f']}, {r['experts']}",
             f"{r['ms']:.2f}", f"{r['tflops']:.1f} ({100 * r['peak_frac']:.1f}%)",
             _ratio(base, r, "ragged_dot"), _ratio(base, r, "padded_bmm"), r["blocks"] or "–"]
            for r in best.values()]
    return markdown_table(header, body) + "\n"


def markdown(rows) -> str:
    header = ["workload", "kind", "name", "impl", "tiles bm x bn x bk / stages / band", "ms",
              "TFLOP/s (% of 790)", "vs ragged_dot", "vs padded_bmm"]
    base = _speedups(rows)
    body = []
    for r in rows:
        if r["ms"] is None:
            cells = [str(r["error"])[:80], "–", "–", "–"]
        else:
            prof = r.get("profile") or {}
            kern = f" (kernels {prof['kernel_ms_per_step']:.2f})" if "kernel_ms_per_step" in prof else ""
            cells = [f"{r['ms']:.2f}{kern}", f"{r['tflops']:.1f} ({100 * r['peak_frac']:.1f}%)",
                     _ratio(base, r, "ragged_dot"), _ratio(base, r, "padded_bmm")]
        body.append([r["workload"], r["kind"], r["name"], r["impl"] + _gate_up_note(r), r["blocks"] or "–"] + cells)
    return summary(rows) + "\n" + markdown_table(header, body) + "\n"

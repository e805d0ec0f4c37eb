"""MoE routed-expert throughput: the Pallas grouped matmul (`kernels.gmm`) against
`jax.lax.ragged_dot`, forward + backward, counting active FLOPs only.

    python benchmarks/moe.py                  # on a Hopper GPU: K3 per-device + k3_small shapes
    python benchmarks/moe.py --quick          # tiny shapes on CPU (Pallas interpreted), a smoke test

Workloads (bf16, f32 accumulation, SwiGLU experts):
- "k3_device": one device's share of K3's LatentMoE experts: latent 3584, expert width 3072,
  128 experts, top-16 routing of 32768 tokens (524288 token-expert rows);
- "k3_small": the expert shapes of `configs/k3_small.py` (read from the config), 32768 tokens.
Routing is the top-k of random scores (near-uniform loads). Two measurements per workload and
impl: "ffn" (the grouped expert FFN over tokens already sorted by expert: three grouped matmuls)
and "layer" (the whole routed path of `moe_dispatch.ragged_dispatch`: sort, FFN, un-sort,
weighted combine). FLOPs = 3 matmuls x 2*rows*D*F forward, x3 for forward + backward; TFLOP/s
and the fraction of the H200's 790 TFLOP/s dense bf16 peak are reported, with the ratio of the
Pallas time to ragged_dot's. Writes JSON and a markdown table under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import PEAK_TFLOPS, environment, markdown_table, time_jax  # noqa: E402
from kernels.gmm import gmm  # noqa: E402
from kimi_jax.moe_dispatch import (  # noqa: E402
    ExpertWeights, grouped_ffn, ragged_dispatch, sort_by_expert)

IMPLS = ("pallas_gpu", "ragged_dot")


def k3_small_shapes():
    """(latent width, expert width, experts, top_k) of configs/k3_small.py."""
    from configs import k3_small

    moe = k3_small.get_config().model.moe
    return moe.latent_dim, moe.expert_hidden, moe.num_experts, moe.top_k


def workloads(quick: bool):
    if quick:
        return [dict(name="quick", tokens=32, d=64, f=64, experts=2, top_k=2)]
    d, f, e, k = k3_small_shapes()
    return [dict(name="k3_device", tokens=32768, d=3584, f=3072, experts=128, top_k=16),
            dict(name="k3_small", tokens=32768, d=d, f=f, experts=e, top_k=k)]


def _inputs(w, seed=0):
    rng = np.random.default_rng(seed)
    n, d, f, e, k = w["tokens"], w["d"], w["f"], w["experts"], w["top_k"]
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
    idx = jnp.asarray(np.argsort(-rng.normal(size=(n, e)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(n, k)) / k, jnp.float32)
    scale = lambda fan_in: 1.0 / np.sqrt(fan_in)  # noqa: E731
    experts = ExpertWeights(
        jnp.asarray(rng.normal(size=(e, d, f)) * scale(d), jnp.bfloat16),
        jnp.asarray(rng.normal(size=(e, d, f)) * scale(d), jnp.bfloat16),
        jnp.asarray(rng.normal(size=(e, f, d)) * scale(f), jnp.bfloat16))
    return x, idx, weights, experts


def _swiglu(gate, up):
    return jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


def _steps(impl):
    matmul = lambda a, b, gs: gmm(a, b, gs, impl=impl)  # noqa: E731

    def ffn_loss(xs, ex, gs):
        return jnp.sum(grouped_ffn(xs, gs, ex, _swiglu, matmul=matmul).astype(jnp.float32))

    def layer_loss(x, ex, idx, w):
        return jnp.sum(ragged_dispatch(x, idx, w, ex, _swiglu, matmul=matmul))

    return (jax.jit(jax.value_and_grad(ffn_loss, argnums=(0, 1))),
            jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1))))


def run(quick: bool, iters: int):
    timing = dict(warmup=0 if quick else 3, iters=iters)  # quick: one call, compile included
    rows = []
    for w in workloads(quick):
        x, idx, weights, experts = _inputs(w)
        order, token, group_sizes = sort_by_expert(idx, w["experts"])
        x_sorted = x[token]
        pairs = w["tokens"] * w["top_k"]
        flops = 3 * 3 * 2 * pairs * w["d"] * w["f"]
        times, errors = {}, {}
        for impl in IMPLS:
            ffn_step, layer_step = _steps(impl)
            steps = dict(ffn=(ffn_step, (x_sorted, experts, group_sizes)),
                         layer=(layer_step, (x, experts, idx, weights)))
            times[impl] = {}
            for part, (fn, args) in steps.items():
                # One impl failing (e.g. ragged_dot running out of memory at K3's shape on GPU)
                # is recorded in the row and does not abort the others.
                try:
                    times[impl][part] = time_jax(fn, *args, **timing)
                except Exception as e:  # noqa: BLE001
                    times[impl][part] = None
                    errors[f"{impl}/{part}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(f"{w['name']} {impl} {part}: {errors[f'{impl}/{part}']}", flush=True)
        for part in ("ffn", "layer"):
            row = dict(workload=w["name"], part=part, **{k: w[k] for k in
                       ("tokens", "d", "f", "experts", "top_k")}, gflop=flops / 1e9)
            for impl in IMPLS:
                ms = times[impl][part]
                tflops = None if ms is None else flops / (ms * 1e-3) / 1e12
                row.update({f"{impl}_ms": ms, f"{impl}_tflops": tflops,
                            f"{impl}_peak_frac": None if tflops is None else tflops / PEAK_TFLOPS,
                            f"{impl}_error": errors.get(f"{impl}/{part}")})
            both = times["ragged_dot"][part] is not None and times["pallas_gpu"][part] is not None
            row["pallas_over_ragged_speedup"] = (
                times["ragged_dot"][part] / times["pallas_gpu"][part] if both else None)
            rows.append(row)
    return rows


def _cells(r, impl):
    if r[impl + "_ms"] is None:
        return ["failed", r[impl + "_error"] or ""]
    return [f"{r[impl + '_ms']:.2f}", f"{r[impl + '_tflops']:.1f} ({100 * r[impl + '_peak_frac']:.1f}%)"]


def markdown(rows) -> str:
    header = ["workload", "part", "rows x D x F, E, k", "pallas ms", "pallas TFLOP/s (% peak)",
              "ragged_dot ms", "ragged_dot TFLOP/s (% peak)", "speedup"]
    body = [[r["workload"], r["part"],
             f"{r['tokens'] * r['top_k']} x {r['d']} x {r['f']}, {r['experts']}, {r['top_k']}"]
            + [v for impl in IMPLS for v in _cells(r, impl)]
            + ["–" if r["pallas_over_ragged_speedup"] is None else f"{r['pallas_over_ragged_speedup']:.2f}x"]
            for r in rows]
    return markdown_table(header, body) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (median)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    iters = args.iters or (1 if args.quick else 10)
    rows = run(args.quick, iters)
    meta = dict(environment(), quick=args.quick, iters=iters, peak_tflops=PEAK_TFLOPS)
    os.makedirs(args.out, exist_ok=True)
    stem = "moe_quick" if args.quick else "moe"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    table = markdown(rows)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(f"MoE routed experts, fwd+bwd, {meta['device']}, jax {meta['jax']}, "
                f"{meta['date']}\n\n{table}")
    print(table)
    return rows


if __name__ == "__main__":
    main()

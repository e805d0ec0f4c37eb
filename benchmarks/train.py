"""Train-step throughput and MFU: the jitted, donated train step of train.py on synthetic tokens,
on 1 device and on 2 devices (data parallel), for a K3-topology dense model of about 1.3B
parameters (configs/k3_1b3_dense.py).

    python benchmarks/train.py                         # on the GPU machine: 1 and 2 GPUs
    python benchmarks/train.py --devices 1 --batch_size 8 --seq_len 4096
    python benchmarks/train.py --quick                 # tiny config on CPU, a smoke test

FLOPs per token come from `kimi_jax.summary.train_flops_per_token` (forward + backward,
mixer-aware); MFU = FLOPs/token x tokens/s / (devices x peak), the peak from the device table in
kimi_jax/logging_utils.py (H200 bf16: 790 TFLOP/s measured) or --peak_flops. Writes JSON and a
markdown table under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kimi_jax import logging_utils, optim, sharding, train_lib  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load_config(path: str):
    """get_config() of a config file, with an optional ":arg"."""
    path, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("bench_config", path)
    if spec is None:
        raise FileNotFoundError(f"config file {path!r} not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg or None)


def synthetic_batch(rng, batch: int, seq_len: int, vocab: int) -> dict:
    tokens = rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((batch, seq_len), bool),
            "segment_ids": np.ones((batch, seq_len), np.int32)}


def bench_devices(config, n: int, batch_per_device: int, seq_len: int, steps: int, warmup: int) -> dict:
    """Time `steps` train steps on the first `n` devices (data parallel) after `warmup` steps."""
    devices = jax.devices()[:n]
    if len(devices) < n:
        raise ValueError(f"{n} devices requested, {len(devices)} present")
    mesh = sharding.make_mesh({"data": n}, devices=devices)
    graphdef, params, rest = train_lib.abstract_model(config)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    shardings = train_lib.state_shardings(tx, params, rest, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.jit(train_lib.make_init(config, tx), out_shardings=shardings)()
    step_fn = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule), donate_argnums=(0,),
                      out_shardings=(shardings, replicated))
    batch_size = batch_per_device * n
    batch = synthetic_batch(np.random.default_rng(0), batch_size, seq_len, config.model.vocab_size)
    with jax.set_mesh(mesh):
        batch = train_lib.global_batch(batch, mesh)
        t0 = time.perf_counter()
        for i in range(warmup):
            state, metrics = step_fn(state, batch, jnp.asarray(i + 1, jnp.int32))
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(steps):
            state, metrics = step_fn(state, batch, jnp.asarray(warmup + i + 1, jnp.int32))
        jax.block_until_ready(metrics)
        elapsed = (time.perf_counter() - t0) / steps
    tokens_per_sec = batch_size * seq_len / elapsed
    flops_token = logging_utils.flops_per_token(config, seq_len, num_params)
    peak = logging_utils.peak_flops_per_device(config.peak_flops)
    return {"devices": n, "device_kind": devices[0].device_kind, "params": num_params, "batch": batch_size,
            "seq_len": seq_len, "step_ms": 1000 * elapsed, "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / n, "flops_per_token": flops_token,
            "mfu": flops_token * tokens_per_sec / (peak * n) if peak else None,
            "warmup_s": compile_s, "loss": float(metrics["loss"])}


def markdown(rows: list[dict]) -> str:
    lines = ["| devices | device | params | batch x seq | step ms | tokens/s | tokens/s/device | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['devices']} | {r['device_kind']} | {r['params'] / 1e6:,.1f}M | {r['batch']} x {r['seq_len']} "
                     f"| {r['step_ms']:.1f} | {r['tokens_per_sec']:,.0f} | {r['tokens_per_sec_per_device']:,.0f} "
                     f"| {mfu} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/k3_1b3_dense.py")
    parser.add_argument("--devices", default="1,2", help="comma-separated device counts (data parallel)")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per device")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak_flops", type=float, default=0.0, help="per device; 0 = device table")
    parser.add_argument("--quick", action="store_true", help="configs/tiny.py, tiny shapes (CPU smoke test)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_<time>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.config, args.batch_size, args.seq_len, args.steps, args.warmup = "configs/tiny.py", 2, 32, 2, 1
    config = load_config(args.config)
    config.peak_flops = args.peak_flops or config.peak_flops
    counts = [int(n) for n in args.devices.split(",") if n]
    available = [n for n in counts if n <= jax.device_count()]
    if len(available) < len(counts):
        print(f"skipping device counts {sorted(set(counts) - set(available))}: {jax.device_count()} present")
    rows = [bench_devices(config, n, args.batch_size, args.seq_len, args.steps, args.warmup) for n in available]
    table = markdown(rows)
    print(table)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(RESULTS, f"train_{'quick_' if args.quick else ''}{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    result = {"config": args.config, "jax": jax.__version__, "time": stamp, "rows": rows, "markdown": table}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

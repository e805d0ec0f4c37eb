"""Train-step throughput and MFU: the jitted, donated train step of train.py on synthetic tokens,
on 1 device and on 2 devices (data parallel), for a K3-topology dense model of about 1.3B
parameters (configs/k3_1b3_dense.py).

    python benchmarks/train.py                         # on the GPU machine: 1 and 2 GPUs
    python benchmarks/train.py --devices 1 --batch_size 4,8 --remat dots,dots16
    python benchmarks/train.py --rows 1:dots:8,2:dots:8,1:dots16:4,2:dots16:4 --scale_best
    python benchmarks/train.py --rows 1:dots16:4,1:dots16:4:diag=split,2:dots16:4,2:dots16:4:mesh=fsdp
    python benchmarks/train.py --compile_only          # abstract lower + compile, memory analysis
    python benchmarks/train.py --deviceless 2 --rows 2:dots16:8:dispatch=auto   # compile for 2 H200s, no GPU
    python benchmarks/train.py --quick                 # tiny config on CPU, a smoke test

Rows: device count x remat policy (kimi_jax/remat.py) x sequences per device, or --rows
(`devices:remat:batch[:settings]`, the settings `key=value` joined by "/": `mesh=data|fsdp`, the
mesh axis the devices form (data parallel, or FSDP: parameters and optimizer state sharded,
gathered per use), the KDA kernel module settings (`kernels.kda.chunk.SETTINGS`: `diag`, `rows`,
`scores`, ...), the short conv backward's tap sums
`conv_dw=auto|stacked|per_tap|variadic|pallas_gpu|pallas_gpu_da`, the recurrent mixers' activation
`layout=xla|row_major`, the GLUs' and the norms' backward `glu_vjp=autodiff|recompute`,
`norm_vjp=autodiff|recompute`, the attention-residual reads' outputs `attn_res_out=xla|saved`,
the MoE dispatch the row's model is built with `dispatch=auto|ragged|gmm|expert_parallel`,
read while the row is traced; `benchmarks/train_settings.py`). Every
phase is timed apart and printed as it ends: step lowering and compile (`.lower(...).compile()`
on abstract inputs; each row compiles in a thread while the next is traced, and nothing runs
before all are compiled, so compiles do not disturb timings), the state's initialisation, the
warm-up steps, then each timed step (the median is reported; as in train.py's loop, a step's loss
is read after the next step is dispatched, so host dispatch overlaps the device; --sync blocks on
every step). The state is initialised op by
op, not jitted: a jitted init of the 1.3B model compiles as long as the step itself (60 s on
CPU); op by op takes seconds since the 24 layers repeat a few shapes. The JSON is rewritten
after every phase of every row (with the XLA environment: XLA_PYTHON_CLIENT_MEM_FRACTION
must allow the step's memory, JAX's default pool is 75% of the GPU); a row that fails (out of memory, say) records its error and the
next row runs. --scale_best runs, of the multi-device rows, only those with the policy and
per-device batch of the fastest one-device row; `scaling_efficiency` divides each multi-device
row's tokens/s by n x the one-device row of the same setting.

FLOPs per token (`flops_per_token`) are the model's forward + backward FLOPs from
`kimi_jax.flops` (2 per multiply-add, backward = 2 x forward): every projection and MLP matmul,
the head, MLA's attention over the average causal context T/2, the KDA chunked recurrence
(chunk 64) and the attention-residual reads. Recomputation by remat is NOT counted (MFU is model
FLOPs utilisation). tests/test_flops_xla.py checks the count against XLA's cost analysis of the
compiled forward: equal within 1% once the masked half of MLA's [T, T] scores is added. MFU = flops_per_token x tokens/s / (devices x peak), the peak from the device
table in kimi_jax/logging_utils.py (H200 bf16: 790 TFLOP/s measured matmul peak) or --peak_flops;
`mfu_vendor` divides by the vendor's dense bf16 figure instead (H100/H200 SXM: 989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import datetime
import functools
import gc
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--deviceless" in sys.argv:  # the CUDA plugin beside the CPU backend, no driver needed
    os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.train_settings import MESH_AXES, parse_row, parse_settings, traced_with  # noqa: E402,F401
from kernels.kda import chunk_intra, hopper  # noqa: E402
from kimi_jax import flops, logging_utils, optim, sharding, train_lib  # noqa: E402
from kimi_jax.remat import POLICIES  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ENV_KEYS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "NCCL_NVLS_ENABLE")
VENDOR_PEAK = {"h100": 989e12, "h200": 989e12}  # dense bf16, SXM
FLOPS_NOTE = ("model FLOPs, forward + backward (3 x forward, 2 per multiply-add) from kimi_jax.flops: "
              "projections, MLP, head, MLA attention over the mean causal context T/2, KDA chunked "
              "recurrence (chunk 64), attention-residual reads; remat recomputation not counted. Equal "
              "within 1% to XLA's cost analysis of the compiled forward once the masked half of MLA's "
              "[T, T] scores is added (tests/test_flops_xla.py)")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def abstract_batch(batch: int, seq_len: int, spec) -> dict:
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.bool_, "segment_ids": jnp.int32}
    return {k: jax.ShapeDtypeStruct((batch, seq_len), d, sharding=spec) for k, d in dtypes.items()}


def memory_gib(compiled) -> dict:
    """Argument / output / temporary bytes of a compiled executable, in GiB (None where the
    backend does not report them)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return {}
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    return {k.replace("_size_in_bytes", "_gib"): round(getattr(ma, k) / 2**30, 3) for k in keys if hasattr(ma, k)}


def is_oom(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def flop_counts(config, seq_len: int) -> tuple[float, dict]:
    """(train FLOPs per token, forward FLOPs per token by component)."""
    from kimi_jax import summary

    cfg = summary.model_config(config)
    return flops.train_flops_per_token(cfg, seq_len), flops.forward_flops_breakdown(cfg, seq_len)


def prepare_row(config, n: int, batch_per_device: int, seq_len: int, settings: dict | None = None,
                devices=None) -> tuple[dict, dict]:
    """Lower the train step on the first `n` devices (a data-parallel mesh, or the axis named by
    settings["mesh"]) with abstract inputs, the model's MoE dispatch settings["dispatch"] if given
    (`config` is the row's own copy), the KDA module settings among `settings` (see
    `parse_settings`) in place while tracing.
    Returns the row (what the JSON records) and the context `compile_row` / `run_row` need.
    `devices`: where to take the n from (default `jax.devices()`; for --deviceless
    `mosaic_ptxas.deviceless_devices`)."""
    devices = list(jax.devices() if devices is None else devices)[:n]
    settings = settings or {}
    if "dispatch" in settings:
        if not config.model.get("moe"):
            raise ValueError(f"row setting dispatch={settings['dispatch']}: {config.model.get('name', 'the model')} "
                             "has no MoE")
        config.model.moe.dispatch = settings["dispatch"]
    mesh = sharding.make_mesh({settings.get("mesh", "data"): n}, devices=devices)
    graphdef, params, rest = train_lib.abstract_model(config)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
    shardings = train_lib.state_shardings(tx, params, rest, mesh)
    batch_spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES))
    batch_size = batch_per_device * n
    row = {"devices": n, "device_kind": devices[0].device_kind, "params": num_params, "batch": batch_size,
           "seq_len": seq_len, "remat": train_lib.remat_policy(config)}
    if settings:
        row["settings"] = dict(settings)
    if config.get("xla_options"):
        row["xla_options"] = train_lib.xla_options(config.xla_options)
    step_fn = train_lib.jit_train_step(config, graphdef, tx, schedule, shardings, mesh)
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      jax.eval_shape(train_lib.make_init(config, tx)), shardings)
        lowered = traced_with(settings, lambda: step_fn.lower(
            abstract_state, abstract_batch(batch_size, seq_len, batch_spec), jax.ShapeDtypeStruct((), jnp.int32)))
    row["step_lower_s"] = time.perf_counter() - t0
    log(f"{label(row)}: step lowered in {row['step_lower_s']:.1f} s")
    return row, {"config": config, "mesh": mesh, "tx": tx, "shardings": shardings, "lowered": lowered}


def setting(row: dict, skip=()) -> str:
    """The row's remat policy and settings (less the keys in `skip`), e.g. "dots16 diag=split"."""
    xla = [f"{k}={str(v).lower()}" for k, v in sorted(row.get("xla_options", {}).items())]
    return " ".join([row["remat"]] + [f"{k}={v}" for k, v in sorted(row.get("settings", {}).items()) if k not in skip]
                    + xla)


def label(row: dict) -> str:
    return f"{row['devices']} device(s), batch {row['batch']} x {row['seq_len']}, remat {setting(row)}"


def compile_row(row: dict, ctx: dict):
    """XLA-compile a prepared row (thread-safe: rows compile in parallel); records the time and
    the step's memory."""
    t0 = time.perf_counter()
    step = ctx["lowered"].compile()
    row["step_compile_s"] = time.perf_counter() - t0
    row["memory"] = memory_gib(step)
    log(f"{label(row)}: step compiled in {row['step_compile_s']:.1f} s; memory (GiB per device) {row['memory']}")
    return step


def profile_row(row: dict, step, state, batch, done: int, steps: int, folder: str) -> dict:
    """Trace `steps` more train steps into `folder`/<row> and sum the kernels by model part
    (kimi_jax/profile_summary.py); the optimized HLO is written beside the trace."""
    from kimi_jax import profile_summary

    tag = f"{row['devices']}dev-{setting(row)}-b{row['batch']}".replace("/", "_").replace(" ", "-").replace("=", "")
    folder = os.path.join(folder, tag)
    os.makedirs(folder, exist_ok=True)
    jax.profiler.start_trace(folder)
    for i in range(steps):
        state, metrics = step(state, batch, jnp.asarray(done + i + 1, jnp.int32))
        float(metrics["loss"])
    jax.profiler.stop_trace()
    summary = profile_summary.write_profile(folder, step.as_text(), steps)
    log(f"{label(row)}: profile of {steps} step(s) in {folder}\n{profile_summary.markdown(summary)}")
    return summary


def run_row(row: dict, ctx: dict, step, steps: int, warmup: int, profile_steps: int = 0,
            profile_dir: str = "", sync: bool = False) -> dict:
    """Initialise the state and time `steps` train steps after `warmup` steps (then, with
    `profile_steps`, trace that many more and record where their device time goes)."""
    config, mesh, n = ctx["config"], ctx["mesh"], row["devices"]
    batch_size, seq_len = row["batch"], row["seq_len"]
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        state = jax.block_until_ready(jax.device_put(train_lib.make_init(config, ctx["tx"])(), ctx["shardings"]))
        row["init_s"] = time.perf_counter() - t0
        log(f"{label(row)}: state initialised op by op in {row['init_s']:.1f} s")
        batch = synthetic_batch(np.random.default_rng(0), batch_size, seq_len, config.model.vocab_size)
        batch = train_lib.global_batch(batch, mesh)
        # Like train.py, a step's metrics are read after the next step is dispatched (sync=False),
        # so the host's dispatch of step i+1 overlaps step i on the device; a step's time is the
        # interval between two reads. sync=True blocks on every step before the next.
        times, pending, t_last = [], None, time.perf_counter()

        def finish(i, metrics):
            nonlocal t_last
            loss = float(metrics["loss"])
            now = time.perf_counter()
            times.append(now - t_last)
            t_last = now
            log(f"step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: {1000 * times[-1]:.1f} ms, "
                f"loss {loss:.4f}")
            return loss

        for i in range(warmup + steps):
            state, metrics = step(state, batch, jnp.asarray(i + 1, jnp.int32))
            if sync:
                loss = finish(i, metrics)
                continue
            if pending is not None:
                loss = finish(*pending)
            pending = (i, metrics)
        if pending is not None:
            loss = finish(*pending)
        row["timing"] = "synchronous" if sync else "one step behind (train.py's loop)"
        if profile_steps:
            row["profile"] = profile_row(row, step, state, batch, warmup + steps, profile_steps, profile_dir)
        del state
    timed = times[warmup:]
    elapsed = statistics.median(timed)
    tokens_per_sec = batch_size * seq_len / elapsed
    flops_token, breakdown = flop_counts(config, seq_len)
    peak = logging_utils.peak_flops_per_device(config.peak_flops)
    kind = row["device_kind"].lower()
    vendor = next((v for k, v in VENDOR_PEAK.items() if k in kind), None)
    row.update({
        "step_ms": 1000 * elapsed, "step_ms_mean": 1000 * statistics.mean(timed),
        "step_ms_min": 1000 * min(timed), "warmup_s": sum(times[:warmup]),
        "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": tokens_per_sec / n,
        "flops_per_token": flops_token, "forward_flops_per_token_by_part": breakdown,
        "peak_flops": peak, "mfu": flops_token * tokens_per_sec / (peak * n) if peak else None,
        "mfu_vendor": flops_token * tokens_per_sec / (vendor * n) if vendor else None, "loss": loss})
    log(f"{label(row)}: {row['step_ms']:.1f} ms/step, {tokens_per_sec:,.0f} tokens/s"
        + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""))
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| devices | device | params | batch x seq | remat | step ms | tokens/s | tokens/s/device | MFU "
             "(790 TF) | MFU (989 TF) | step compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: f"{v:.1%}" if v is not None else "n/a"  # noqa: E731
    for r in rows:
        if "skipped" in r:
            continue
        if "error" in r:
            lines.append(f"| {r['devices']} | | | {r['batch']} x {r['seq_len']} | {setting(r)} | {r['error'][:60]} "
                         "| | | | | |")
            continue
        if "step_ms" not in r:  # compile only, or not run yet
            compile_s = f"{r['step_compile_s']:.1f}" if "step_compile_s" in r else ""
            lines.append(f"| {r['devices']} | {r['device_kind']} | {r['params'] / 1e6:,.1f}M | {r['batch']} x "
                         f"{r['seq_len']} | {setting(r)} | | | | | | {compile_s} |")
            continue
        lines.append(f"| {r['devices']} | {r['device_kind']} | {r['params'] / 1e6:,.1f}M | {r['batch']} x {r['seq_len']} "
                     f"| {setting(r)} | {r['step_ms']:.1f} | {r['tokens_per_sec']:,.0f} "
                     f"| {r['tokens_per_sec_per_device']:,.0f} | {pct(r['mfu'])} | {pct(r['mfu_vendor'])} "
                     f"| {r['step_compile_s']:.1f} |")
    return "\n".join(lines)


def run_order(rows: list[dict]) -> list[int]:
    """Indices of `rows` in run order: one-device rows first; among rows of one device count the
    largest temporaries first. Memory a row frees stays in JAX's allocator pool, split where that
    row's buffers were, so a larger row run after a smaller one can fail to find one contiguous
    block that a fresh process would have had."""
    temp = lambda r: (r.get("memory") or {}).get("temp_gib", 0.0)  # noqa: E731
    return sorted(range(len(rows)), key=lambda i: (rows[i]["devices"], -temp(rows[i])))


def is_best_setting(row: dict, rows: list[dict]) -> bool:
    """Whether `row` has the remat policy, KDA settings and per-device batch of the fastest
    one-device row."""
    ones = [r for r in rows if r["devices"] == 1 and "tokens_per_sec" in r]
    if not ones:
        return True
    best = max(ones, key=lambda r: r["tokens_per_sec"])
    return (setting(row, ("mesh",)), row["batch"] // row["devices"]) == (setting(best, ("mesh",)), best["batch"])


def scaling(rows: list[dict]) -> dict:
    """tokens/s of each multi-device row over n x the one-device row with the same per-device
    batch, remat policy and KDA settings (any mesh axis), keyed "<devices>x<batch per device>/<setting>"."""
    ones = {(r["batch"], setting(r, ("mesh",))): r for r in rows if r["devices"] == 1 and "tokens_per_sec" in r}
    out = {}
    for r in rows:
        if r["devices"] < 2 or "tokens_per_sec" not in r:
            continue
        base = ones.get((r["batch"] // r["devices"], setting(r, ("mesh",))))
        if base:
            key = f"{r['devices']}x{r['batch'] // r['devices']}/{setting(r)}"
            out[key] = r["tokens_per_sec"] / (r["devices"] * base["tokens_per_sec"])
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/k3_1b3_dense.py")
    parser.add_argument("--devices", default="1,2", help="comma-separated device counts (data parallel)")
    parser.add_argument("--batch_size", default=None,
                        help="sequences per device, comma-separated for several rows (default 4; --quick: 2)")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--remat", default=None,
                        help=f"comma-separated policies of {sorted(POLICIES)} (rows); default: the config's")
    parser.add_argument("--rows", default="",
                        help="explicit rows devices:remat:batch_per_device[:settings], comma-separated "
                             "(overrides the grid; settings e.g. mesh=fsdp/diag=split/scores=tiled)")
    parser.add_argument("--scale_best", action="store_true",
                        help="of the multi-device rows run only those of the fastest one-device setting")
    parser.add_argument("--deadline_s", type=float, default=0.0,
                        help="once this many seconds have passed less --reserve_s, skip the remaining "
                             "one-device rows so the multi-device rows still run (0: no deadline)")
    parser.add_argument("--reserve_s", type=float, default=60.0)
    parser.add_argument("--compile_workers", type=int, default=4, help="rows compiled in parallel")
    parser.add_argument("--xla_options", default=None,
                        help="config.xla_options for every row, e.g. xla_allow_excess_precision=false")
    parser.add_argument("--kda_impl", default="", help="override config.model.mixers.kda.impl (kernels.kda.IMPLS)")
    parser.add_argument("--kda_diag_mode", default="", choices=("",) + chunk_intra.DIAG_MODES,
                        help="kernels.kda.chunk_intra.DIAG_MODE for the run (read while tracing)")
    parser.add_argument("--compile_cache", default="", help="persistent compilation cache folder")
    parser.add_argument("--compile_only", action="store_true", help="lower + compile with abstract inputs only")
    parser.add_argument("--deviceless", type=int, default=0,
                        help="compile only, for this many H200s described ahead of time (no GPU; the kernels "
                             "traced as on Hopper): each row's compile time and memory per device")
    parser.add_argument("--peak_flops", type=float, default=0.0, help="per device; 0 = device table")
    parser.add_argument("--profile_steps", type=int, default=0,
                        help="after timing, trace this many steps per row and sum device time by model part")
    parser.add_argument("--profile_dir", default="", help="trace folder (default: beside the JSON)")
    parser.add_argument("--sync", action="store_true",
                        help="block on every step's loss before dispatching the next (default: read it "
                             "one step behind, as train.py does, so dispatch overlaps the device)")
    parser.add_argument("--quick", action="store_true", help="configs/tiny.py, tiny shapes (CPU smoke test)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_<time>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.config, args.seq_len, args.steps, args.warmup = "configs/tiny.py", 32, 2, 1
    args.batch_size = args.batch_size or ("2" if args.quick else "4")
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    config = load_config(args.config)
    config.peak_flops = args.peak_flops or config.peak_flops
    if args.kda_impl:
        config.model.mixers.kda.impl = args.kda_impl
    if args.xla_options is not None:
        train_lib.xla_options(args.xla_options)  # a malformed entry raises before anything compiles
        config.xla_options = args.xla_options
    if args.kda_diag_mode:
        chunk_intra.DIAG_MODE = args.kda_diag_mode
    remats = args.remat.split(",") if args.remat else [train_lib.remat_policy(config)]
    batches = [int(v) for v in args.batch_size.split(",") if v]
    counts = [int(n) for n in args.devices.split(",") if n]
    if args.deviceless < 0:
        raise ValueError(f"--deviceless {args.deviceless}: a number of GPUs")
    if args.deviceless:
        from benchmarks.mosaic_ptxas import deviceless_devices
    device_pool = deviceless_devices(args.deviceless) if args.deviceless else jax.devices()
    args.compile_only = args.compile_only or bool(args.deviceless)
    assumed = functools.partial(hopper.assume_device_kind, "hopper") if args.deviceless else contextlib.nullcontext
    available = [n for n in counts if n <= len(device_pool)]
    if len(available) < len(counts):
        log(f"skipping device counts {sorted(set(counts) - set(available))}: {len(device_pool)} present")
    start = time.perf_counter()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(RESULTS, f"train_{'quick_' if args.quick else ''}{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    log(f"jax {jax.__version__}, {len(device_pool)} x {device_pool[0].device_kind}{' (deviceless)' if args.deviceless else ''}; "
        f"writing {out}")
    specs = [(n, r, b, {}) for n in available for r in remats for b in batches]
    if args.rows:  # explicit rows instead of the grid
        specs = [parse_row(item) for item in args.rows.split(",")]
        specs = [spec for spec in specs if spec[0] <= len(device_pool)]
    rows, contexts = [], []

    def fail(row, e, what):
        kind = "OOM" if is_oom(e) else type(e).__name__
        log(f"{label(row)}: {what} failed: {kind}: {str(e)[:2000]}")
        row["error"] = f"{kind}: {str(e)[:500]}"

    def save():
        result = {"config": args.config, "kda_impl": config.model.mixers.get("kda", {}).get("impl", "auto"),
                  "kda_diag_mode": args.kda_diag_mode or "default",
                  "jax": jax.__version__, "time": stamp,
                  "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}, "flops_counting": FLOPS_NOTE,
                  "rows": rows, "scaling_efficiency": scaling(rows), "markdown": markdown(rows)}
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return result

    # Tracing is Python (one row after the other); XLA compiles in parallel threads meanwhile (the
    # GIL is released). Nothing runs on the devices until every row is compiled.
    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.compile_workers))
    futures = []
    for n, r, b, settings in specs:
        cfg = copy.deepcopy(config)
        cfg.remat = r
        try:
            with assumed():  # --deviceless: the kernels and impls chosen as on a Hopper GPU
                row, ctx = prepare_row(cfg, n, b, args.seq_len, settings, devices=device_pool)
            futures.append(pool.submit(compile_row, row, ctx))
        except Exception as e:  # noqa: BLE001 - record the failure, go on with the next row
            row, ctx = {"devices": n, "batch": b * n, "seq_len": args.seq_len, "remat": r, "settings": settings}, None
            fail(row, e, "lowering")
            futures.append(None)
        rows.append(row)
        contexts.append(ctx)
        save()
    steps = []
    for row, fut in zip(rows, futures):
        try:
            steps.append(fut.result() if fut else None)
        except Exception as e:  # noqa: BLE001
            fail(row, e, "compile")
            steps.append(None)
        save()
    pool.shutdown()
    result = save()
    if not args.compile_only:
        order = run_order(rows)
        for i in order:
            row, ctx = rows[i], contexts[i]
            if steps[i] is None:
                continue
            late = args.deadline_s and time.perf_counter() - start > args.deadline_s - args.reserve_s
            if late and row["devices"] == 1 and any(r["devices"] > 1 for r in rows):
                row["skipped"] = f"past --deadline_s {args.deadline_s} less --reserve_s {args.reserve_s}"
                log(f"{label(row)}: skipped, {row['skipped']}")
                steps[i] = None
                continue
            if args.scale_best and row["devices"] > 1 and not is_best_setting(row, rows):
                row["skipped"] = "not the fastest one-device setting (--scale_best)"
                steps[i] = None
                continue
            try:
                run_row(row, ctx, steps[i], args.steps, args.warmup, args.profile_steps,
                        args.profile_dir or os.path.splitext(out)[0] + "-profile", args.sync)
            except Exception as e:  # noqa: BLE001
                fail(row, e, "run")
            steps[i] = None
            gc.collect()
            save()
    result = save()
    print(result["markdown"], flush=True)
    if result.get("scaling_efficiency"):
        log(f"scaling efficiency (tokens/s over n x one device): {result['scaling_efficiency']}")
    log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

"""MoE routed-expert throughput on one GPU: the Pallas grouped matmul (`kernels.gmm`) against
XLA baselines, per kernel and for the whole expert FFN / routed layer, counting active FLOPs.

    python benchmarks/moe.py --out DIR             # Hopper GPU: K3 per-device + k3_small shapes
    python benchmarks/moe.py --out DIR --sweep     # + a tile sweep, best tile per kernel
    python benchmarks/moe.py --out DIR --sweep ws --no_steps --baselines ""   # one tile family
    python benchmarks/moe.py --quick --out DIR     # tiny shapes on CPU (Pallas interpreted)
    python benchmarks/moe.py --out DIR --workloads k3_small --gate_up separate,fused,fused_bwd,fused_glu   # gate/up forms
    python benchmarks/moe.py --out DIR --workloads k3_small --profile 20   # + kernel time per step
    python benchmarks/moe.py --out DIR --workloads k3_small --gate_up fused_glu --glu_blocks 64x128x64/3,64x128x64/4
    python benchmarks/moe.py --out DIR --workloads k3_small --gate_up fused_glu,fused_ffn --ffn_blocks 64x64x64/2,64x128x64/2
    python benchmarks/moe.py --out DIR --workloads k3_small --pair_sort argsort,counting   # the dispatch's sort
    python benchmarks/moe.py --out DIR --workloads k3_device --gate_up separate,fused_glu --no_kernels   # steps only

Times: ms per call with calls queued back to back (median of 3 runs of >= 50 ms), after one
warm-up call; `ms_sync` (waiting on every call) is kept too. `--budget_s` stops starting new
measurements; rows come in order of value (baselines and default tiles, fwd+bwd steps, sweep,
steps with the best tiles).

Workloads (bf16, f32 accumulation, SwiGLU experts, routing = top-k of random scores):
- "k3_device": one device's share of K3's LatentMoE experts: latent D=3584, expert width F=3072,
  128 experts, top-16 routing of 32768 tokens (M = 524288 token-expert rows);
- "k3_small": the expert shapes of configs/k3_small.py (D=256, F=224, 8 experts, top-2).

Rows of the JSON (rewritten after every measurement, so a crash or timeout keeps what ran):
- kind "kernel": one grouped matmul alone, [M, K] x [E, K, N] as gmm_fwd (gate/up: K=D, N=F;
  down: K=F, N=D), gmm_dlhs (dout [M, F] x W^T), tgmm (the weight gradient [E, D, F]);
  FLOPs 2*M*K*N. Pallas per tile (bm, bn, bk, stages), ragged_dot, padded_bmm.
- kind "step": "ffn" (three grouped matmuls over rows already sorted by expert) and "layer"
  (`moe_dispatch.ragged_dispatch`: sort, FFN, un-sort, weighted combine), forward + backward;
  FLOPs 9 * 2*M*D*F. Pallas with the default tiles and with the best tile of every kernel.
Impls: "pallas_gpu"; "ragged_dot" (jax.lax.ragged_dot; XLA's GPU lowering materialises a dense
[M, E, K] operand, 448 GiB at k3_device, so there it fails in compilation or allocation: the row
keeps the error and `dense_gib`, and compiled programs over the device's memory are skipped
before running); "padded_bmm" (the baseline that runs at every shape: every expert's rows
scattered into a [E, C, K] buffer, C = largest group rounded up to 128, one XLA batched matmul;
it executes E*C/M times the active FLOPs, reported TFLOP/s count active only).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import PEAK_TFLOPS, attempt, device_profile, environment  # noqa: E402
from kernels import mxfp4  # noqa: E402
from kernels.gmm import ops as gmm_ops, pallas_gpu, reference  # noqa: E402
from kernels.gmm.glu import DEFAULT_FFN_BLOCKS, DEFAULT_GLU_BLOCKS, glu_ffn  # noqa: E402
from kimi_jax import moe_dispatch  # noqa: E402
from kimi_jax.ffn import glu_activation  # noqa: E402
from kimi_jax.moe_dispatch import (  # noqa: E402
    ExpertWeights, grouped_ffn, ragged_dispatch, sort_by_expert)
from benchmarks.moe_report import Recorder, _blocks_str, markdown, rel_rms  # noqa: E402

Blocks = pallas_gpu.Blocks
DEFAULT = gmm_ops.DEFAULT_BLOCKS  # (forward, dlhs, drhs) tiles the library uses
# Tiles that fit the 227 KiB of shared memory (checked by lowering for CUDA); wgs=2: the
# warp-specialized persistent kernels. tgmm's tiles are (bm contracted rows, output bk x bn).
# Measured out on an H200 at k3_device: one warpgroup with a 128 x 256 accumulator (spills,
# 17% of peak), 64-row tiles (57%), and band=1 for gmm (55% vs 76% with band 8).
SWEEP_GMM = (Blocks(), Blocks(128, 128, 64, 3), Blocks(128, 128, 64, 2), Blocks(128, 128, 128, 3),
             Blocks(128, 128, 64, 4, band=4), Blocks(128, 128, 64, 4, band=16),
             Blocks(128, 256, 64, 3, wgs=2), Blocks(128, 128, 64, 4, wgs=2),
             Blocks(128, 256, 64, 3, band=4, wgs=2), Blocks(128, 128, 128, 3, wgs=2))
SWEEP_TGMM = (Blocks(), Blocks(128, 128, 128, 3), Blocks(128, 128, 128, 3, band=1),
              Blocks(128, 128, 128, 2), Blocks(128, 128, 64, 4, band=1),
              Blocks(64, 256, 128, 3, wgs=2), Blocks(128, 128, 128, 3, wgs=2),
              Blocks(64, 256, 64, 4, wgs=2))
# Warp-specialized gmm with one pipeline across tiles (`--sweep chain`, best run on its own: a
# barrier error in a warp-specialized kernel would hang rather than fail).
SWEEP_CHAIN = (Blocks(128, 128, 64, 4, wgs=2, chain=True),
               Blocks(128, 256, 64, 3, wgs=2, chain=True),
               Blocks(128, 256, 64, 2, wgs=2, chain=True),
               Blocks(128, 256, 64, 3, band=4, wgs=2, chain=True))
# Narrow experts (k3_small: K = 256, N = 224, 65536 rows): at 128 x 128 tiles each gmm is 1024 short
# tiles of 4 K-steps at 14% of peak; these try fewer, wider N tiles (x read once) and 64-row tiles
# (more programs per SM), and tgmm tiles that give more programs over its [K, N] outputs; each
# lowers for sm_90a without spills (128 x 256 in one warpgroup spills). Timed on an H100 (results/
# moe-k3small-narrow-h100-20261205T1016.json) none is outside the default's spread (13.7% -> 14.5%).
SWEEP_NARROW_GMM = (Blocks(64, 256, 64, 3), Blocks(64, 256, 64, 4), Blocks(64, 128, 64, 4),
                    Blocks(64, 128, 128, 3), Blocks(64, 256, 128, 2), Blocks(128, 256, 64, 3, wgs=2),
                    Blocks(64, 256, 64, 4, wgs=2))
SWEEP_NARROW_TGMM = (Blocks(128, 128, 64, 4), Blocks(128, 64, 128, 3), Blocks(64, 128, 128, 4),
                     Blocks(128, 128, 128, 2), Blocks(64, 256, 128, 3, wgs=2))
_ws = lambda tiles, ws: tuple(b for b in tiles if (b.wgs == 2) == ws)  # noqa: E731
# "plain" and "ws" split "main" so that each can run in its own process (and time limit).
SWEEPS = dict(main=(SWEEP_GMM, SWEEP_TGMM), chain=(SWEEP_CHAIN, ()),
              plain=(_ws(SWEEP_GMM, False), _ws(SWEEP_TGMM, False)),
              ws=(_ws(SWEEP_GMM, True), _ws(SWEEP_TGMM, True)),
              narrow=(SWEEP_NARROW_GMM, SWEEP_NARROW_TGMM))
KERNELS = ("gmm_fwd_gate", "gmm_fwd_down", "gmm_dlhs", "tgmm")


def workloads(quick: bool):
    if quick:
        return [dict(name="quick", tokens=64, d=64, f=128, experts=3, top_k=2)]
    # k3_small: configs/k3_small.py's moe (latent_dim, expert_hidden, num_experts, top_k); not
    # read from the config so that this script needs no ml_collections.
    # k3_small first: it takes seconds, and the time budget then goes to k3_device.
    return [dict(name="k3_small", tokens=32768, d=256, f=224, experts=8, top_k=2, share=0.2),
            dict(name="k3_device", tokens=32768, d=3584, f=3072, experts=128, top_k=16)]


def _inputs(w, seed=0):
    """Generated on the device (host RNG for K3's 4e9 weights would take a minute)."""
    n, d, f, e, k = w["tokens"], w["d"], w["f"], w["experts"], w["top_k"]
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.normal(keys[1], (n, e)), k)[1].astype(jnp.int32)
    weights = jax.random.uniform(keys[2], (n, k), jnp.float32) / k
    experts = ExpertWeights(
        (jax.random.normal(keys[3], (e, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16),
        (jax.random.normal(keys[4], (e, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16),
        (jax.random.normal(keys[5], (e, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16))
    return x, idx, weights, experts


_swiglu = glu_activation("swiglu")  # silu(gate) * up in float32, named for the fused GLU kernels


def padded_bmm(capacity: int):
    """gmm/tgmm as XLA batched matmuls over experts padded to `capacity` rows each."""

    def slots(group_sizes, m):
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])
        rows = jnp.arange(m, dtype=jnp.int32)
        g = jnp.searchsorted(offsets[1:], rows, side="right", method="compare_all")
        slot = g * capacity + rows - offsets[jnp.minimum(g, group_sizes.shape[0] - 1)]
        return jnp.where(g < group_sizes.shape[0], slot, group_sizes.shape[0] * capacity)

    def to_padded(a, slot, e):
        buf = jnp.zeros((e * capacity, a.shape[1]), a.dtype).at[slot].set(a, mode="drop")
        return buf.reshape(e, capacity, a.shape[1])

    def gmm(lhs, rhs, group_sizes, transpose_rhs=False):
        e, m = rhs.shape[0], lhs.shape[0]
        slot = slots(group_sizes, m)
        eq = "eck,enk->ecn" if transpose_rhs else "eck,ekn->ecn"
        out = jnp.einsum(eq, to_padded(lhs, slot, e), rhs, preferred_element_type=jnp.float32)
        out = out.reshape(e * capacity, -1).astype(lhs.dtype)
        return jnp.take(out, slot, axis=0, mode="fill", fill_value=0)

    def tgmm(lhs, dout, group_sizes):
        e = group_sizes.shape[0]
        slot = slots(group_sizes, lhs.shape[0])
        return jnp.einsum("eck,ecn->ekn", to_padded(lhs, slot, e), to_padded(dout, slot, e),
                          preferred_element_type=jnp.float32).astype(lhs.dtype)

    return gmm, tgmm


def _kernel_fn(kernel, impl, blocks, capacity):
    """(fn(x_sorted, dout_f, dout_d, experts, group_sizes), (M, K, N)) of one kernel alone."""
    if impl == "pallas_gpu":
        interpret = jax.devices()[0].platform != "gpu"
        gmm = lambda a, b, gs, t=False: pallas_gpu.gmm(  # noqa: E731
            a, b, gs, transpose_rhs=t, blocks=blocks, interpret=interpret)
        tgmm = lambda a, d, gs: pallas_gpu.tgmm(  # noqa: E731
            a, d, gs, blocks=blocks, interpret=interpret)
    elif impl == "ragged_dot":
        tgmm = reference.tgmm
        gmm = lambda a, b, gs, t=False: reference.gmm(a, b, gs, transpose_rhs=t)  # noqa: E731
    else:
        gmm, tgmm = padded_bmm(capacity)
    return {
        "gmm_fwd_gate": lambda x, df, dd, ex, gs: gmm(x, ex.gate, gs),
        "gmm_fwd_down": lambda x, df, dd, ex, gs: gmm(df, ex.down, gs),
        "gmm_dlhs": lambda x, df, dd, ex, gs: gmm(df, ex.gate, gs, True),
        "tgmm": lambda x, df, dd, ex, gs: tgmm(x, df, gs),
    }[kernel]


def _kernel_mkn(kernel, w):
    m, d, f = w["tokens"] * w["top_k"], w["d"], w["f"]
    return {"gmm_fwd_gate": (m, d, f), "gmm_fwd_down": (m, f, d), "gmm_dlhs": (m, f, d),
            "tgmm": (m, d, f)}[kernel]


def parse_tiles(text: str) -> tuple:
    """"64x128x64/3,64x64x64/4/band4" -> Blocks per comma-separated bm x bn x bk / stages [/ band]."""
    out = []
    for item in (t for t in text.split(",") if t):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)/(\d+)(?:/band(\d+))?", item)
        if m is None:
            raise ValueError(f"tile {item!r}: expected BMxBNxBK/STAGES[/bandN], e.g. 64x128x64/3")
        bm, bn, bk, stages, band = (int(g) if g else None for g in m.groups())
        out.append(Blocks(bm, bn, bk, stages, band=band or 8))
    return tuple(out)


def _step_fn(part, impl, blocks, capacity, glu_blocks=None):
    if impl == "pallas_gpu":
        interpret = jax.devices()[0].platform != "gpu"
        matmul = lambda a, b, gs: pallas_gpu.gmm_vjp(a, b, gs, blocks, interpret)  # noqa: E731
    elif impl == "ragged_dot":
        matmul = reference.gmm
    else:
        matmul = padded_bmm(capacity)[0]
    glu = None  # GATE_UP="fused_glu" / "fused_ffn": the FFN with its activation in the kernels
    if impl == "pallas_gpu":
        def glu(x, wg, wu, wd, gs, act, fusion):
            return glu_ffn(x, wg, wu, wd, gs, kind=act.kind, impl="pallas_gpu", blocks=blocks,
                           glu_blocks=glu_blocks, fusion=fusion)
    if part == "ffn":
        def loss(xs, ex, gs):
            return jnp.sum(grouped_ffn(xs, gs, ex, _swiglu, matmul=matmul, glu_ffn=glu).astype(jnp.float32))
    else:
        def loss(x, ex, idx, wts):
            return jnp.sum(ragged_dispatch(x, idx, wts, ex, _swiglu, matmul=matmul, glu_ffn=glu))
    return jax.value_and_grad(loss, argnums=(0, 1))


def _device_bytes():
    stats = attempt(lambda: jax.devices()[0].memory_stats())[0] or {}
    return stats.get("bytes_limit")


def measure(fn, args, warmup, iters):
    """Compile, check the compiled memory against the device, then time (median ms).
    Returns dict(ms, compile_s, mem_gib, error)."""
    t0 = time.perf_counter()
    compiled, err = attempt(lambda: jax.jit(fn).lower(*args).compile())
    out = dict(ms=None, compile_s=round(time.perf_counter() - t0, 2), mem_gib=None, error=err)
    if compiled is None:
        return out
    mem = attempt(compiled.memory_analysis)[0]
    if mem is not None:
        need = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)
        out["mem_gib"] = round(need / 2**30, 2)
        limit = _device_bytes()
        if limit and need > 0.95 * limit:
            out["error"] = f"skipped: needs {need / 2**30:.0f} GiB > device {limit / 2**30:.0f} GiB"
            return out

    def timed():
        """ms per call with calls queued back to back (host dispatch hidden, as in a training
        loop; enough calls for >= 50 ms), median of 3 such runs; `ms_sync` waits on each."""
        for _ in range(warmup):
            jax.block_until_ready(compiled(*args))
        sync = []
        for _ in range(iters):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            sync.append(time.perf_counter() - t)
        calls = int(min(200, max(iters, np.ceil(0.05 / max(min(sync), 1e-6)))))
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                res = compiled(*args)
            jax.block_until_ready(res)
            runs.append((time.perf_counter() - t) / calls)
            del res
        out.update(ms_sync=1e3 * float(np.median(sync)), calls=calls)
        return 1e3 * float(np.median(runs))

    out["ms"], out["error"] = attempt(timed)
    out["compiled"] = compiled
    return out


def mxfp4_row(w, rec, base, x_sorted, gate, group_sizes, warmup, iters):
    """The gate projection on MXFP4-packed weights (inference), checked against the bf16 Pallas
    gmm on the dequantised weights."""
    packed, scales = mxfp4.quantize(jnp.swapaxes(gate, 1, 2).astype(jnp.float32))  # [E, F, D]
    fn = lambda x, p, sc, gs: mxfp4.gmm(x, p, sc, gs, impl="pallas_gpu")  # noqa: E731
    args = (x_sorted, packed, scales, group_sizes)
    r = measure(fn, args, warmup, iters)
    compiled = r.pop("compiled", None)
    if r["ms"] is not None:
        deq = jnp.swapaxes(mxfp4.dequantize(packed, scales).astype(jnp.bfloat16), 1, 2)
        want = gmm_ops.gmm(x_sorted, deq, group_sizes, impl="pallas_gpu")
        r["check"] = dict(against="pallas_gpu bf16 on dequantised weights",
                          rel_rms=attempt(lambda: rel_rms(want, compiled(*args)))[0])
        del deq, want
    m, d, f = x_sorted.shape[0], w["d"], w["f"]
    rec.add(dict(base, kind="kernel", name="mxfp4_fwd_gate", impl="pallas_gpu",
                 blocks=_blocks_str(mxfp4.pallas_gpu.DEFAULT_BLOCKS), mkn=[m, d, f], **r),
            2 * m * d * f)


def run_workload(w, rec, *, sweep, iters, warmup, deadline, baselines, steps=True, kernels=True,
                 with_mxfp4=False, gate_up=("separate",), profile=0, glu_tiles=(DEFAULT_GLU_BLOCKS,),
                 ffn_tiles=(DEFAULT_FFN_BLOCKS,), pair_sorts=("auto",)):
    """Rows in order of value, so that the time budget cuts the least useful ones: baselines
    and default-tile kernels, the fwd+bwd steps with default tiles, the tile sweep, and last
    the steps with the best tile of every kernel. Pallas steps run once per `gate_up` mode
    (`moe_dispatch.GATE_UP`; "fused_glu" once per tile of the fused kernels in `glu_tiles`,
    "fused_ffn" once per tile in `ffn_tiles`; Pallas layer steps once per `pair_sorts` mode too),
    baselines with separate gate and up and the default pair sort."""
    x, idx, weights, experts = _inputs(w)
    order, token, group_sizes = sort_by_expert(idx, w["experts"])
    x_sorted = x[token]
    m = x_sorted.shape[0]
    gs_host = np.asarray(group_sizes)
    capacity = int(-(-gs_host.max() // 128) * 128)
    keys = jax.random.split(jax.random.key(1), 2)
    dout_f = jax.random.normal(keys[0], (m, w["f"]), jnp.bfloat16)
    dout_d = jax.random.normal(keys[1], (m, w["d"]), jnp.bfloat16)
    kargs = (x_sorted, dout_f, dout_d, experts, group_sizes)
    base = dict(workload=w["name"], **{k: w[k] for k in ("tokens", "d", "f", "experts", "top_k")},
                rows=m, max_group=int(gs_host.max()), min_group=int(gs_host.min()))
    refs, best = {}, {}  # per kernel: the first baseline's output; the fastest correct tile

    def kernel_rows(kernel, impls):
        mm, kk, nn = _kernel_mkn(kernel, w)
        for impl, b in impls:
            if rec.elapsed() > deadline:
                print(f"time budget spent: skipping {kernel} {impl}", flush=True)
                continue
            r = measure(_kernel_fn(kernel, impl, b, capacity), kargs, warmup, iters)
            compiled = r.pop("compiled", None)
            if r["ms"] is not None and (kernel not in refs or impl == "pallas_gpu"):
                out = compiled(*kargs)
                if kernel not in refs:
                    refs[kernel] = (impl, out)
                else:
                    err = attempt(lambda: rel_rms(refs[kernel][1], out))[0]
                    r["check"] = dict(against=refs[kernel][0], rel_rms=err)
                del out
            del compiled
            if impl == "ragged_dot":
                r["dense_gib"] = round(mm * w["experts"] * kk * 2 / 2**30, 1)
            rec.add(dict(base, kind="kernel", name=kernel, impl=impl, blocks=_blocks_str(b),
                         mkn=[mm, kk, nn], **r), 2 * mm * kk * nn)
            err = (r.get("check") or {}).get("rel_rms")
            ok = r["ms"] is not None and err is not None and err < 2e-2
            if impl == "pallas_gpu" and ok and (kernel not in best or r["ms"] < best[kernel][0]):
                best[kernel] = (r["ms"], b)

    def step_rows(variants):
        for part, args in (("ffn", (x_sorted, experts, group_sizes)),
                           ("layer", (x, experts, idx, weights))):
            for impl, b in variants:
                pallas = impl == "pallas_gpu"
                modes = gate_up if pallas else ("separate",)
                sorts = pair_sorts if pallas and part == "layer" else (moe_dispatch.PAIR_SORT,)
                fused = dict(fused_glu=glu_tiles, fused_ffn=ffn_tiles)
                for mode, gb, sort in ((m, t, o) for m in modes for t in fused.get(m, (None,)) for o in sorts):
                    if rec.elapsed() > deadline:
                        print(f"time budget spent: skipping {part} {impl} gate_up={mode}", flush=True)
                        continue
                    with moe_dispatch.gate_up(mode), moe_dispatch.pair_sort(sort):  # read while tracing
                        r = measure(_step_fn(part, impl, b, capacity, gb), args, warmup, iters)
                        sort_run = moe_dispatch.resolve_pair_sort(m, w["experts"])  # "auto" as resolved
                    compiled = r.pop("compiled", None)
                    if profile and impl == "pallas_gpu" and r["ms"] is not None:  # device time per call
                        r["profile"] = attempt(lambda: device_profile(compiled, args, profile, top=12))[0]
                    del compiled
                    tiles = _blocks_str(b)
                    if mode in fused:
                        tiles += f" {mode.removeprefix('fused_')} {_blocks_str(gb)}"
                    extra = dict(pair_sort=sort, pair_sort_resolved=sort_run) if part == "layer" else {}
                    rec.add(dict(base, kind="step", name=part, impl=impl, gate_up=mode, blocks=tiles, **extra,
                                 **r), 9 * 2 * m * w["d"] * w["f"])

    default = dict(gmm_fwd_gate=DEFAULT[0], gmm_fwd_down=DEFAULT[0], gmm_dlhs=DEFAULT[1],
                   tgmm=DEFAULT[2])
    for kernel in KERNELS if kernels else ():
        kernel_rows(kernel, [(i, None) for i in baselines] + [("pallas_gpu", default[kernel])])
    if with_mxfp4 and rec.elapsed() <= deadline:
        mxfp4_row(w, rec, base, x_sorted, experts.gate, group_sizes, warmup, iters)
    if steps:
        step_rows([("pallas_gpu", DEFAULT)] + [(i, None) for i in baselines])
    if not sweep:
        return
    sweep_gmm, sweep_tgmm = SWEEPS[sweep]
    for kernel in KERNELS:
        kernel_rows(kernel, [("pallas_gpu", b) for b in (sweep_tgmm if kernel == "tgmm"
                                                         else sweep_gmm) if b != default[kernel]])
    refs.clear()
    tuned = tuple(best.get(k, (0, default[k]))[1] for k in ("gmm_fwd_gate", "gmm_dlhs", "tgmm"))
    if tuned != tuple(DEFAULT):
        step_rows([("pallas_gpu", tuned)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--sweep", nargs="?", const="main", default=None, choices=list(SWEEPS),
                        help="time the tiles of SWEEPS[name] (main when no name is given)")
    parser.add_argument("--no_kernels", action="store_true",
                        help="skip the single kernels with default tiles (steps only)")
    parser.add_argument("--no_steps", action="store_true",
                        help="skip the fwd+bwd steps with default tiles")
    parser.add_argument("--mxfp4", action="store_true",
                        help="also time the gate projection on MXFP4-packed weights")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (median)")
    parser.add_argument("--workloads", default=None, help="comma-separated subset")
    parser.add_argument("--baselines", default="ragged_dot,padded_bmm")
    parser.add_argument("--gate_up", default="separate",
                        help="comma-separated moe_dispatch.GATE_UP modes the Pallas steps run with, side by side")
    parser.add_argument("--glu_blocks", default="",
                        help="with --gate_up fused_glu: the fused GLU kernels' tiles, comma-separated "
                             "BMxBNxBK/STAGES (default kernels.gmm.glu.DEFAULT_GLU_BLOCKS)")
    parser.add_argument("--ffn_blocks", default="",
                        help="with --gate_up fused_ffn: the whole-FFN kernels' tiles (BN is the F and D "
                             "tile), comma-separated BMxBNxBK/STAGES (default kernels.gmm.glu.DEFAULT_FFN_BLOCKS)")
    parser.add_argument("--pair_sort", default="auto",
                        help=f"comma-separated moe_dispatch.PAIR_SORT modes the Pallas layer steps run with, from "
                             f"{moe_dispatch.PAIR_SORTS}")
    parser.add_argument("--budget_s", type=float, default=260.0,
                        help="stop starting measurements after this many seconds")
    parser.add_argument("--profile", type=int, default=0,
                        help="trace this many calls of each Pallas step: kernel time per call by op")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    gate_up = tuple(m for m in args.gate_up.split(",") if m)
    pair_sorts = tuple(m for m in args.pair_sort.split(",") if m)
    for flag, modes, allowed in (("gate_up", gate_up, moe_dispatch.GATE_UP_MODES),
                                 ("pair_sort", pair_sorts, moe_dispatch.PAIR_SORTS)):
        for mode in modes:
            if mode not in allowed:
                parser.error(f"--{flag} {mode!r}: expected modes from {allowed}")
    try:
        glu_tiles = parse_tiles(args.glu_blocks) or (DEFAULT_GLU_BLOCKS,)
    except ValueError as e:
        parser.error(f"--glu_blocks: {e}")
    try:
        ffn_tiles = parse_tiles(args.ffn_blocks) or (DEFAULT_FFN_BLOCKS,)
    except ValueError as e:
        parser.error(f"--ffn_blocks: {e}")
    iters = args.iters or (1 if args.quick else 5)
    warmup = 0 if args.quick else 1
    meta = dict(environment(), quick=args.quick, iters=iters, warmup=warmup, sweep=args.sweep,
                peak_tflops=PEAK_TFLOPS)
    rec = Recorder(args.out, "moe_quick" if args.quick else "moe", meta)
    chosen = args.workloads.split(",") if args.workloads else None
    baselines = [b for b in args.baselines.split(",") if b]
    todo = [w for w in workloads(args.quick) if chosen is None or w["name"] in chosen]
    for i, w in enumerate(todo):
        # every workload but the last gets at most `share` of the budget
        last = i == len(todo) - 1
        deadline = args.budget_s if last else rec.elapsed() + w.get("share", 1.0) * args.budget_s
        run_workload(w, rec, sweep=args.sweep, iters=iters, warmup=warmup, steps=not args.no_steps, kernels=not args.no_kernels,
                     with_mxfp4=args.mxfp4, gate_up=gate_up or ("separate",), profile=args.profile,
                     glu_tiles=glu_tiles, ffn_tiles=ffn_tiles, pair_sorts=pair_sorts or ("auto",),
                     deadline=min(deadline, args.budget_s), baselines=baselines)
    print(markdown(rec.rows))
    return rec.rows


if __name__ == "__main__":
    main()

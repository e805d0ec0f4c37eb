"""The short convolution's backward on one GPU: the tap sums of each `CONV_DW` mode side by side,
and the Mosaic GPU tap-gradient kernel alone over its channel blocks, row splits and ring depths.

    python benchmarks/short_conv.py --out FILE.json          # Hopper GPU, default shapes
    python benchmarks/short_conv.py --quick --out FILE.json  # tiny shape on CPU (kernel interpreted)

Rows:
- kind "backward": the VJP of `kimi_jax.layers.causal_conv_silu` (dx and dw from x, w, dy; the
  forward's pre-activation recomputed) per mode. Bytes: x and dy read, dx written (3 * B*T*C *
  itemsize), the least any implementation moves.
- kind "kernel": `kernels.short_conv.pallas_gpu.tap_grads` alone (dw only) per (channels per
  program, splits, slots), and the reference (`kernels.short_conv.reference`, XLA) beside it.
  Bytes: x and dy read.
Times: ms per call with calls queued back to back (`time_jax_stream`), packed documents as
`benchmarks/train.py` feeds them (one document per row) unless --segmented.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import PEAK_TBPS, attempt, environment, markdown_table, time_jax_stream, write_json  # noqa: E402
from kernels.short_conv import ops, pallas_gpu, reference  # noqa: E402
from kimi_jax import layers  # noqa: E402

W = 4


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shapes are BxTxHxD (e.g. 4x4096x16x128); got {text!r}")
    return tuple(int(p) for p in parts)


def inputs(shape, dtype, segmented: bool):
    B, T, H, D = shape
    kx, kd, kw, ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (B, T, H, D), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (B, T, H, D), jnp.float32).astype(dtype)
    w = (0.5 * jax.random.normal(kw, (W, H, D), jnp.float32)).astype(dtype)
    seg = (jnp.cumsum(jax.random.bernoulli(ks, 1 / 512, (B, T)), axis=1) if segmented else jnp.ones((B, T))).astype(
        jnp.int32)
    return x, dy, w, seg


def backward_fn(mode: str):
    def f(x, w, seg, dy):
        with layers.conv_dw(mode):  # read while tracing
            _, vjp = jax.vjp(lambda x, w: layers.causal_conv_silu(x, w, seg), x, w)
            return vjp(dy)

    return jax.jit(f)


def row(kind, name, shape, ms, nbytes, err=None, **extra):
    gbps = None if ms is None else nbytes / (ms * 1e-3) / 1e9
    return dict(kind=kind, name=name, shape=list(shape), ms=ms, bytes=nbytes, gbps=gbps,
                pct_hbm=None if gbps is None else 100 * gbps / (1e3 * PEAK_TBPS), error=err, **extra)


def run_shape(shape, dtype, segmented, splits_list, slots_list, block_cs, modes, timer):
    B, T, H, D = shape
    x, dy, w, seg = inputs(shape, dtype, segmented)
    n, item = B * T * H * D, jnp.dtype(dtype).itemsize
    rows = []
    for mode in modes:
        ms, err = attempt(lambda: timer(backward_fn(mode), x, w, seg, dy))
        rows.append(row("backward", f"conv_dw={mode}", shape, ms, 3 * n * item, err))
        print(f"{shape} backward conv_dw={mode}: {ms} ms {err or ''}", flush=True)
    flat = lambda a: a.reshape(B, T, H * D)
    masks = ops.tap_masks(None if not segmented else seg, B, T, W)
    xf, dyf, wf = flat(x), flat(dy), w.reshape(W, H * D)
    interpret = jax.devices()[0].platform != "gpu"
    ref = jax.jit(reference.tap_grads)
    ms, err = attempt(lambda: timer(ref, xf, dyf, wf, masks))
    rows.append(row("kernel", "reference (XLA)", shape, ms, 2 * n * item, err))
    print(f"{shape} dw reference: {ms} ms {err or ''}", flush=True)
    for bc in block_cs:
        default = pallas_gpu.row_splits(B, T, H * D, block_c=bc)
        for splits in splits_list or [default]:
            for slots in slots_list:
                fn = jax.jit(functools.partial(pallas_gpu.tap_grads, splits=splits, slots=slots, block_c=bc,
                                               interpret=interpret))
                ms, err = attempt(lambda: timer(fn, xf, dyf, wf, masks))
                rows.append(row("kernel", "pallas_gpu", shape, ms, 2 * n * item, err, splits=splits, slots=slots,
                                block_c=bc, default=(splits == default and slots == pallas_gpu.SLOTS
                                                     and bc == pallas_gpu.BC)))
                print(f"{shape} dw pallas_gpu block_c={bc} splits={splits} slots={slots}: {ms} ms {err or ''}",
                      flush=True)
    return rows


def report(rows) -> str:
    out = [[r["kind"], r["name"] + (f" ({r['block_c']} ch, splits {r['splits']}, slots {r['slots']})" if "splits" in r
                                    else ""),
            "x".join(map(str, r["shape"])), "–" if r["ms"] is None else f"{r['ms']:.3f}",
            "–" if r["gbps"] is None else f"{r['gbps']:.0f} ({r['pct_hbm']:.0f}%)", (r["error"] or "")[:60]]
           for r in rows]
    return markdown_table(["kind", "impl", "B x T x H x D", "ms", "GB/s (% of 4.3 TB/s)", "error"], out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4x4096x16x128,1x65536x16x128")
    p.add_argument("--modes", default=",".join(m for m in layers.CONV_DW_MODES if m != "auto"))  # auto: one of them
    p.add_argument("--splits", default="", help="comma-separated row splits of the kernel (default: its heuristic)")
    p.add_argument("--slots", default=str(pallas_gpu.SLOTS), help="comma-separated TMA ring depths")
    p.add_argument("--block_c", default=str(pallas_gpu.BC), help="comma-separated channels per program "
                                                               f"(of {pallas_gpu.BLOCK_CS})")
    p.add_argument("--segmented", action="store_true", help="packed documents of mean length 512")
    p.add_argument("--quick", action="store_true", help="one tiny shape (CPU: the kernel interpreted)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/short-conv-<time>.json)")
    a = p.parse_args(argv)
    shapes = [parse_shape(s) for s in ("1x256x2x32" if a.quick else a.shapes).split(",") if s]
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in layers.CONV_DW_MODES:
            raise ValueError(f"--modes: {m!r} is not one of {layers.CONV_DW_MODES}")
    splits = [int(s) for s in a.splits.split(",") if s]
    slots = [int(s) for s in a.slots.split(",") if s]
    block_cs = [int(s) for s in a.block_c.split(",") if s]
    timer = (lambda f, *args: time_jax_stream(f, *args, warmup=1, iters=2, bursts=1)) if a.quick else time_jax_stream
    result = dict(env=environment(), dtype="bfloat16", kernel_size=W, segmented=a.segmented, rows=[])
    for shape in shapes:
        result["rows"] += run_shape(shape, jnp.bfloat16, a.segmented, splits, slots, block_cs, modes, timer)
        result["markdown"] = report(result["rows"])
        path = write_json(result, a.out, "short-conv")
    print(result["markdown"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The short convolution's backward (SiLU of a causal depthwise conv, W = 4): the XLA VJP of
`kimi_jax.layers.causal_conv_silu` against the Pallas kernel `kernels.conv.conv_silu_bwd`, at the
shape of one q, k or v conv of a KDA mixer, with its distance from the HBM roofline.

    python benchmarks/conv.py                          # GPU: 4 x 4096 tokens, 16 heads x 128
    python benchmarks/conv.py --shapes 4x4096x2048,1x65536x2048 --segments
    python benchmarks/conv.py --blocks 32.128.256.4,64.128.256.8   # kernel block sweep
    python benchmarks/conv.py --quick                  # tiny shape on CPU (kernel interpreted)

Bytes: x and dy read, dx written, in the input dtype (bf16), the least the backward must move;
the roofline time is that over 4.3 TB/s. Each impl's dx and dw are checked against the XLA VJP.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import PEAK_TBPS, attempt, environment, fmt, markdown_table, time_jax, write_json  # noqa: E402
from kernels.conv import conv_silu_bwd  # noqa: E402
from kernels.conv.pallas_triton import DEFAULT_BLOCKS  # noqa: E402
from kimi_jax.layers import causal_conv_silu  # noqa: E402

W = 4


def xla_bwd(x, w, dy, seg):
    _, vjp = jax.vjp(lambda x, w: causal_conv_silu(x, w, seg), x, w)
    return vjp(dy)


def run_shape(B: int, T: int, C: int, segments: bool, blocks: list[tuple], interpret: bool,
              iters: int) -> list[dict]:
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(B, T, C)), jnp.bfloat16)
    dy = jnp.asarray(r.normal(size=(B, T, C)), jnp.bfloat16)
    w = jnp.asarray(0.5 * r.normal(size=(W, C)), jnp.float32)
    seg = jnp.asarray(np.cumsum(r.random((B, T)) < 1 / 512, axis=1), jnp.int32) if segments else None
    impls = {"xla": (jax.jit(xla_bwd), None)}
    for blk in blocks:
        impls["pallas" + ("" if blk == DEFAULT_BLOCKS else " " + ".".join(map(str, blk)))] = (jax.jit(
            lambda x, w, dy, seg, blk=blk: conv_silu_bwd(x, w, dy, seg, blocks=blk, interpret=interpret)), blk)
    ref = impls["xla"][0](x, w, dy, seg)
    nbytes = 3 * B * T * C * x.dtype.itemsize
    rows = []
    for name, (fn, blk) in impls.items():
        out, err = attempt(lambda: fn(x, w, dy, seg))
        row = dict(impl=name, shape=[B, T, C], segments=segments, bytes=nbytes, error=err,
                   blocks=None if blk is None else list(blk))
        if err is None:
            row["dx_max_err"] = float(jnp.max(jnp.abs(out[0].astype(jnp.float32) - ref[0].astype(jnp.float32))))
            row["dw_rel_err"] = float(jnp.linalg.norm(out[1] - ref[1]) / jnp.linalg.norm(ref[1]))
            ms, err = attempt(lambda: time_jax(fn, x, w, dy, seg, warmup=2, iters=iters))
            row.update(ms=ms, error=err)
            if ms:
                row["gbps"] = nbytes / (ms * 1e-3) / 1e9
                row["pct_hbm"] = 100.0 * row["gbps"] / (PEAK_TBPS * 1e3)
        rows.append(row)
        print(f"  {B}x{T}x{C}{' segments' if segments else ''} {name}: "
              + (f"{row['ms']:.3f} ms, {row['pct_hbm']:.0f}% of HBM" if row.get("ms") else f"error {row['error']}"),
              flush=True)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4x4096x2048", help="BxTxC, comma-separated")
    parser.add_argument("--segments", action="store_true", help="packed documents (segment ids)")
    parser.add_argument("--blocks", default="",
                        help="kernel blocks block_t.block_c.block_rows.num_warps, comma-separated "
                             f"(default {'.'.join(map(str, DEFAULT_BLOCKS))})")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a tiny shape on CPU, the kernel interpreted")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/conv-<time>.json)")
    args = parser.parse_args(argv)
    shapes = [(2, 64, 128)] if args.quick else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    blocks = [tuple(int(v) for v in b.split(".")) for b in args.blocks.split(",")] if args.blocks else [DEFAULT_BLOCKS]
    if any(len(b) != 4 for b in blocks):
        parser.error(f"--blocks: each entry is block_t.block_c.block_rows.num_warps; got {args.blocks}")
    if DEFAULT_BLOCKS in blocks:  # the default first: its row is the one named plainly "pallas"
        blocks.insert(0, blocks.pop(blocks.index(DEFAULT_BLOCKS)))
    rows = []
    for B, T, C in shapes:
        rows += run_shape(B, T, C, args.segments, blocks, interpret=args.quick, iters=2 if args.quick else args.iters)
    table = markdown_table(["B x T x C", "impl", "ms", "GB/s", "% of HBM", "dx max err", "dw rel err"],
                           [["x".join(map(str, r["shape"])), r["impl"], fmt(r.get("ms"), 3), fmt(r.get("gbps"), 0),
                             fmt(r.get("pct_hbm"), 1), fmt(r.get("dx_max_err"), 4), fmt(r.get("dw_rel_err"), 6)]
                            for r in rows])
    print(table)
    result = dict(env=environment(), peak_tbps=PEAK_TBPS, W=W, rows=rows, table=table)
    print("wrote", write_json(result, args.out, "conv"))
    return result


if __name__ == "__main__":
    main()

"""The forward-only state pass alone (`mosaic_state.state_output`, the forward call's layout) under
several `chunk.settings`, side by side in one process: per form the ms per call (calls back to
back), the time per chunk step of one program (the pass's serial chain), the operand bytes' rate,
and every output's largest difference from the first form's.

    python benchmarks/state_pass.py                                     # GPU: smem against regs
    python benchmarks/state_pass.py --forms state_chain=smem,state_chain=regs,state_buffers=single
    python benchmarks/state_pass.py --quick                             # tiny shape, interpreter (CPU)

The operands are random chunk tensors of the forward's shapes (qg, -w, kg [BH, N, 64, K], u
[BH, N, 64, V], A^T [BH, N, 64, 64] in bf16, decays [BH, N, K]), scaled so that the state stays
finite over the chunks; no initial state.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import PEAK_TBPS, environment, markdown_table, time_jax_stream, write_json  # noqa: E402
from benchmarks.kda import _parse_shapes, chunk_settings  # noqa: E402
from kernels.kda import chunk, mosaic_state  # noqa: E402

SHAPES = "8x4096x16x128,2x16384x16x128,4x8192x32x128"


def operands(B, T, H, D, seed=0):
    """The state pass's inputs for B x T x H heads of width D (K = V = D), heads layout."""
    BH, N = B * H, T // 64
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    f = lambda key, *s, x=0.3: (jax.random.normal(key, s, jnp.float32) * x).astype(jnp.bfloat16)  # noqa: E731
    return (f(keys[0], BH, N, 64, D), f(keys[1], BH, N, 64, D, x=0.03), f(keys[2], BH, N, 64, D, x=0.03),
            f(keys[3], BH, N, 64, D), f(keys[4], BH, N, 64, 64),
            jax.random.uniform(keys[5], (BH, N, D), jnp.float32, 0.9, 1.0))


def run(shapes, forms, iters, quick):
    rows = []
    for B, T, H, D in shapes:
        ops = operands(B, T, H, D)
        nbytes = sum(x.size * x.dtype.itemsize for x in ops) + B * T * H * D * 2 + B * H * D * D * 4
        first = None
        for form in forms:
            with chunk.settings(**chunk_settings(form)):
                fn = jax.jit(lambda *x: mosaic_state.state_output(*x, None, out_dtype=jnp.bfloat16, heads=H,
                                                                  a_transposed=True, interpret=quick))
                out = jax.block_until_ready(fn(*ops))
                ms = time_jax_stream(fn, *ops, warmup=2, iters=iters)
            out = [np.asarray(x, np.float32) for x in out]
            first = first or out
            diff = [float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)) for x, y in zip(out, first)]
            rows.append(dict(shape=[B, T, H, D], form=form, ms=ms, us_per_step=1e3 * ms / (T // 64),
                             gbps=nbytes / ms / 1e6, rel_max_diff=dict(o=diff[0], final_state=diff[1])))
            print(f"{B}x{T}x{H}x{D} {form}: {ms:.3f} ms", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--forms", default="state_chain=smem,state_chain=regs",
                   help="comma-separated chunk.settings, each key=value/key=value as benchmarks/kda.py takes them")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="1x256x2x128 in the Mosaic GPU interpreter (CPU)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/state-pass-<time>.json)")
    a = p.parse_args(argv)
    shapes = [(1, 256, 2, 128)] if a.quick else _parse_shapes(a.shapes)
    forms = [f for f in a.forms.split(",") if f]
    for form in forms:
        try:
            chunk_settings(form)
        except ValueError as e:
            p.error(f"--forms: {e}")
    if not a.quick and jax.default_backend() != "gpu":
        p.error("the compiled kernels need a Hopper GPU; --quick runs the interpreter")
    rows = run(shapes, forms, 2 if a.quick else a.iters, a.quick)
    table = markdown_table(
        ["B,T,H,D", "form", "ms", "us per chunk step", f"GB/s (% of {PEAK_TBPS} TB/s)", "max diff o / state"],
        [[",".join(map(str, r["shape"])), r["form"], f"{r['ms']:.3f}", f"{r['us_per_step']:.2f}",
          f"{r['gbps']:.0f} ({100 * r['gbps'] / 1e3 / PEAK_TBPS:.1f}%)",
          f"{r['rel_max_diff']['o']:.1e} / {r['rel_max_diff']['final_state']:.1e}"] for r in rows])
    record = dict(env=environment(), config=vars(a), rows=rows, table=table)
    path = write_json(record, a.out, "state-pass")
    print(table + f"\nwrote {path}", flush=True)
    return record


if __name__ == "__main__":
    main()

"""Bytes each launched XLA op of a KDA forward+backward reads and writes, from the compiled HLO alone:
a GPU-free measure of the intra-chunk work's memory traffic, for trying formulations before timing them.

    python benchmarks/xla_bytes.py --deviceless --shape 1x65536x16x128 --impls chunk_mosaic,chunk_mosaic:diag=f32
    python benchmarks/xla_bytes.py --deviceless --shape 8x4096x16x128 --step fwd --impls chunk_mosaic,chunk_mosaic:forward_only=chunk
    python benchmarks/xla_bytes.py --shape 1x256x2x64 --impls chunk      # compiled for this machine

The XLA ops on the GPU are memory-bound (a profile at 1,65536,16,128 ran its largest fusions at
58-91% of 4.3 TB/s, `kda-profile-t65536-h200-20261205T0237.json`), so their bytes are their time to
first order. --deviceless compiles for an H200 ahead of time (the CUDA PJRT plugin, no GPU; see
`benchmarks/mosaic_ptxas.py`): that HLO's fusions are the ones the GPU runs (at 1,65536,16,128 the
five largest match the profile's bytes to the MB). Each op inside a loop body counts once; custom
calls (the Mosaic kernels, cuBLAS) are listed but their bytes are only their operands and results.
Same inputs and step as `benchmarks/kda.py`'s forward+backward (bf16 q, k, v; lower_bound=-5; o and
the gradients of a cotangent do returned), or with `--step fwd` its forward (o of an undifferentiated call). Counts before 2026-12-05's last change took the gradient
of sum(o), which let XLA drop o's products (the backward does not read o).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--deviceless" in sys.argv:  # before jax is imported (benchmarks/mosaic_ptxas.py does the same)
    os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import environment, markdown_table, write_json  # noqa: E402
from benchmarks.kda import LOWER_BOUND, _check_impl, _parse_shapes, chunk_settings  # noqa: E402
from kernels.kda import chunk, kda  # noqa: E402
from kimi_jax import profile_summary as ps  # noqa: E402

_KIND = re.compile(r"\s(fusion|custom-call)\(")


def launched_ops(hlo_text: str) -> list[dict]:
    """Every fusion and custom call outside fused computations (what runs as a kernel), with the
    bytes of its operands and result and its source lines, largest first."""
    instrs, comps = ps.instructions(hlo_text)
    frames = ps.stack_frames(hlo_text)
    calls = (re.search(r"calls=%?([\w.\-]+)", line) for line in instrs.values() if " fusion(" in line)
    fused = {m.group(1) for m in calls if m}  # the fusions' bodies: what runs inside a launched op
    rows = []
    for comp, name, rest in ps.hlo_instructions(hlo_text):
        kind = _KIND.search(" " + rest.split(", metadata")[0])
        if kind is None or comp in fused:
            continue
        d = ps.describe(name, instrs, comps, frames, 0)
        if d is not None:
            rows.append(dict(op=name, kind=kind.group(1), bytes=d["bytes"], source=d["source"][:3]))
    return sorted(rows, key=lambda r: -r["bytes"])


STEPS = ("fwd_bwd", "fwd")


def compile_text(shape, impl: str, sharding=None, step_kind: str = "fwd_bwd") -> str:
    """Optimized HLO of a step `benchmarks/kda.py` times, for `impl` ("name[:chunk settings]") at
    `shape`. "fwd_bwd": o and the vjp of a cotangent do, both returned (o is what a training
    step's loss reads; a step returning only the gradients would let XLA drop o's products, which
    the backward does not read). "fwd": o alone, not differentiated (the forward-only call, which
    `chunk_mosaic` routes to `pallas_gpu`'s kernels for bounded, reset-free inputs); do is unused."""
    if step_kind not in STEPS:
        raise ValueError(f"step_kind={step_kind!r}; expected one of {STEPS}")
    name, _, opt = impl.partition(":")
    B, T, H, D = shape

    def step(q, k, v, g, beta, do):
        if step_kind == "fwd":
            return kda(q, k, v, g, beta, lower_bound=LOWER_BOUND, impl=name)[0]
        o, vjp = jax.vjp(lambda *a: kda(*a, lower_bound=LOWER_BOUND, impl=name)[0], q, k, v, g, beta)
        return o, vjp(do.astype(o.dtype))

    sd = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=sharding)  # noqa: E731
    args = [sd((B, T, H, D), jnp.bfloat16)] * 3 + [sd((B, T, H, D), jnp.float32), sd((B, T, H), jnp.float32)]
    with chunk.settings(**chunk_settings(opt)):
        return jax.jit(step).lower(*args, sd((B, T, H, D), jnp.bfloat16)).compile().as_text()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1x65536x16x128", help="BxTxHxD")
    p.add_argument("--impls", default="chunk_mosaic", help="comma-separated, as benchmarks/kda.py takes them")
    p.add_argument("--deviceless", action="store_true", help="compile for an H200 ahead of time (no GPU)")
    p.add_argument("--step", default="fwd_bwd", choices=STEPS,
                   help="the forward+backward step (o returned), or the forward-only call")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="a tiny shape with impl chunk (runs anywhere)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/xla-bytes-<time>.json)")
    a = p.parse_args(argv)
    if a.quick:
        a.shape, a.impls = "1x128x2x64", "chunk"
    (shape,) = _parse_shapes(a.shape)
    impls = [i for i in a.impls.split(",") if i]
    for impl in impls:
        try:
            _check_impl(impl)
        except ValueError as e:
            p.error(f"--impls: {e}")
        if ":" in impl and impl.partition(":")[0] not in ("chunk", "chunk_mosaic"):
            p.error(f"--impls: {impl!r}: only chunk and chunk_mosaic take options here (chunk settings)")
    sharding, target = None, jax.devices()[0].device_kind
    results = []
    if a.deviceless:
        from benchmarks.mosaic_ptxas import deviceless_sharding
        from kernels.kda.hopper import assume_device_kind

        sharding, target = deviceless_sharding(), "NVIDIA H200 (sm_90a), compiled ahead of time (--deviceless)"
    for impl in impls:
        if a.deviceless:
            with assume_device_kind("hopper"):
                ops = launched_ops(compile_text(shape, impl, sharding, a.step))
        else:
            ops = launched_ops(compile_text(shape, impl, step_kind=a.step))
        fusions = [o for o in ops if o["kind"] == "fusion"]
        results.append(dict(impl=impl, shape=list(shape), step=a.step, fusions=len(fusions),
                            fusion_gb=round(sum(o["bytes"] for o in fusions) / 1e9, 3), ops=ops))
        print(f"{impl} {a.step} at {list(shape)}: {len(fusions)} fusions move {results[-1]['fusion_gb']} GB "
              f"(each loop body once)", flush=True)
        rows = [[f"{o['bytes'] / 1e9:.3f}", o["kind"], o["op"], "; ".join(o["source"])[:110]] for o in ops[:a.top]]
        print(markdown_table(["GB", "kind", "op", "source"], rows), flush=True)
    path = write_json(dict(env=environment(), target=target, results=results), a.out, "xla-bytes")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

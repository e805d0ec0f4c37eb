"""GPU timing of impl="chunk_mosaic" (Mosaic GPU state passes) against impl="chunk" (lax.scan).

    JAX_PLATFORMS=cuda python -m kernels.kda.mosaic_scan_bench --out scan.json
    python -m kernels.kda.mosaic_scan_bench --quick --out scan.json   # tiny shape, CPU interpreter

Per shape (bf16, channel gate, lower_bound=-5): median ms of the forward and of the
forward+backward of both impls, the relative RMS of chunk_mosaic against chunk (o and the five
input gradients), and at the first shape the two serial passes alone (XLA scan vs kernel) on the
chunk tensors of the real inputs, with their bytes, FLOPs and rates against the H200's limits
(`pass_work`). Every row is written to the JSON as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import attempt, environment, time_jax
from kernels.kda import kda
from kernels.kda.chunk import _Numerics, _grad_scan, _prep, _state_scan, _wy
from kernels.kda.chunk_intra import to_chunks
from kernels.kda.pallas_gpu_bench import inputs
from kernels.kda.pallas_gpu_stages import roofline, stage_bytes
from kernels.testing import rel_rms

SHAPES = ((8, 4096, 16, 128), (1, 65536, 16, 128))
QUICK_SHAPES = ((1, 128, 2, 64),)
LOWER_BOUND = -5.0


def fwd_fn(impl):
    return jax.jit(lambda q, k, v, g, b: kda(q, k, v, g, b, lower_bound=LOWER_BOUND, impl=impl)[0])


def fwdbwd_fn(impl):
    def loss(q, k, v, g, b):
        o = kda(q, k, v, g, b, lower_bound=LOWER_BOUND, impl=impl)[0]
        return jnp.sum(o.astype(jnp.float32) * v[..., ::-1].astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def pass_fns(args, interpret):
    """(chunk tensors, {name: jitted serial pass}) for the XLA and kernel forms of both passes."""
    from kernels.kda import mosaic_scan

    q, k, v, g, beta = args
    D = q.shape[-1]
    nm = _Numerics(q.dtype)
    ch = lambda x, dt: to_chunks(x.astype(dt))

    @jax.jit
    def tensors(q, k, v, g, beta):
        P = _prep(nm, ch(q, nm.cd), ch(k, nm.cd), ch(v, nm.cd), ch(g, nm.sdt), ch(beta, nm.sdt), None, D**-0.5,
                  True, True)
        _, w, u = _wy(nm, P)
        do = ch(v[..., ::-1], nm.cd)
        dvi = nm.mm("nbhrc,nbhrv->nbhcv", P["Aqk"], do)
        return dict(w=w, u=u, kg=P["kg"], qg=P["qg"], decay=P["decay"], do=do, dvi=dvi)

    t = tensors(q, k, v, g, beta)
    B, H = q.shape[0], q.shape[2]
    h0 = jnp.zeros((B, H, D, D), jnp.float32)
    kw = dict(cd=nm.cd, interpret=interpret)
    fns = {
        "state_scan xla": lambda t: _state_scan(nm, h0, t["w"], t["u"], t["kg"], t["decay"]),
        "state_scan mosaic": lambda t: mosaic_scan.state_scan_chunks(h0, t["w"], t["u"], t["kg"], t["decay"], **kw),
        "grad_scan xla (with qg^T do)": lambda t: _grad_scan(
            nm, h0, t["w"], t["kg"], t["decay"], nm.mm("nbhck,nbhcv->nbhkv", t["qg"], t["do"]), t["dvi"]),
        "grad_scan mosaic": lambda t: mosaic_scan.grad_scan_chunks(
            h0, t["w"], t["kg"], t["qg"], t["do"], t["dvi"], t["decay"], **kw),
    }
    return t, h0, {n: jax.jit(f) for n, f in fns.items()}


# The chunk tensors each serial pass reads (both forms of a pass do the same work).
PASS_INPUTS = {"state_scan": ("w", "u", "kg", "decay"), "grad_scan": ("w", "kg", "qg", "do", "dvi", "decay")}


def pass_work(name: str, t: dict, h0, out) -> tuple[int, int]:
    """(bytes, FLOPs) of a serial pass: its chunk tensors and initial state read once, its outputs
    written once; per token 4 K V (forward: v' = u - w S and the update kg^T v') or 6 K V
    (reverse: dv' = kg dS, w^T dv' and qg^T do)."""
    kind = name.split()[0]
    N, B, H, C, K = t["w"].shape
    V = t["do"].shape[-1]
    flops = N * B * H * C * K * V * (4 if kind == "state_scan" else 6)
    return stage_bytes(([t[key] for key in PASS_INPUTS[kind]], h0), out), flops


def run(shapes, *, warmup, iters, out=None, passes=True):
    interpret = jax.devices()[0].platform == "cpu"
    res = dict(env=environment(), config=dict(lower_bound=LOWER_BOUND, dtype="bfloat16", warmup=warmup, iters=iters,
                                              interpret=interpret), rows=[])

    def record(row):
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(res, f, indent=2, sort_keys=True)

    for si, shape in enumerate(shapes):
        args = inputs(*shape)
        got = {}
        for impl in ("chunk", "chunk_mosaic"):
            row = dict(shape=list(shape), impl=impl)
            for what, make in (("fwd", fwd_fn), ("fwd_bwd", fwdbwd_fn)):
                f = make(impl)
                got[impl, what], err = attempt(lambda: jax.block_until_ready(f(*args)))
                ms, err2 = (None, err) if err else attempt(lambda: time_jax(f, *args, warmup=warmup, iters=iters))
                row[f"{what}_ms"], row[f"{what}_error"] = ms, err2
            record(row)
        if all(got.get((i, "fwd_bwd")) is not None for i in ("chunk", "chunk_mosaic")):
            (_, ga), (_, gb) = got["chunk", "fwd_bwd"], got["chunk_mosaic", "fwd_bwd"]
            f32 = lambda x: np.asarray(x.astype(jnp.float32))
            errs = {"o": rel_rms(f32(got["chunk", "fwd"]), f32(got["chunk_mosaic", "fwd"]))}
            errs.update({n: rel_rms(f32(a), f32(b)) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), ga, gb)})
            record(dict(shape=list(shape), parity_chunk_mosaic_vs_chunk=errs))
        if passes and si == 0:
            t, h0, fns = pass_fns(args, interpret)
            for name, f in fns.items():
                ms, err = attempt(lambda: time_jax(f, t, warmup=warmup, iters=iters))
                row = dict(shape=list(shape), stage=name, ms=ms, error=err)
                if ms:
                    nbytes, flops = pass_work(name, t, h0, jax.eval_shape(f, t))
                    row.update(roofline(nbytes, flops, ms))
                record(row)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny shape, 1 timed call (runs on CPU)")
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    shapes = QUICK_SHAPES if a.quick else SHAPES
    res = run(shapes, warmup=1 if a.quick else 2, iters=1 if a.quick else 10, out=a.out)
    if a.out:
        print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()

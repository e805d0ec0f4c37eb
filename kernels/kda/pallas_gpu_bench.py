"""GPU check and timing of impl="pallas_gpu" against impl="chunk" (and the decode kernel).

    JAX_PLATFORMS=cuda python -m kernels.kda.pallas_gpu_bench
    python -m kernels.kda.pallas_gpu_bench --stages --out kda_stages.json   # where the time goes
    python -m kernels.kda.pallas_gpu_bench --stages --quick                 # tiny shape, CPU too
    python -m kernels.kda.pallas_gpu_bench --roofline STAGES.json   # the kernel stages' rates (any machine)

Default: parity (relative RMS vs impl="naive") at a small shape, then mean milliseconds of 10
calls after 3 warm-ups: forward, forward+backward, the state kernel alone, and decode with its
achieved state bandwidth (bytes read + written).
`--stages`: each stage of both impls jitted on its own at (8, 4096, 16, 128) bf16,
lower_bound=-5 (see `kernels.kda.pallas_gpu_stages`), written as JSON.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels.kda import kda, kda_step
from kernels.kda import mosaic_state, pallas_gpu, pallas_gpu_prep
from kernels.testing import rel_rms


def timed(f, *args, n=10):
    """Mean milliseconds of `n` calls after 3 warm-ups."""
    for _ in range(3):
        jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n * 1e3


def inputs(B, T, H, D, seed=0, V=None, rng=None):
    """bf16 q, k (unit rows) [B, T, H, D] and v [B, T, H, V] (V default D), the bounded gate
    g = -5 sigmoid(N(0, 1)) f32 [B, T, H, D], beta = sigmoid(N(0, 1)) f32 [B, T, H]; from `rng`
    if given, else a generator seeded with `seed`."""
    r = np.random.default_rng(seed) if rng is None else rng
    V = D if V is None else V
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = jnp.asarray(nrm(r.standard_normal((B, T, H, D))), jnp.bfloat16)
    k = jnp.asarray(nrm(r.standard_normal((B, T, H, D))), jnp.bfloat16)
    v = jnp.asarray(r.standard_normal((B, T, H, V)), jnp.bfloat16)
    g = jnp.asarray(-5.0 / (1.0 + np.exp(-r.standard_normal((B, T, H, D)))), jnp.float32)
    beta = jnp.asarray(1.0 / (1.0 + np.exp(-r.standard_normal((B, T, H)))), jnp.float32)
    return q, k, v, g, beta


def fwd_fn(impl, lower_bound=-5.0):
    return jax.jit(lambda q, k, v, g, b: kda(q, k, v, g, b, lower_bound=lower_bound, impl=impl)[0])


def fwdbwd_fn(impl, lower_bound=-5.0):
    def loss(q, k, v, g, b):
        return jnp.sum(kda(q, k, v, g, b, lower_bound=lower_bound, impl=impl)[0].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def parity(B=2, T=1000, H=4, D=128):
    args = inputs(B, T, H, D, seed=1)
    ref = fwd_fn("naive")(*args)
    g_ref = fwdbwd_fn("naive")(*args)
    out = fwd_fn("pallas_gpu")(*args)
    g_out = fwdbwd_fn("pallas_gpu")(*args)
    errs = [rel_rms(ref, out)] + [rel_rms(a, b) for a, b in zip(g_ref, g_out)]
    print("parity lower_bound=-5 o, dq, dk, dv, dg, dbeta:", " ".join(f"{e:.2e}" for e in errs), flush=True)
    print(f"parity lower_bound=None o: {rel_rms(ref, fwd_fn('pallas_gpu', None)(*args)):.2e}", flush=True)


def state_kernel_ms(B, T, H, D):
    q, k, v, g, beta = inputs(B, T, H, D)
    p = jax.jit(lambda *a: pallas_gpu_prep.prepare(*a, scale=D**-0.5, segment_ids=None))(q, k, v, g, beta)
    NT = p["qg"].shape[2]
    f = lambda x: x.reshape(B * H, NT, *x.shape[3:]).astype(jnp.bfloat16)
    ops = (f(p["qg"]), f(-p["w"]), f(p["kg"]), f(p["u"]), f(p["a"]))
    d = p["d"].reshape(B * H, NT, D)
    h0 = jnp.zeros((B * H, D, D), jnp.float32)
    run = jax.jit(lambda *a: mosaic_state.state_output(*a, out_dtype=jnp.bfloat16))
    prep = jax.jit(lambda *a: pallas_gpu_prep.prepare(*a, scale=D**-0.5, segment_ids=None))
    return timed(run, *ops, d, h0), timed(prep, q, k, v, g, beta)


def decode(B=64, H=32, D=128):
    r = np.random.default_rng(2)
    state = jnp.asarray(r.standard_normal((B, H, D, D)), jnp.float32)
    q, k = (jnp.asarray(r.standard_normal((B, H, D)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, H, D)), jnp.bfloat16)
    g = jnp.asarray(-r.uniform(0, 1, (B, H, D)), jnp.float32)
    beta = jnp.asarray(r.uniform(0, 1, (B, H)), jnp.float32)
    fns = {i: jax.jit(lambda *a, i=i: kda_step(*a, impl=i)) for i in ("naive", "pallas_gpu")}
    (o_r, S_r), (o, S) = (fns[i](state, q, k, v, g, beta) for i in ("naive", "pallas_gpu"))
    print(f"decode parity o {rel_rms(o_r.astype(jnp.float32), o.astype(jnp.float32)):.2e} S {rel_rms(S_r, S):.2e}")
    nbytes = 2 * state.size * 4
    for i, f in fns.items():
        ms = timed(f, state, q, k, v, g, beta, n=50)
        print(f"decode {i:10s} B={B} H={H} D={D}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:6.2f} TB/s", flush=True)


def roofline_of(path: str) -> dict:
    """Rates of the Mosaic kernel stages timed in stages JSON `path`, from their bytes and FLOPs
    at its shape (`pallas_gpu_stages.kernel_stage_work`)."""
    import json

    from benchmarks.common import PEAK_TBPS, PEAK_TFLOPS
    from kernels.kda.pallas_gpu_stages import kernel_stage_work, roofline

    with open(path) as f:
        run = json.load(f)
    work = kernel_stage_work(tuple(run["shape"]))
    out = {}
    for row in run["stages"]:
        if row["stage"] in work and row.get("ms"):
            out[row["stage"]] = r = dict(ms=row["ms"]) | roofline(*work[row["stage"]], row["ms"])
            print(f"{row['stage']}: {r['ms']:.3f} ms, {r['bytes'] / 1e9:.2f} GB, {r['gbps']:.0f} GB/s "
                  f"({r['pct_hbm']:.1f}% of {PEAK_TBPS} TB/s), {r['tflops']:.1f} TFLOP/s ({r['pct_tensor']:.1f}% of {PEAK_TFLOPS:.0f})")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", action="store_true", help="time every stage separately")
    p.add_argument("--quick", action="store_true", help="with --stages: a tiny shape (runs on CPU)")
    p.add_argument("--out", help="with --stages: JSON path")
    p.add_argument("--only", help="with --stages: comma-separated substrings of the stage names to time")
    p.add_argument("--roofline", help="a stages JSON: GB/s and TFLOP/s of its Mosaic kernel stages")
    a = p.parse_args(argv)
    if a.roofline:
        return roofline_of(a.roofline)
    if a.stages:
        from kernels.kda.pallas_gpu_stages import run_stages

        shape = (1, 128, 2, 64) if a.quick else (8, 4096, 16, 128)
        only = [x for x in (a.only or "").split(",") if x] or None
        res = run_stages(shape, warmup=1 if a.quick else 2, iters=2 if a.quick else 5, only=only, out=a.out)
        if a.out:
            print(f"wrote {a.out}")
        return res
    print(jax.devices(), flush=True)
    parity()
    decode()
    shape = (8, 4096, 16, 128)
    args = inputs(*shape)
    print(f"backward recomputes through {pallas_gpu._fallback_impl().__module__}", flush=True)
    for impl, lb, what in (("pallas_gpu", -5.0, "both"), ("chunk", -5.0, "both"), ("pallas_gpu", None, "fwd"),
                           ("chunk", None, "both")):
        f_ms = timed(fwd_fn(impl, lb), *args)
        fb_ms = timed(fwdbwd_fn(impl, lb), *args) if what == "both" else float("nan")
        print(f"{impl:10s} lower_bound={lb} {shape}: fwd {f_ms:7.2f} ms  fwd+bwd {fb_ms:7.2f} ms", flush=True)
    k_ms, p_ms = state_kernel_ms(*shape)
    print(f"state kernel alone {k_ms:.2f} ms; exact XLA intra-chunk stage alone {p_ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

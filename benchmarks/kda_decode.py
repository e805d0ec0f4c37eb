"""One KDA decoding step (`benchmarks/kda.py --decode`): our `kda_step` impls, the Mosaic GPU
decode kernel alone (optionally at several tile settings) and fla's `fused_recurrent_kda`, each
timed per call and back to back, with GB/s against the H200's 4.3 TB/s and errors against the
plain-JAX step. See `benchmarks/kda.py`'s docstring for the byte model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import PEAK_TBPS, attempt, fmt, markdown_table, time_jax, time_jax_stream, time_torch, time_torch_stream
from benchmarks.kda import LOWER_BOUND, args_timing
from kernels.testing import rel_rms


DECODE_SHAPE = (64, 32, 128, 128)  # B, H, K, V
QUICK_DECODE_SHAPE = (2, 2, 64, 64)


def decode_bytes(B, H, K, V):
    """Unavoidable HBM traffic of one step: the f32 state read + written, the vectors once."""
    return B * H * (2 * 4 * K * V + 2 * (2 * K + V) + 4 * K + 4 + 2 * V)


def _decode_inputs(B, H, K, V, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, dtype=np.float32)
    q, k = normal(B, H, K), normal(B, H, K)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = (LOWER_BOUND / (1.0 + np.exp(-normal(B, H, K)))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-normal(B, H)))).astype(np.float32)
    return dict(state=0.1 * normal(B, H, K, V), q=q, k=k, v=normal(B, H, V), g=g, beta=beta)


def _decode_times(time_call, time_stream, *args) -> dict:
    """ms per step timed two ways: each call dispatched and waited for (`per_call`, what a
    token-by-token decode loop sees) and calls back to back (`stream`, the device time)."""
    n = args_timing["iters"] if args_timing["iters"] < 10 else max(args_timing["iters"], 50)  # --quick: few
    kw = dict(warmup=args_timing["warmup"], iters=n)
    return dict(per_call=time_call(*args, **kw), stream=time_stream(*args, **kw))


def _decode_ours(impl, x):
    from kernels.kda import kda_step

    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (jnp.asarray(x["state"]), bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    f = jax.jit(lambda *a: kda_step(*a, impl=impl))
    o, S = f(*args)
    return _decode_times(time_jax, time_jax_stream, f, *args), (o, S)


def _decode_kernel(name, x, **kw):
    """The Mosaic GPU decode kernel alone (operands prepared outside the timed call); `kw` its
    tile settings (`decode_step_pipelined`'s programs, slots, block_v)."""
    from kernels.kda import mosaic_decode
    from kernels.kda.pallas_gpu import unsupported_reason

    reason = unsupported_reason(x["q"].shape[-1], x["v"].shape[-1], jnp.bfloat16, interpret=False)
    if reason is not None:
        raise RuntimeError(f"skipped: {reason}")
    B, H, K = x["q"].shape
    V = x["v"].shape[-1]
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # the bf16 inputs' values
    q, k = bf(x["q"]) * K**-0.5, bf(x["k"])
    vecs = np.stack([x["g"], k, x["beta"][..., None] * k, q], axis=2).reshape(B * H, 4, K)
    args = (jnp.asarray(x["state"].reshape(B * H, K, V)), jnp.asarray(vecs), jnp.asarray(bf(x["v"]).reshape(B * H, V)))
    f = jax.jit(functools.partial(getattr(mosaic_decode, name), **kw))
    o, S = f(*args)
    ms = _decode_times(time_jax, time_jax_stream, f, *args)
    return ms, (np.asarray(o).reshape(B, H, V).astype(np.float32), np.asarray(S).reshape(B, H, K, V))


def _decode_fla(x):
    import torch
    from fla.ops.kda import fused_recurrent_kda

    if not torch.cuda.is_available():
        raise RuntimeError("skipped: flash-linear-attention needs a CUDA device")
    dev = torch.device("cuda")
    t = lambda a, dt: torch.from_numpy(a).to(dev).to(dt)
    q, k, v = (t(x[n][:, None], torch.bfloat16) for n in ("q", "k", "v"))  # [B, 1, H, D]
    g, beta = t(x["g"][:, None], torch.float32), t(x["beta"][:, None], torch.bfloat16)
    h0 = t(x["state"], torch.float32)

    def step():
        with torch.no_grad():
            return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    o, S = step()
    ms = _decode_times(time_torch, time_torch_stream, step)
    return ms, (o[:, 0].float().cpu().numpy(), S.float().cpu().numpy())


def parse_decode_blocks(text: str) -> list[dict]:
    """"132.4.64,264.2.32" -> decode_step_pipelined settings (programs, slots, block_v) per entry."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(".")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--decode_blocks entry {item!r}: expected programs.slots.block_v, e.g. 132.4.64")
        out.append(dict(programs=int(parts[0]), slots=int(parts[1]), block_v=int(parts[2])))
    return out


def run_decode(shape, peers, blocks=()):
    """Rows for one decoding step at shape (B, H, K, V): us, GB/s, % of the H200's 4.3 TB/s;
    `blocks`: extra settings of the pipelined kernel, one row each."""
    x = _decode_inputs(*shape)
    nbytes = decode_bytes(*shape)
    cases = [(f"kda_step {i}", "ours", lambda i=i: _decode_ours(i, x)) for i in ("pallas_gpu", "naive")]
    cases += [(f"kernel only: mosaic_decode.{k}", "ours", lambda k=k: _decode_kernel(k, x))
              for k in ("decode_step_pipelined", "decode_step")]
    cases += [(f"kernel only: decode_step_pipelined programs={b['programs']} slots={b['slots']} block_v={b['block_v']}",
               "ours", lambda b=b: _decode_kernel("decode_step_pipelined", x, **b)) for b in blocks]
    if "fla" in peers:
        cases.append(("fla fused_recurrent_kda", "peer", lambda: _decode_fla(x)))
    rows, ref = [], None
    for name, kind, fn in cases:
        res, err = attempt(fn)
        row = dict(name=name, kind=kind, shape=list(shape), bytes=nbytes, error=err)
        for suffix, key in (("", "per_call"), ("_stream", "stream")):
            ms = None if res is None else res[0][key]
            gbps = None if ms is None else nbytes / (ms * 1e-3) / 1e9
            row.update({f"us{suffix}": None if ms is None else 1e3 * ms, f"gbps{suffix}": gbps,
                        f"pct_hbm{suffix}": None if gbps is None else 100 * gbps / (1e3 * PEAK_TBPS)})
        if res is not None:
            o, S = (np.asarray(a, np.float32) for a in res[1])
            if ref is None and name.endswith("naive"):
                ref = (o, S)
            row["outputs"] = (o, S)
        rows.append(row)
    for row in rows:
        outs = row.pop("outputs", None)
        if outs is not None and ref is not None:
            row["o_rel_err_vs_naive"], row["S_rel_err_vs_naive"] = rel_rms(ref[0], outs[0]), rel_rms(ref[1], outs[1])
    return rows


def decode_table(rows) -> str:
    header = ["B,H,K,V", "impl", "us per call", "us back to back", "GB/s (back to back)", "% of 4.3 TB/s",
              "o err", "S err", "note"]
    out = [[",".join(map(str, r["shape"])), r["name"], fmt(r["us"], 1), fmt(r.get("us_stream"), 1),
            fmt(r.get("gbps_stream"), 0), fmt(r.get("pct_hbm_stream"), 1),
            fmt(r.get("o_rel_err_vs_naive"), 4), fmt(r.get("S_rel_err_vs_naive"), 4), (r["error"] or "")]
           for r in rows]  # fmt: skip
    return markdown_table(header, out)

"""Where one KDA call's device time goes: traces forward+backward calls of our impls and lists the
kernels by time, each XLA fusion with its output shape, its source line and the fused computation.

    python benchmarks/kda_profile.py --shape 4x4096x16x128 --impls chunk_mosaic
    python benchmarks/kda_profile.py --shape 8x4096x16x128 --step fwd    # the forward-only call
    python benchmarks/kda_profile.py --decode --impls pallas_gpu,naive   # one kda_step at 64x32x128x128
    python benchmarks/kda_profile.py --quick          # tiny shape (runs on CPU, checks the plumbing)
    python benchmarks/kda_profile.py --mixer configs/k3_1b3_dense.py --shape 4x4096   # the whole layer

With --mixer, the profiled call is the forward+backward of a config's KDA mixer with its pre-norm
(as one layer of a train step: `benchmarks/train_parts.py`'s piece, one document per row), and the
kernels are also summed by the mixer's named scopes (proj, conv, gate, recurrence, out, and the
KDA op's backward rule, kda_bwd): where the layer's time goes beyond the KDA op itself.

Same inputs and call as `benchmarks/kda.py` (lower_bound=-5, bf16 q, k, v). The JSON (default
benchmarks/results/kda-profile-<time>.json) holds, per impl, the kernel time per call by HLO op
(`kimi_jax.profile_summary.summarize`) and, for the `--top` largest XLA fusions, what they compute:
the bytes their operands and result take (against the H200's 4.3 TB/s: how far a fusion is from
its own memory roofline) and the first `--body_lines` lines of the fused computation.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import PEAK_TBPS, device_profile, environment, markdown_table, write_json  # noqa: E402
from benchmarks.kda import LOWER_BOUND, _check_impl, chunk_settings, _parse_shapes, make_inputs  # noqa: E402
from benchmarks.kda_decode import _decode_inputs  # noqa: E402
from kernels.kda import chunk, kda, kda_step  # noqa: E402
from kernels.kda.ops import STEP_IMPLS  # noqa: E402
from kimi_jax import profile_summary  # noqa: E402

def profile_call(label: str, fn, args, calls: int, top: int, body_lines: int, folder: str, scopes=()) -> dict:
    """Trace `calls` calls of jitted `fn(*args)` (after two untraced ones) and describe the top ops
    (`scopes`: named scopes to sum the kernels by, see `profile_summary.summarize`)."""
    compiled = jax.jit(fn).lower(*args).compile()
    hlo = compiled.as_text()
    summary = device_profile(compiled, args, calls, top, folder, scopes, hlo=hlo)
    profile_summary.annotate(summary, hlo, body_lines)
    return dict(impl=label, calls=calls, summary=summary, hlo=hlo)


STEPS = ("fwd_bwd", "fwd")


def kda_call(impl: str, shape, step: str = "fwd_bwd"):
    """(fn, args): forward+backward of `kda(..., impl)` (impl may be "chunk[_mosaic]:<settings>") at
    shape B, T, H, D on benchmarks/kda.py's inputs, o returned with the gradients as
    benchmarks/kda.py times it; `step="fwd"` the undifferentiated forward (o only)."""
    if step not in STEPS:
        raise ValueError(f"step={step!r}; expected one of {STEPS}")
    x = make_inputs(shape)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    name, _, opt = impl.partition(":")
    settings = chunk_settings(opt) if name in ("chunk", "chunk_mosaic") else {}
    do = bf(x["do"])

    def f(q, k, v, g, beta):
        with chunk.settings(**settings):  # read while tracing
            return kda(q, k, v, g, beta, lower_bound=LOWER_BOUND, impl=name)[0]

    def fwd_bwd(*a):
        with chunk.settings(**settings):  # the backward rule is traced here, by the vjp's call
            o, vjp = jax.vjp(f, *a)
            return o, vjp(do.astype(o.dtype))

    return (f if step == "fwd" else fwd_bwd), args


# The KDA mixer's named scopes (kimi_jax/attention/linear.py) and the op's backward rule.
MIXER_SCOPES = ("proj", "conv", "gate", "recurrence", "out", "kda_bwd")


def mixer_call(config_path: str, impl: str, shape, row_settings: str = ""):
    """(fn, args): forward+backward of the KDA mixer (pre-norm included) of the config at
    shape B, T, with its KDA impl replaced by `impl` ("chunk[_mosaic]:<settings>" allowed) unless
    `impl` is "config", traced under `row_settings` (benchmarks/train.py's row settings, e.g.
    "conv_dw=variadic/layout=row_major")."""
    from benchmarks.train import load_config
    from benchmarks.train_settings import parse_settings, traced_with
    from benchmarks.train_parts import PreNormMixer, fwd_bwd
    from flax import nnx
    from kimi_jax import train_lib
    from kimi_jax.config import ModelConfig

    config = load_config(config_path)
    model = config.model.to_dict()
    if "kda" not in model["mixers"]:
        raise ValueError(f"{config_path} has no KDA mixer")
    name, _, opt = impl.partition(":")
    if impl != "config":
        model["mixers"]["kda"]["impl"] = name
    settings = chunk_settings(opt) if name in ("chunk", "chunk_mosaic") else {}
    cfg = ModelConfig.from_config_dict(model)
    B, T = shape
    dtype = train_lib.COMPUTE_DTYPES[config.optim.compute_dtype]
    module = PreNormMixer(cfg, "kda", dict(dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(0), (B, T, cfg.d_model), jnp.float32).astype(dtype)
    seg = jnp.ones((B, T), jnp.int32)  # as benchmarks/train.py feeds the step

    def layer(m, x):
        with jax.named_scope("mixer_kda"):  # the part name the model's train step gives it
            return m(x, seg)

    grad, params, x = fwd_bwd(layer, module, x, "none")

    row = parse_settings(row_settings)

    def f(params, x):
        with chunk.settings(**settings):  # read while tracing
            return traced_with(row, lambda: grad(params, x))

    return f, (params, x)


def decode_call(impl: str, shape):
    """(fn, args): one `kda_step(..., impl)` at shape B, H, K, V on benchmarks/kda.py's inputs."""
    x = _decode_inputs(*shape)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (jnp.asarray(x["state"]), bf(x["q"]), bf(x["k"]), bf(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    return (lambda *a: kda_step(*a, impl=impl)), args


def _parse_mixer_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--mixer takes --shape BxT (e.g. 4x4096); got {text!r}")
    return int(parts[0]), int(parts[1])


def report(result: dict) -> str:
    s = result["summary"]
    rows = [[f"{o['ms']:.3f}", f"{o['launches_per_step']:.0f}", o["op"][:60],
             "–" if o.get("bytes") is None else f"{o['bytes'] / 1e6:.0f}",
             "–" if o.get("gbps") is None else f"{o['gbps']:.0f} ({100 * o['gbps'] / (1e3 * PEAK_TBPS):.0f}%)",
             ", ".join(o.get("source", []))[:80]] for o in s["top_ops"]]
    head = f"{result['impl']} at {result['shape']}: {s['kernel_ms_per_step']:.2f} ms of kernels per call"
    if "by_scope" in s:
        head += "\n" + markdown_table(["part / scope", "ms/call"], [[k, f"{v:.3f}"] for k, v in s["by_scope"].items()])
    return head + "\n" + markdown_table(["ms/call", "launches", "op", "MB moved", "GB/s (% of 4.3 TB/s)", "source"],
                                        rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="", help="BxTxHxD (default 4x4096x16x128), with --decode BxHxKxV (default 64x32x128x128)")
    p.add_argument("--impls", default="", help="comma-separated, as benchmarks/kda.py takes them "
                                                "(default chunk_mosaic; with --decode pallas_gpu,naive)")
    p.add_argument("--step", default="fwd_bwd", choices=STEPS,
                   help="the forward+backward (o returned) or the forward-only call (not with --decode / --mixer)")
    p.add_argument("--decode", action="store_true", help="profile one kda_step instead")
    p.add_argument("--mixer", default="", help="a config file: profile its KDA mixer layer instead (--shape BxT, "
                                               "default 4x4096; --impls default: the config's)")
    p.add_argument("--settings", default="", help="with --mixer: benchmarks/train.py's row settings, e.g. "
                                                  "conv_dw=variadic/layout=row_major")
    p.add_argument("--calls", type=int, default=3, help="traced calls")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--body_lines", type=int, default=40)
    p.add_argument("--hlo", action="store_true", help="also write each program's optimized HLO beside the JSON")
    p.add_argument("--quick", action="store_true", help="a tiny shape (1x128x2x64 or 2x2x64x64), impl chunk / naive")
    p.add_argument("--out", help="JSON path (default benchmarks/results/kda-profile-<time>.json)")
    a = p.parse_args(argv)
    if a.decode and a.mixer:
        raise ValueError("--decode and --mixer profile different calls; pick one")
    if a.step != "fwd_bwd" and (a.decode or a.mixer):
        raise ValueError("--step fwd profiles the KDA op's forward; --decode and --mixer have their own calls")
    if a.settings and not a.mixer:
        raise ValueError("--settings applies to --mixer profiles only")
    default_shape, default_impls = ("64x32x128x128", "pallas_gpu,naive") if a.decode else ("4x4096x16x128", "chunk_mosaic")
    if a.mixer:
        default_shape, default_impls = "4x4096", "config"
    if a.quick:
        a.shape, a.impls = ("2x2x64x64", "naive") if a.decode else ("1x128x2x64", "chunk")
        if a.mixer:
            a.shape = "1x128"
    shape = _parse_mixer_shape(a.shape or default_shape) if a.mixer else _parse_shapes(a.shape or default_shape)[0]
    impls = [s for s in (a.impls or default_impls).split(",") if s]
    for impl in impls:
        if a.decode and impl not in STEP_IMPLS:
            raise ValueError(f"--decode impl {impl!r}; expected one of {STEP_IMPLS}")
        if not a.decode and impl != "config":
            _check_impl(impl)
    results = []
    for impl in impls:
        if a.mixer:
            fn, args = mixer_call(a.mixer, impl, shape, a.settings)
            label = f"{os.path.basename(a.mixer)} KDA mixer, impl {impl}" + (f", {a.settings}" if a.settings else "")
            scopes = MIXER_SCOPES
        else:
            fn, args = decode_call(impl, shape) if a.decode else kda_call(impl, shape, a.step)
            label = f"kda_step {impl}" if a.decode else impl + (" forward" if a.step == "fwd" else "")
            scopes = ()
        with tempfile.TemporaryDirectory() as folder:
            results.append(dict(profile_call(label, fn, args, a.calls, a.top, a.body_lines, folder, scopes),
                                shape=list(shape)))
        print(report(results[-1]) + "\n", flush=True)
    hlos = [r.pop("hlo") for r in results]
    path = write_json(dict(env=environment(), results=results), a.out, "kda-profile")
    if a.hlo:  # the optimized HLO of each profiled program, beside the JSON
        for r, text in zip(results, hlos):
            name = re.sub(r"[^\w.-]+", "_", r["impl"])
            with gzip.open(f"{os.path.splitext(path)[0]}-{name}.hlo.txt.gz", "wt") as f:
                f.write(text)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()

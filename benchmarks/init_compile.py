"""Compile time of train.py's jitted train-state initialisation (parameters + optimizer state),
with the seed as a compile-time constant or as an array argument (what train.py passes).

    python benchmarks/init_compile.py                               # configs/k3_1b3_dense.py
    python benchmarks/init_compile.py --config configs/k3_small.py --variants array
    python benchmarks/init_compile.py --quick                       # tiny config on CPU

A constant seed lets XLA fold every parameter's key derivation into constants during
compilation; the 1.3B model's init then compiled in 249 s instead of 134 s on an H200
(benchmarks/results/init-compile-h200-20261130.json). Variants run one after another in this
process; each is lowered, compiled, run once, and its state checked equal to the first variant's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import environment, write_json  # noqa: E402
from benchmarks.train import load_config  # noqa: E402
from kimi_jax import optim, train_lib  # noqa: E402

VARIANTS = ("constant", "array")


def measure(init, variant: str, seed: int) -> tuple[dict, dict]:
    """(timings in seconds, state) of one variant."""
    args = () if variant == "constant" else (train_lib.seed_array(seed),)
    fn = jax.jit((lambda: init(seed)) if variant == "constant" else init)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    state = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    return dict(lower_s=t1 - t0, compile_s=t2 - t1, run_s=t3 - t2), state


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/k3_1b3_dense.py", help="config file[:arg]")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {list(VARIANTS)}")
    parser.add_argument("--quick", action="store_true", help="a tiny config (CPU smoke test)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/init-compile-<time>.json)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"--variants {args.variants!r}: expected some of {list(VARIANTS)}")
    config = load_config("configs/tiny.py:d_model=32,vocab_size=64" if args.quick else args.config)
    _, abstract_params, _ = train_lib.abstract_model(config)
    tx, _ = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(abstract_params))
    init = train_lib.make_init(config, tx)
    result = dict(env=environment(), config=args.config if not args.quick else "quick", rows=[])
    first = None
    for variant in variants:
        times, state = measure(init, variant, int(config.seed))
        if first is None:
            first = state
        else:  # same keys, so the same state up to the rounding of separately compiled programs
            for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(state)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        result["rows"].append(dict(variant=variant, **{k: round(v, 2) for k, v in times.items()}))
        print(f"{variant:>9}: lowered in {times['lower_s']:.1f} s, compiled in {times['compile_s']:.1f} s, "
              f"ran in {times['run_s']:.1f} s", flush=True)
    print("wrote", write_json(result, args.out, "init-compile"))
    return result


if __name__ == "__main__":
    main()

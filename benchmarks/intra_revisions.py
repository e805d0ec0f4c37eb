"""The bf16 intra kernel (`kernels/kda/mosaic_intra_bf16.py`) as it was at several git revisions,
side by side in one process: each revision's file is loaded as its own module (the rest of the
package from the working tree), its outputs compared with the first revision's, then timed in
rounds, the revisions interleaved so that the machine's drift falls on all of them alike.

    python benchmarks/intra_revisions.py --revs 9e9fc9d,b3b305a,HEAD        # on the GPU, 8,4096,16,128
    python benchmarks/intra_revisions.py --revs HEAD~1,HEAD --quick          # tiny shape, interpreter (CPU)
    python benchmarks/intra_revisions.py --revs HEAD,file:variant.py         # a file not committed

The JSON (default benchmarks/results/intra-revisions-<time>.json) holds, per revision, the
relative RMS difference of each output from the first revision's and each round's mean ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import environment, markdown_table, write_json  # noqa: E402
from kernels import testing  # noqa: E402

MODULE = "kernels/kda/mosaic_intra_bf16.py"
OUTPUTS = ("qg", "wn", "kg", "u", "a^T", "decay")


def load(rev: str, tmp: str):
    """The kernel module at git revision `rev` ("file:PATH" for a file instead)."""
    if rev.startswith("file:"):
        path = rev[len("file:"):]
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            src = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=root, capture_output=True, text=True,
                                 check=True).stdout
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"--revs: cannot read {MODULE} at {rev!r}: {e.stderr.strip()}") from None
        path = os.path.join(tmp, f"intra_{len(os.listdir(tmp))}.py")
        with open(path, "w") as f:
            f.write(src)
    spec = importlib.util.spec_from_file_location(f"intra_rev_{abs(hash((rev, path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "intra_bf16"):
        raise SystemExit(f"--revs: {rev!r} has no intra_bf16")
    return module


def rel_rms(a, b) -> float:
    """`kernels.testing.rel_rms` of a against the reference b over the entries finite in both (the
    anchors' padding is not)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    return testing.rel_rms(b[ok], a[ok])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--revs", required=True, help="comma-separated git revisions (or file:PATH), the first the baseline")
    p.add_argument("--shape", default="8x4096x16x128", help="BxTxHxD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=20, help="timed calls per round and revision")
    p.add_argument("--quick", action="store_true", help="1x128x2x64 in the Mosaic GPU interpreter, 1 round of 1 call")
    p.add_argument("--out", help="JSON path")
    a = p.parse_args(argv)
    from kernels.kda.pallas_gpu_bench import inputs

    revs = [r for r in a.revs.split(",") if r]
    if a.quick:
        a.shape, a.rounds, a.calls = "1x128x2x64", 1, 1
    interpret = a.quick or jax.default_backend() == "cpu"
    if interpret and not a.quick:
        raise SystemExit("no GPU: the kernels would run in the interpreter; pass --quick for that")
    B, T, H, D = (int(x) for x in a.shape.split("x"))
    q, k, v, g, beta = inputs(B, T, H, D)
    bt = jnp.moveaxis(beta, 1, 2)
    with tempfile.TemporaryDirectory() as tmp:
        mods = [load(r, tmp) for r in revs]
        fns = [jax.jit(lambda *x, m=m: m.intra_bf16(*x, scale=D ** -0.5, interpret=interpret)) for m in mods]
        if interpret:  # the interpreter's callbacks must not run inside an eagerly dispatched jit
            fns = [lambda *x, m=m: m.intra_bf16(*x, scale=D ** -0.5, interpret=True) for m in mods]
        outs = [jax.block_until_ready(f(q, k, v, g, bt)) for f in fns]
        rows = [dict(rev=r, diffs={n: rel_rms(x, y) for n, x, y in zip(OUTPUTS, o, outs[0])}, ms=[])
                for r, o in zip(revs, outs)]
        for rnd in range(a.rounds):
            for row, f in zip(rows, fns):
                jax.block_until_ready(f(q, k, v, g, bt))
                t = time.perf_counter()
                for _ in range(a.calls):
                    o = f(q, k, v, g, bt)
                jax.block_until_ready(o)
                row["ms"].append((time.perf_counter() - t) / a.calls * 1e3)
                print(f"round {rnd} {row['rev']}: {row['ms'][-1]:.3f} ms", flush=True)
    table = [[r["rev"], " / ".join(f"{x:.3f}" for x in r["ms"]), f"{max(r['diffs'].values()):.2e}"] for r in rows]
    print(markdown_table(["revision", "ms per round", f"max rel RMS diff from {revs[0]}"], table))
    result = dict(env=environment(), shape=[B, T, H, D], calls=a.calls, interpret=interpret, rows=rows)
    path = write_json(result, a.out, "intra-revisions")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

"""Host time to build one training batch of an on-the-fly task (MQAR at the sweep's GPU batches):
`kimi_jax.data.make_iterator` as train.py uses it, beside the same examples read through grain's
per-example path (`grain.MapDataset.source(TaskSource)`), side by side in one process.

    python benchmarks/data_pipeline.py [--settings 64x4x256,256x16x128,512x64x64] [--out J]

A trial's host builds a batch while the device runs the previous step, so this bounds how fast a
small-model trial can step. Median ms per batch over `--batches` after one warm-up batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, markdown_table, write_json  # noqa: E402


def _config(L: int, K: int, batch: int):
    from configs.sweeps import mqar

    config = mqar.get_config(f"trial,mixer=kda,d_model=64,seq_len={L},num_kv_pairs={K}")
    config.data.batch_size = batch
    return config


def _iterators(config):
    """(name, batch iterator) of the two paths over the same examples."""
    import grain

    from kimi_jax import data
    from kimi_jax.data import sources
    from kimi_jax.data.packing import PackedBatches

    via_grain = grain.MapDataset.source(sources.TaskSource(sources.make_task(config.data), config.seed, "train"))
    return [("make_iterator", data.make_iterator(config, "train")),
            ("grain per-example", PackedBatches(via_grain, data.sequence_length(config), data.host_batch_size(config)))]


def time_batches(it, batches: int) -> float:
    next(it)
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        next(it)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="64x4x256,256x16x128,512x64x64", help="LxKxbatch, comma-separated")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--out", help="JSON path (default benchmarks/results/data-pipeline-<time>.json)")
    a = p.parse_args(argv)
    rows = []
    for item in filter(None, a.settings.split(",")):
        try:
            L, K, batch = (int(n) for n in item.split("x"))
        except ValueError:
            p.error(f"--settings {item!r}: expected LxKxbatch, e.g. 64x4x256")
        config = _config(L, K, batch)
        for name, it in _iterators(config):
            rows.append(dict(seq_len=L, num_kv_pairs=K, batch=batch, path=name, ms=time_batches(it, a.batches)))
            print(f"L={L} K={K} batch {batch}, {name}: {rows[-1]['ms']:.2f} ms per batch", flush=True)
    env = dict(environment(), cpu_count=os.cpu_count())
    path = write_json(dict(env=env, batches=a.batches, rows=rows), a.out, "data-pipeline")
    print(markdown_table(["L", "K", "batch", "path", "ms per batch"],
                         [[str(r["seq_len"]), str(r["num_kv_pairs"]), str(r["batch"]), r["path"], f"{r['ms']:.2f}"]
                          for r in rows]) + f"\nwrote {path}", flush=True)
    return rows


if __name__ == "__main__":
    main()

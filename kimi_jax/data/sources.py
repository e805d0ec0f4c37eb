"""Document sources as grain MapDatasets: synthetic tasks generated on the fly, tasks materialised
with TFDS (array_record), prepared TFDS text datasets by name, and local .txt/.jsonl files.

Every source yields documents {inputs, targets, loss_mask} of NumPy arrays [n] (see packing.py)."""

from __future__ import annotations

import functools
import glob
import json
import os

import grain
import numpy as np

SPLITS = ("train", "eval")
# Effectively endless on-the-fly task data (documents are generated in blocks from the index).
ENDLESS = 2**62


def _split_id(split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}")
    return SPLITS.index(split)


def make_task(data_config):
    """The synthetic task of `data.task` with `data.task_kwargs` (kimi_jax.tasks)."""
    from kimi_jax import tasks

    return tasks.make_task(data_config.task, **dict(data_config.task_kwargs))


class TaskSource:
    """Random access to an endless stream of task examples: example i comes from block
    i // block_size, generated with a seed derived from (seed, split, block).

    `shard=(index, count)` is this host's share, examples index, index + count, ... of the stream
    (what `grain.MapDataset.source(...)[index::count]` gives, without grain's per-item cost: an
    MQAR batch of 256 rows at L = 64 takes 6.6 ms through grain's path, 2.3 ms this way;
    `benchmarks/data_pipeline.py`, data-pipeline-cpu2-20261201.json).

    `pool` > 0: a fixed training set instead (Zoology's 100k examples over many epochs): the
    stream's first `pool` examples, held in memory (at L = 512, 100k examples take about 256 MB),
    visited in a new order every epoch (a permutation seeded by (seed, split, epoch))."""

    def __init__(self, task, seed: int, split: str, block_size: int = 256, shard: tuple[int, int] = (0, 1),
                 pool: int = 0):
        self.task, self.seed, self.split_id, self.block_size = task, int(seed), _split_id(split), block_size
        self.shard_index, self.shard_count = (int(v) for v in shard)
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
            raise ValueError(f"pool={pool!r}: expected an int >= 0 (0: fresh examples without end)")
        self.pool, self._pool_arrays = pool, None

    def __len__(self) -> int:
        return ENDLESS // self.shard_count

    @functools.lru_cache(maxsize=4)
    def _block(self, block: int) -> dict:
        return self.task.generate(self._block_seed(block), self.block_size)

    def _pooled(self) -> dict:
        """The pool's examples, generated once (token arrays as uint16 when their values fit)."""
        if self._pool_arrays is None:
            n_blocks = -(-self.pool // self.block_size)
            blocks = [self.task.generate(self._block_seed(b), self.block_size) for b in range(n_blocks)]
            out = {}
            for key in ("inputs", "targets", "loss_mask"):
                x = np.concatenate([blk[key] for blk in blocks])[:self.pool]
                if key != "loss_mask" and x.min() >= 0 and x.max() < 2**16:
                    x = x.astype(np.uint16)
                out[key] = x
            self._pool_arrays = out
        return self._pool_arrays

    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        seed = np.random.SeedSequence([self.seed, self.split_id, 1 << 40, epoch])
        return np.random.default_rng(seed).permutation(self.pool)

    def _block_seed(self, block: int) -> int:
        return int(np.random.SeedSequence([self.seed, self.split_id, block]).generate_state(1)[0] & 0x7FFFFFFF)

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            raise IndexError(f"TaskSource index {index}: the stream is endless, index from its start")
        index = self.shard_index + index * self.shard_count
        if self.pool:
            epoch, j = divmod(index, self.pool)
            block, i = self._pooled(), int(self._epoch_order(epoch)[j])
        else:
            block, i = self._block(index // self.block_size), index % self.block_size
        return {"inputs": block["inputs"][i].astype(np.int32), "targets": block["targets"][i].astype(np.int32),
                "loss_mask": block["loss_mask"][i].astype(bool)}


def open_tfds(name: str, split: str, data_dir: str):
    """`tfds.data_source` for a prepared dataset (no TensorFlow); errors name the dataset."""
    import tensorflow_datasets as tfds

    where = data_dir or "the default TFDS data_dir"
    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
        if len(source) == 0:
            raise ValueError("it has no records")
        source[0]  # a corrupt file fails here rather than deep in the training loop
    except Exception as e:  # tfds raises several types (AssertionError, DatasetNotFoundError, ...)
        raise FileNotFoundError(
            f"TFDS dataset {name!r} (split {split!r}) under {where} is missing or unreadable: "
            f"{type(e).__name__}: {e}") from e
    return source


def _read_text_files(patterns: str, text_key: str) -> list:
    """All documents of the files matching comma-separated globs: .jsonl (field `text_key` of each
    line) or any other file as text (one document per non-empty line)."""
    paths = []
    for pattern in [p for p in patterns.split(",") if p.strip()]:
        found = sorted(glob.glob(os.path.expanduser(pattern.strip())))
        if not found:
            raise FileNotFoundError(f"No text files match {pattern!r} (data.files)")
        paths += found
    if not paths:
        raise FileNotFoundError("data.files is empty: give a glob of .txt or .jsonl files")
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if path.endswith(".jsonl"):
                    try:
                        texts.append(json.loads(line)[text_key])
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f"{path}:{lineno}: not a JSON object with a {text_key!r} field") from e
                else:
                    texts.append(line.rstrip("\n"))
    return texts


def documents(config, split: str, tokenizer=None):
    """The documents of `config.data` for `split` ("train" or "eval"), random access, cut to this
    host's share: a TaskSource for on-the-fly tasks, else a grain MapDataset, shuffled (train) and
    repeated without end."""
    import jax

    from kimi_jax.data.tokenizers import text_to_document

    data, is_train = config.data, _split_id(split) == 0
    kind = data.kind
    pool = data.get("num_train_examples", 0)
    if pool and kind != "task":
        raise ValueError(f"data.num_train_examples={pool} takes an on-the-fly task (data.kind='task'); "
                         f"got kind={kind!r}, whose dataset fixes its own size")
    if kind == "task":  # generated from the seed: no shuffle, endless; the host's share in TaskSource
        return TaskSource(make_task(data), config.seed, split, shard=(jax.process_index(), jax.process_count()),
                          pool=pool if is_train else 0)
    if kind == "tfds_task":
        from kimi_jax.data import tfds_tasks

        name, split_name = tfds_tasks.dataset_name(data.task, dict(data.task_kwargs)), split
        ds = grain.MapDataset.source(open_tfds(name, split_name, data.data_dir)).map(tfds_tasks.decode)
    elif kind == "tfds":
        split_name = data.train_split if is_train else data.eval_split
        ds = grain.MapDataset.source(open_tfds(data.tfds_name, split_name, data.data_dir))
        ds = ds.map(lambda ex: text_to_document(tokenizer, ex[data.text_key]))
    elif kind == "files":
        files = data.files if is_train or not data.eval_files else data.eval_files
        ds = grain.MapDataset.source(_read_text_files(files, data.text_key))
        ds = ds.map(functools.partial(text_to_document, tokenizer))
    else:
        raise ValueError(f"Unknown data.kind={kind!r}; expected one of task, tfds_task, tfds, files")
    if is_train:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(None)
    return ds[jax.process_index()::jax.process_count()]

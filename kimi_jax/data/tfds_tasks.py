"""A TFDS builder that materialises a synthetic task as array_record files (no TensorFlow).

One builder config per (task, settings): `synthetic_task/<task>__<key>_<value>...`. Build it once
with `python -m kimi_jax.data.build`, then train with `data.kind="tfds_task"`: the trainer reads it
through `tfds.data_source` with random access (grain shuffles and shards it).
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import tensorflow_datasets as tfds

NAME = "synthetic_task"
VERSION = "1.0.0"
SPLIT_NAMES = {"train": "train", "eval": "eval"}


def config_name(task: str, task_kwargs: dict) -> str:
    """A TFDS-safe config name for a task and its settings."""
    parts = [task] + [f"{k}_{task_kwargs[k]}" for k in sorted(task_kwargs)]
    return re.sub(r"[^A-Za-z0-9_]", "_", "__".join(parts)).lower()


def dataset_name(task: str, task_kwargs: dict) -> str:
    return f"{NAME}/{config_name(task, task_kwargs)}"


@dataclasses.dataclass(eq=False)
class TaskConfig(tfds.core.BuilderConfig):
    task: str = "mqar"
    task_kwargs_json: str = "{}"
    num_train: int = 10_000
    num_eval: int = 1_000
    seed: int = 0


class SyntheticTask(tfds.core.GeneratorBasedBuilder):
    """Examples {inputs, targets [L] int32, loss_mask [L] bool} of a `kimi_jax.tasks` task."""

    VERSION = tfds.core.Version(VERSION)
    BUILDER_CONFIGS = []  # configs are made on the fly by `builder()`

    def _info(self):
        feature = lambda dtype: tfds.features.Tensor(shape=(None,), dtype=dtype)  # noqa: E731
        return tfds.core.DatasetInfo(
            builder=self, description=f"Synthetic task {self.builder_config.task_kwargs_json}",
            features=tfds.features.FeaturesDict(
                {"inputs": feature(np.int32), "targets": feature(np.int32), "loss_mask": feature(np.bool_)}),
            disable_shuffling=True)

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing is downloaded
        cfg = self.builder_config
        return {"train": self._generate_examples(cfg.num_train, 0), "eval": self._generate_examples(cfg.num_eval, 1)}

    def _generate_examples(self, num_examples: int, split_id: int, block: int = 1024):
        from kimi_jax import tasks

        cfg = self.builder_config
        task = tasks.make_task(cfg.task, **json.loads(cfg.task_kwargs_json))
        for start in range(0, num_examples, block):
            seed = int(np.random.SeedSequence([cfg.seed, split_id, start]).generate_state(1)[0] & 0x7FFFFFFF)
            batch = task.generate(seed, min(block, num_examples - start))
            for i in range(len(batch["inputs"])):
                yield start + i, {k: np.asarray(batch[k][i]) for k in ("inputs", "targets", "loss_mask")}


def builder(task: str, task_kwargs: dict, *, data_dir: str, num_train: int, num_eval: int, seed: int = 0):
    """The builder for one task setting, writing array_record under `data_dir`."""
    cfg = TaskConfig(name=config_name(task, task_kwargs), version=VERSION, task=task,
                     task_kwargs_json=json.dumps(task_kwargs, sort_keys=True),
                     num_train=num_train, num_eval=num_eval, seed=seed)
    return SyntheticTask(config=cfg, data_dir=data_dir, file_format="array_record")


def decode(record) -> dict:
    """A stored record as a document (see packing.py)."""
    return {"inputs": np.asarray(record["inputs"], np.int32), "targets": np.asarray(record["targets"], np.int32),
            "loss_mask": np.asarray(record["loss_mask"], bool)}

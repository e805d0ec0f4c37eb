"""Materialise a synthetic task as a TFDS array_record dataset (no TensorFlow needed):

    python -m kimi_jax.data.build --task mqar --task_kwargs '{"seq_len": 256, "num_kv_pairs": 16}' \
        --num_train 1000000 --num_eval 3000 --data_dir ~/tensorflow_datasets

Then train on it with `--config.data.kind=tfds_task --config.data.data_dir=...` and the same
`data.task` / `data.task_kwargs`.
"""

from __future__ import annotations

import argparse
import json

from kimi_jax.data import tfds_tasks


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, help="a name of kimi_jax.tasks.TASKS")
    parser.add_argument("--task_kwargs", default="{}", help="JSON object of the task's settings")
    parser.add_argument("--num_train", type=int, default=100_000)
    parser.add_argument("--num_eval", type=int, default=3_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_dir", required=True)
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.task_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--task_kwargs is not a JSON object: {args.task_kwargs!r}") from e
    builder = tfds_tasks.builder(args.task, kwargs, data_dir=args.data_dir, num_train=args.num_train,
                                 num_eval=args.num_eval, seed=args.seed)
    builder.download_and_prepare()
    print(f"wrote {tfds_tasks.dataset_name(args.task, kwargs)} to {builder.data_dir}")
    return builder.data_dir


if __name__ == "__main__":
    main()

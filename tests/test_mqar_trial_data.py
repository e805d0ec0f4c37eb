"""The MQAR sweep compares mixers on the same data: every mixer's trial at a grid point must
read the same batches, one example per row (no packing across examples), scored at exactly the
K query positions. A softmax-only failure cannot then come from the data the trial sees."""

from __future__ import annotations

import numpy as np
import pytest

from configs.model_presets import ABLATION_MIXERS
from configs.sweeps import mqar
from kimi_jax import data

L, K = 256, 16


def _trial(mixer: str, variant: str = "gpu_small"):
    return mqar.get_config(f"trial,mixer={mixer},d_model=64,seq_len={L},num_kv_pairs={K},{variant}")


def _first_batches(config, n: int = 2) -> list[dict]:
    config.data.batch_size = 8  # the rows do not depend on the batch size, only their grouping
    it = data.make_iterator(config, "train")
    return [next(it) for _ in range(n)]


def test_every_mixer_trains_on_the_same_data_and_schedule():
    ref = _trial("softmax")
    for mixer in ABLATION_MIXERS:
        config = _trial(mixer)
        assert config.data.to_dict() == ref.data.to_dict(), mixer
        assert config.optim.to_dict() == ref.optim.to_dict(), mixer
        assert (config.seed, config.total_steps) == (ref.seed, ref.total_steps), mixer


@pytest.mark.parametrize("mixer", ["softmax", "kda"])
def test_trial_batches_hold_one_example_per_row_scored_at_the_queries(mixer):
    """[B, L] batches: segment_ids all 1 (attention sees the whole row, and the cuDNN path takes
    its one-document kernel), loss_mask True at K positions per row, each a query: a key token
    (from [1, V/2)) that also occurs in the context, with the target the value after it there."""
    batches = _first_batches(_trial(mixer))
    V = _trial(mixer).data.task_kwargs.vocab_size
    for b in batches:
        inputs, targets, mask = b["inputs"], b["targets"], b["loss_mask"]
        assert inputs.shape == (8, L) and np.all(b["segment_ids"] == 1)
        assert np.all(mask.sum(axis=1) == K) and not mask[:, : 2 * K].any()
        for row in range(inputs.shape[0]):
            context = dict(zip(inputs[row, 0 : 2 * K : 2], inputs[row, 1 : 2 * K : 2]))
            for t in np.flatnonzero(mask[row]):
                key = inputs[row, t]
                assert 1 <= key < V // 2 and context[key] == targets[row, t]


def test_softmax_and_recurrent_trials_read_identical_batches():
    a, b = _first_batches(_trial("softmax")), _first_batches(_trial("kda"))
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)

"""Kimi Linear's synthetic tasks (Kimi Team 2025, §5.1, Fig. 4): Palindrome, MQAR, Stack.

    python sweep.py --config configs/sweeps/kimi.py --workdir workdirs/sweeps/kimi --parallel 8 --devices 0,1,2,3,4,5,6,7
    python sweep.py --config configs/sweeps/kimi.py:tiny --workdir /tmp/kimi_tiny     # 2 trials, CPU

Grid: KDA, Gated DeltaNet, DeltaNet and softmax attention (the paper has KDA, GDN and Mamba2;
Mamba2 is not in this codebase) x task {palindrome, mqar_kimi, stack} x length {256, 512, 1024,
2048} x lr {5e-5, 1e-4, 5e-4, 1e-3}; 2 layers, 2 heads of dim 128 (d_model 256), 20k steps. The
paper reports the best-lr peak TRAINING accuracy; here the best lr's accuracy on held-out
examples (eval.py) is kept. Vocabulary, pair counts and batch size are not in the paper: the
task defaults (kimi_jax/tasks/kimi.py) and batch 32.
"""

from __future__ import annotations

import ml_collections

from configs import common
from configs.model_presets import ablation_config
from configs.sweeps.common import TINY, TRIAL_ARGS, schedule, trial_arg
from kimi_jax.tasks import make_task


def trial_config(arg) -> ml_collections.ConfigDict:
    task = make_task(arg.task, seq_len=arg.seq_len)
    config = ablation_config(arg.mixer, f"d_model={arg.d_model},num_layers=2,"
                                        f"vocab_size={task.vocab_size},num_heads={arg.num_heads}")
    config.data.task = arg.task
    config.data.task_kwargs = ml_collections.ConfigDict(dict(task.settings))
    schedule(config, arg, arg.seq_len)
    return config


def sweep_config(arg) -> ml_collections.ConfigDict:
    sweep = ml_collections.ConfigDict()
    sweep.trial_config = "configs/sweeps/kimi.py"
    sweep.trial_arg = trial_arg(("task", "mixer", "seq_len"), arg) + (
        f",d_model={arg.d_model},num_heads={arg.num_heads}")
    sweep.axes = ml_collections.ConfigDict()
    sweep.axes.task = ["palindrome", "mqar_kimi", "stack"]
    sweep.axes.mixer = ["kda", "gated_deltanet", "deltanet", "softmax"]
    sweep.axes.seq_len = [256, 512, 1024, 2048]
    sweep.axes.lr = [5e-5, 1e-4, 5e-4, 1e-3]
    sweep.overrides = [("optim.lr", "{lr}")]
    sweep.eval_tasks = "train_task"
    sweep.score_task = "{task}"
    sweep.score_setting = ""  # the trained setting is the only one evaluated
    sweep.select_over = "lr"
    sweep.plot = dict(x="seq_len", line="mixer", panel="task")
    if arg.tiny:
        sweep.axes.task = ["palindrome"]
        sweep.axes.mixer = ["kda"]
        sweep.axes.seq_len = [16]
        sweep.axes.lr = [1e-3, 1e-2]
    return sweep


def get_config(arg=None):
    arg = common.parse_arg(arg, **{**TRIAL_ARGS, "steps": 20000}, task="palindrome", mixer="kda",
                           seq_len=256, d_model=256, num_heads=2)
    if arg.tiny:
        arg.update(dict(TINY, d_model=16, num_heads=1))
    return trial_config(arg) if arg.trial else sweep_config(arg)

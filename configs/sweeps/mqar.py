"""Zoology-style MQAR comparison of token mixers (Arora et al. 2023, Fig. 2).

    python sweep.py --config configs/sweeps/mqar.py --workdir workdirs/sweeps/mqar --parallel 8 --devices 0,1,2,3,4,5,6,7
    python sweep.py --config configs/sweeps/mqar.py:tiny --workdir /tmp/mqar_tiny    # 2 trials, CPU, seconds
    python sweep.py --config configs/sweeps/mqar.py:cpu --workdir workdirs/mqar_cpu --parallel 2
        # every mixer at d_model 64 on (L, K) = (64, 4), 2 lrs, 800 steps of batch 64 (12 trials)
    python sweep.py --config configs/sweeps/mqar.py:gpu --workdir /tmp/mqar_gpu --devices 0,1 \
        --trials_per_device 12 --deadline_s 540       # 48 trials of 4000 steps on 2 H200s
    python sweep.py --config configs/sweeps/mqar.py:gpu_small --workdir /tmp/mqar --devices 0,1 \
        --trials_per_device 6 --deadline_s 540        # the 24 trials at d_model 64
    python sweep.py --config configs/sweeps/mqar.py:gpu_small,hi_lr --workdir /tmp/mqar --devices 0,1 \
        --trials_per_device 6 --deadline_s 540        # + lr 1e-2: 12 more trials in the same workdir
    python sweep.py --config configs/sweeps/mqar.py:gpu_hard --workdir /tmp/mqar_hard --devices 0,1 \
        --trials_per_device 12 --deadline_s 540       # (L, K) = (512, 64) at d_model 64, 128 (24 trials)
    python sweep.py --config configs/sweeps/mqar.py:zoology_attention --workdir /tmp/mqar_zoo --devices 0 \
        --trials_per_device 6 --deadline_s 540        # softmax attention in Zoology's form (24 trials)

Grid: softmax attention, linear attention, DeltaNet, Gated DeltaNet, KDA and the 3:1 KDA:MLA
hybrid (the models of configs/ablations: same width, depth and MLP, differing only in the mixer)
x d_model {64, 128, 256} x Zoology's (L, K) in {(64, 4), (128, 8), (256, 16), (512, 64)} x
lr in logspace(-4, -2, 4); each (mixer, width, setting) keeps its best lr, as Zoology plots.
Data as Zoology: vocab 8192, alpha 0.01, no random filler, batch 512 / 256 / 128 for
L <= 128 / 256 / 512; 12.5k steps (64 epochs of 100k examples at batch 512), fresh examples
each step. Differences from Zoology: 2 layers WITH the ablation MLP (Zoology: none), a short
conv in every recurrent mixer and RoPE in attention (Zoology: learned positions), no early stop;
the 3:1 hybrid has 4 layers (3 KDA + 1 MLA, the shortest 3:1 stack), the other mixers 2.

`:gpu` is the grid sized for 2 GPUs, where much of a trial's cost is on the host: fixed costs
(measured on CPU at d_model 128, L=256: train-step compile 8 s for softmax to 36 s for the
hybrid, start and init 10-25 s, eval.py 10-40 s) and the MQAR generator, 0.31 ms per batch of
256 at L=64 and 0.75 ms per batch of 128 at L=256 on one core (1.2 s / 3 s per 4000-step trial);
the input pipeline around it builds a batch of 256 at L=64 in 2.3 ms, 6.6 ms through grain's
per-example path (`benchmarks/data_pipeline.py`, data-pipeline-cpu2-20261201.json, 2 cores).
On the device a trial's step is many small kernels: KDA at d_model 256, (64, 4), batch 256 alone
on an H200 takes 7.6 ms per step, 612 kernels of 7.7 ms in all (`benchmarks/train.py --config
"configs/sweeps/mqar.py:trial,mixer=kda,d_model=256,seq_len=64,num_kv_pairs=4" --rows 1:none:256
--seq_len 64 --profile_steps 1`, train-mqar-trial-h200-20261201T0511.json), against 14 ms with
three trials sharing the GPU, so trials sharing a device finish more steps per second in all.
The learning rate is a runtime argument of the train step, so a grid point's two lrs compile one
program: the second trial loads it from the sweep's compilation cache. Every mixer x d_model
{64, 128} x (L, K) in {(64, 4), (256, 16)} x lr {1e-3, 3e-3} (48 trials), 4000 steps at batch
256 (L=64) / 128 (L=256): 1.02M / 512k training examples, 16% / 8% of Zoology's 64 epochs of
100k (half its batch, 32% of its 12.5k steps; a first attempt at 1000 steps left every mixer
near chance); two learning rates instead of four; no in-training eval; eval.py on 1000 held-out
examples (Zoology: 3000). `:gpu_small` is the same at d_model 64 only (24 trials); `:gpu_hard`
the same budget at Zoology's hardest setting (512, 64), batch 64, d_model {64, 128} (24 trials).

`hi_lr` adds Zoology's top lr 1e-2 to the lr axis of `:gpu` / `:gpu_small` / `:cpu` (36 trials
for `:gpu_small`). Its trials keep the names and configs of the plain grid, so run in a finished
workdir it trains only the 1e-2 trials and the summary takes the max over all three lrs. Why: at
4000 steps the score of softmax attention rose with lr at the top of {1e-3, 3e-3} (at (64, 4)
only 3e-3 leaves the 1/K plateau, after ~1800 steps), so the two-lr grid did not bracket its best
lr. Measured on an H200 (benchmarks/results/mqar-softmax-lr-h200-20261130.json): 1e-2 is past it
(0.21 / 0.25 at (64, 4), d_model 64 / 128), and no lr lifts attention off the plateau at (256, 16).
`:softmax_forms` asks which difference from Zoology keeps softmax attention on the 1/K plateau
at (256, 16): d_model 64 with and without RoPE (NoPE) x with and without the MLP (Zoology's models
have none) x 4000 and 12000 steps (the budget) x lr {1e-3, 3e-3}, 16 trials. Measured on two
H200s (benchmarks/results/mqar-softmax-forms-h200x2-20261130.json): every form stays at ~0.04 at
4000 steps; at 12000 steps lr 3e-3 solves it with RoPE (1.00 with or without the MLP) and NoPE
reaches 0.48-0.52, so the budget is the cause:
    python sweep.py --config configs/sweeps/mqar.py:softmax_forms --workdir /tmp/mqar_forms \
        --devices 0,1 --trials_per_device 8 --deadline_s 540
`:gpu_long` is every mixer x d_model {64, 128, 256} x the four (L, K) settings on that budget
(12000 steps at the gpu batches, lr 3e-3: the lr at which attention solved (256, 16); one lr, so
not Zoology's best-of-four), 72 trials (the first 48, widths 64 and 128, measured as below); run it
in pieces that fit a call, e.g. the 6 trials at
(256, 16), d_model 64 (measured on two H200s: every mixer 0.996-1.000,
benchmarks/results/mqar-gpu-long-h200x2-20261130.json) and the 6 at (512, 64) per width
(measured on two H200s, 3 trials per GPU, 342 s at d_model 64 and 481 s at 128: linear attention
0.97 / 0.99, DeltaNet 0.98 / 0.95, Gated DeltaNet 0.00 / 0.94, KDA 0.14 / 0.31, the hybrid
0.21 / 0.00, softmax attention 0.01 / 0.02; benchmarks/results/mqar-gpu-long512-*h200x2-20261130T18*.json):
At (64, 4) and (128, 8), d_model 64, 6 trials per GPU in one run on two H200s: a trial takes
300 s (median; 450 s at most) and eval.py 17 s; every mixer 1.00 at (64, 4) and the three that
finished within a 470 s deadline at (128, 8) 1.00 (benchmarks/results/mqar-gpu-long-short-h200x2-
20261130T2003.json). The pieces measured so far, merged (`benchmarks/mqar_sweep_report.py --merge`):
benchmarks/results/mqar-gpu-long-merged-h200-20261202T1850.json, all 72 cells (all 48 at
d_model 64 and 128; at d_model 256 every mixer 1.00 at (64, 4) (207-318 s, two or three trials on
one H200) and at (128, 8) (softmax 332 s of three sharing an H200, linear attention, DeltaNet and
KDA 365 / 428 / 530 s two sharing, Gated DeltaNet 265 s alone, the hybrid resumed after a stop);
at (256, 16) KDA 1.00 in 243 s alone, linear attention and DeltaNet 1.00 in 360 / 430 s two
sharing, Gated DeltaNet 1.00 in 511 s sharing with the hybrid (1.00, resumed after a stop at 537 s,
129 s more alone), and softmax 0.07 in 231 s alone, on the plateau, as at lr 1e-3 and 3e-4;
at (512, 64) all six at once on one H200 under CUDA MPS, 447-1240 s each: DeltaNet 0.98, the
others on the plateau at this lr, linear attention included). lr 1e-3 pieces at (512, 64) lift
every gated or hybrid cell they ran on (7 trials at once on one H200 under MPS, 621-984 s each):
the hybrid 1.00 at d_model 64 / 128, linear attention and Gated DeltaNet 1.00 at 256, KDA 0.68 /
0.82 / 0.97, Gated DeltaNet 0.38 at 64; softmax stays at 0.01. lr 4.6e-4 (4 trials beside the
hybrid at d_model 256 and lr 1e-3, which solves it: 1.00) is worse for KDA at 64 / 128 (0.07 /
0.40) and Gated DeltaNet at 64 (0.00), so 1e-3 is their best lr; Gated DeltaNet at 128 gains
(0.96 from 0.94). `num_heads=1` gives attention one head of width d_model, as Zoology's has, in
trials named apart from the grid's (d_model // 32 heads): at lr 3e-3 softmax attention stays on
the plateau with it too (0.01-0.02 at (512, 64), 0.06 at (256, 16), d_model 256), as it does
with 3x the steps (36000, d_model 64: 0.02). `rope=False`, `mlp=False` and `learned_pos=True` (a
learned position table of the trial's length), `train_examples=N` (a fixed training set) and
`dropout=R` (embedding and attention-probability dropout in training), `tied=True` (the head
is the token embedding) and `conv=False` (the recurrent mixers without their short convolution:
plain linear attention as the published baselines have it; at (512, 64) it fails, 0.00 at
d_model 64 and 128, benchmarks/results/mqar-gpu-long-512x64-linear-noconv-lr3e-3-h200-
20261205T0550.json) are forms with their own trial names too; Zoology's
attention, `mixers=softmax,rope=False,learned_pos=True,mlp=False,num_heads=1,batch_size=128`,
solves (512, 64) at lr 3e-3 on this budget at d_model 64 and 128 (1.00 each; lr 1e-3: 0.01 /
0.38) and stays on the plateau at 256 (0.01; (256, 16): 0.06), while learned positions with the
MLP and d_model // 32 heads at batch 64 stay at 0.01 (benchmarks/results/mqar-gpu-long-*softmax-
{zoology-form,learned-pos}-h200-20261204T2146.json). A piece of
3 trials per GPU takes 300-450 s, of 6 per GPU up to 500 s at d_model 128 (the hybrid longest: at
(256, 16), d_model 128, 250 s alone on an H200, unfinished in 490 s sharing one).
    python sweep.py --config configs/sweeps/mqar.py:gpu_long,widths=64,settings=256x16 \
        --workdir /tmp/mqar_long --devices 0,1 --trials_per_device 3 --deadline_s 540
    python sweep.py --config configs/sweeps/mqar.py:gpu_long,widths=128,settings=512x64 \
        --workdir /tmp/mqar_long --devices 0,1 --trials_per_device 3 --deadline_s 540
`mixers=softmax+linear` restricts any variant to those mixers, `widths=128` (or `64+128`) to
those widths and `settings=512x64` (or `64x4+512x64`) to those (L, K) settings (same trial names,
so the trials join a workdir of the full grid). `lrs=1e-4+4.6e-4+1e-2` replaces the lr axis: a
piece run at other learning rates merges with the earlier ones (`mqar_sweep_report.py --merge`),
each cell keeping its best lr over all of them, as Zoology's best-of-four does.

The same file is the trial config: `configs/sweeps/mqar.py:trial,mixer=kda,d_model=64,seq_len=64,
num_kv_pairs=4` is the full training config of one grid point (sweep.py adds `--config.optim.lr`).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from configs import common
from configs.model_presets import ABLATION_MIXERS, HYBRID, ablation_config
from configs.sweeps.common import TINY, TRIAL_ARGS, schedule, trial_arg

SETTINGS = ((64, 4), (128, 8), (256, 16), (512, 64))


def batch_size(seq_len: int, gpu: bool = False) -> int:
    """Zoology's batch per length; the gpu variant halves it (the generator is the cost)."""
    full = 512 if seq_len <= 128 else 256 if seq_len <= 256 else 128
    return full // 2 if gpu else full


def trial_config(arg) -> ml_collections.ConfigDict:
    """One grid point: the ablation model of `mixer` trained on MQAR (L, K)."""
    layers = max(arg.num_layers, len(HYBRID)) if arg.mixer == "hybrid" else arg.num_layers
    config = ablation_config(arg.mixer, f"d_model={arg.d_model},num_layers={layers},num_heads={arg.num_heads},"
                                        f"vocab_size={arg.vocab_size},rope={arg.rope},ffn={arg.mlp},"
                                        f"learned_positions={arg.seq_len if arg.learned_pos else 0},"
                                        f"dropout={arg.dropout},tied={arg.tied},conv={arg.conv}")
    config.data.task = "mqar"
    config.data.task_kwargs = ml_collections.ConfigDict(dict(
        seq_len=arg.seq_len, num_kv_pairs=arg.num_kv_pairs, vocab_size=arg.vocab_size,
        power_a=0.01, num_passes=1, random_non_queries=False))
    arg.batch_size = arg.batch_size or batch_size(arg.seq_len, arg.gpu and not arg.full_batch)
    config.data.num_train_examples = int(arg.train_examples)  # 0: fresh examples every step
    schedule(config, arg, arg.seq_len)
    return config


def trial_cost(point: dict, arg) -> float:
    """Tokens a trial trains on, times its layers: a proxy of its device time. At d_model 64 on an
    H200 (6 trials per GPU) (64, 4) at batch 256 took about half the time of (128, 8) at batch 256."""
    seq_len = point["seq_len"]
    batch = arg.batch_size or batch_size(seq_len, arg.gpu and not arg.full_batch)
    layers = max(arg.num_layers, len(HYBRID)) if point["mixer"] == "hybrid" else arg.num_layers
    return float(seq_len * batch * point.get("steps", arg.steps) * layers)


def _subset(values, text, arg: str, axis: str, parse, form: str, key=lambda v: v) -> list:
    """The entries of axis `values` whose key is among the "+"-separated items of `text`, in the
    axis' order; an item that does not parse (as `form`) or is not on the axis raises."""
    try:
        wanted = [parse(item) for item in str(text).split("+")]
    except ValueError:
        raise ValueError(f"{arg}={text!r}: expected {form} entries joined by '+'") from None
    have = [key(v) for v in values]
    missing = [w for w in wanted if w not in have]
    if missing:
        raise ValueError(f"Unknown {arg} in {arg}={text!r}: {missing} not in this variant's {axis} axis {have}")
    return [v for v in values if key(v) in wanted]


def sweep_config(arg) -> ml_collections.ConfigDict:
    sweep = ml_collections.ConfigDict()
    sweep.trial_config = "configs/sweeps/mqar.py"
    # Model forms off the default (RoPE, MLP, d_model // 32 heads) are grid keys of one value, so
    # their trials are named apart from the grid's.
    forms = {k: v for k, v in (("rope", not arg.rope), ("mlp", not arg.mlp), ("learned_pos", arg.learned_pos),
                               ("full_batch", arg.full_batch), ("num_heads", bool(arg.num_heads)),
                               ("train_examples", bool(arg.train_examples)), ("dropout", bool(arg.dropout)),
                               ("tied", arg.tied), ("conv", not arg.conv)) if v}
    if arg.softmax_forms and {"rope", "mlp"} & set(forms):
        raise ValueError("softmax_forms sweeps rope and mlp itself; do not also set rope= or mlp=")
    grid_keys = ("mixer", "d_model", "seq_len", "num_kv_pairs") + (
        ("rope", "mlp", "steps") if arg.softmax_forms else ()) + tuple(forms)
    sweep.trial_arg = trial_arg(grid_keys, arg) + (
        f",num_layers={arg.num_layers},vocab_size={arg.vocab_size}" + (",gpu" if arg.gpu else ""))
    # Grid axes: each a list; `setting` entries are dicts expanded into the template.
    sweep.axes = ml_collections.ConfigDict()
    sweep.axes.mixer = list(ABLATION_MIXERS)
    sweep.axes.d_model = [64, 128, 256]
    sweep.axes.setting = [dict(seq_len=L, num_kv_pairs=K) for L, K in SETTINGS]
    sweep.axes.lr = [float(x) for x in np.logspace(-4, -2, 4)]
    # (key, value) pairs passed as `--config.<key>=<value>` to each trial (grid keys in braces).
    sweep.overrides = [("optim.lr", "{lr}")]
    # What a trial is scored on: eval.py's --tasks, and the results.json entry of the trained task.
    sweep.eval_tasks = "train_task"
    sweep.score_task = "mqar"
    sweep.score_setting = "L{seq_len}_K{num_kv_pairs}"
    # Kept: the max over this axis of the score (Zoology: best learning rate per point).
    sweep.select_over = "lr"
    # Summary plot: x axis and one line per value of `line`; one panel per value of `panel`.
    sweep.plot = dict(x="d_model", line="mixer", panel="setting")
    # Relative cost of a trial, by which sweep.py spreads running trials over the devices.
    sweep.cost = lambda point: trial_cost(point, arg)
    if arg.cpu:  # every mixer at the smallest Zoology point, sized for a CPU
        sweep.axes.d_model = [64]
        sweep.axes.setting = [dict(seq_len=64, num_kv_pairs=4)]
        sweep.axes.lr = [1e-3, 3e-3]
    if arg.gpu:  # every mixer, the two small widths (gpu_small: 64), an easy and a hard setting
        sweep.axes.d_model = [64] if arg.gpu_small else [64, 128]
        sweep.axes.setting = [dict(seq_len=64, num_kv_pairs=4), dict(seq_len=256, num_kv_pairs=16)]
        sweep.axes.lr = [1e-3, 3e-3]
    if arg.gpu_hard:  # Zoology's hardest setting at the two small widths (24 trials)
        sweep.axes.d_model = [64, 128]
        sweep.axes.setting = [dict(seq_len=512, num_kv_pairs=64)]
        sweep.axes.lr = [1e-3, 3e-3]
    if arg.gpu_long:  # the budget that lets softmax attention solve (256, 16); filter with widths=, settings=
        sweep.axes.d_model = [64, 128, 256]
        sweep.axes.setting = [dict(seq_len=L, num_kv_pairs=K) for L, K in SETTINGS]
        sweep.axes.lr = [3e-3]
    if arg.softmax_forms:  # which difference from Zoology keeps softmax attention at 1/K on (256, 16)
        sweep.axes.mixer = ["softmax"]
        sweep.axes.d_model = [64]
        sweep.axes.setting = [dict(seq_len=256, num_kv_pairs=16)]
        sweep.axes.form = [dict(rope=r, mlp=m) for m in (True, False) for r in (True, False)]
        sweep.axes.steps = [4000, 12000]
        sweep.axes.lr = [1e-3, 3e-3]
        sweep.plot = dict(x="steps", line="form", panel="setting")
    if arg.hi_lr:  # Zoology's top lr on top of the variant's (see the docstring)
        sweep.axes.lr = sorted(set(sweep.axes.lr) | {1e-2})
    if arg.lrs:  # the lr axis itself, e.g. the rest of Zoology's grid for a piece: lrs=1e-4+4.6e-4+1e-2
        try:
            lrs = sorted({float(x) for x in str(arg.lrs).split("+")})
        except ValueError:
            raise ValueError(f"lrs={arg.lrs!r}: expected learning rates joined by '+'") from None
        if lrs[0] <= 0:
            raise ValueError(f"lrs={arg.lrs!r}: learning rates must be positive")
        sweep.axes.lr = lrs
    # Subsets of an axis, "+"-separated; the trials keep the full grid's names.
    if arg.mixers:
        sweep.axes.mixer = _subset(sweep.axes.mixer, arg.mixers, "mixers", "mixer", str, "mixer names")
    if arg.widths:
        sweep.axes.d_model = _subset(sweep.axes.d_model, arg.widths, "widths", "d_model", int, "integer")
    if arg.settings:  # e.g. 512x64+256x16
        sweep.axes.setting = _subset(sweep.axes.setting, arg.settings, "settings", "settings",
                                     lambda item: tuple(int(n) for n in item.split("x")), "LxK",
                                     key=lambda d: (d["seq_len"], d["num_kv_pairs"]))
    if arg.num_heads:  # a head count for every width (Zoology's attention: 1); its own trial names
        if arg.num_heads < 0:
            raise ValueError(f"num_heads={arg.num_heads}: expected a positive head count (0 = d_model // 32)")
    if arg.train_examples < 0:  # a fixed training set (Zoology: 100000), reshuffled every epoch
        raise ValueError(f"train_examples={arg.train_examples}: expected a positive example count (0 = fresh)")
    if not 0 <= arg.dropout < 1:  # Zoology's attention: 0.1 on the embedding and the attention probabilities
        raise ValueError(f"dropout={arg.dropout}: expected a rate in [0, 1) (0 = none)")
    for key in forms:  # one value each (Zoology's attention: see ZOOLOGY_ATTENTION)
        sweep.axes[key] = [arg[key]]
    if arg.tiny:  # 2 trials in seconds on CPU: softmax, width 16, 2 learning rates
        sweep.axes.mixer = ["softmax"]
        sweep.axes.d_model = [16]
        sweep.axes.setting = [dict(seq_len=16, num_kv_pairs=2)]
        sweep.axes.lr = [1e-3, 1e-2]
    return sweep


# `zoology_attention`: softmax attention as Zoology's Fig. 2 builds it (learned absolute positions,
# one head of width d_model, no MLP, dropout 0.1 on the embedding and the attention probabilities,
# the head tied to the embedding) at Zoology's batch per length (512 / 512 / 256 / 128, twice the
# gpu batches), on the gpu_long budget (12000 steps) at lr 1e-3 and 3e-3: 24 trials, named apart
# from the grid's. Zoology's fixed set of 100k examples is `train_examples=100000` on top.
# (512, 64) at d_model 256 stays on the plateau within 12000-20000 steps at five lrs and leaves it
# with `steps=36000` (lr 1e-3, without dropout and tie: 1.00; README, "Recall: MQAR").
ZOOLOGY_ATTENTION = dict(gpu_long=True, mixers="softmax", rope=False, learned_pos=True, mlp=False, num_heads=1,
                         full_batch=True, lrs="1e-3+3e-3", dropout=0.1, tied=True)

# Trial-arg values of the size variants; keys given explicitly in the arg win.
VARIANTS = dict(
    cpu=dict(steps=800, batch_size=64, eval_examples=256, decode_timing=False),
    gpu=dict(steps=4000, eval_examples=1000, decode_timing=False, final_only=True),
    tiny=dict(TINY, vocab_size=64, num_layers=1),
)


def get_config(arg=None):
    arg_str = arg or ""
    arg = common.parse_arg(arg_str, **{**TRIAL_ARGS, "steps": 12500, "batch_size": 0},
                           mixer="kda", d_model=64, num_layers=2, seq_len=64, num_kv_pairs=4,
                           vocab_size=8192, cpu=False, gpu=False, gpu_small=False, gpu_hard=False,
                           softmax_forms=False, gpu_long=False, hi_lr=False, mixers="", widths="", settings="",
                           lrs="", rope=True, mlp=True, num_heads=0, learned_pos=False, full_batch=False,
                           train_examples=0, dropout=0.0, tied=False, conv=True, zoology_attention=False)
    given = {item.partition("=")[0] for item in arg_str.split(",")}
    if arg.zoology_attention:  # keys given explicitly win, as for the size variants
        arg.update({k: v for k, v in ZOOLOGY_ATTENTION.items() if k not in given})
    arg.gpu = arg.gpu or arg.gpu_small or arg.gpu_hard or arg.softmax_forms or arg.gpu_long  # the gpu budget
    for name, values in VARIANTS.items():
        if arg[name]:
            arg.update({k: v for k, v in values.items() if k not in given})
    if arg.gpu_long and "steps" not in given:  # the gpu budget, three times as long
        arg.steps = 12000
    return trial_config(arg) if arg.trial else sweep_config(arg)

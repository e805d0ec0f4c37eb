"""A ~1.3B-parameter dense model with K3's topology, for throughput (MFU) measurements: 24 layers
in the 3:1 KDA:MLA pattern, d_model 2048, KDA 16 heads x 128, MLA 16 heads, SiTU-GLU MLPs of
width 4608 in every layer (no MoE), attention residuals in blocks of 12 layers, vocab 32768.

    python -m kimi_jax.summary --config configs/k3_1b3_dense.py
    python benchmarks/train.py --config configs/k3_1b3_dense.py      (one and two GPUs)
    python train.py --config configs/k3_1b3_dense.py --workdir workdirs/k3_1b3 \\
        --config.data.kind=files --config.data.files='corpus/*.jsonl' --config.data.seq_len=2048
"""

import ml_collections

from configs import common
from configs.model_presets import k3_model


def get_config(arg=None):
    arg = common.parse_arg(arg, d_model=2048, num_layers=24, vocab_size=32768)
    config = common.base_config()
    model = k3_model().to_dict()
    model.update(vocab_size=arg.vocab_size, d_model=arg.d_model, num_layers=arg.num_layers,
                 dense_layers=arg.num_layers, dense_hidden=9 * arg.d_model // 4, moe=None)
    model = ml_collections.ConfigDict(model)
    heads = arg.d_model // 128
    model.mixers.kda.update(dict(num_heads=heads, head_dim=128))
    model.mixers.mla.update(dict(num_heads=heads, q_lora_rank=arg.d_model // 2, kv_lora_rank=512))
    config.model = model
    # 16k tokens per step, the one-H200 throughput point: without activation checkpointing the
    # step keeps 89 GiB of temporaries next to 14.6 GiB of state (fits 141 GB) and is the fastest
    # (409 ms at 4 x 4096 vs 457 for "dots16" in one run, benchmarks/results/train-h200-20261130T0621.json).
    # Scale batch_size with the GPU count. 80 GB GPUs need --config.remat=dots16 and fewer tokens
    # per GPU (dots16 keeps 62 GiB of temporaries at 16k tokens).
    config.data.batch_size, config.data.seq_len = 8, 2048
    config.optim.lr, config.optim.warmup_steps = 3e-4, 2000
    config.optim.compute_dtype = "bfloat16"
    config.remat = "none"
    return config

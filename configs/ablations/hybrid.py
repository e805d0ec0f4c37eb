"""Mixer ablation: 3:1 KDA:MLA hybrid, at the width and depth shared by every file in this folder.

    python train.py --config configs/ablations/hybrid.py:d_model=128 --workdir workdirs/ablations/hybrid
    python -m kimi_jax.summary --config configs/ablations/hybrid.py

Args: d_model (64), num_layers (4), vocab_size (8192, the MQAR vocabulary), num_heads (0 = d_model // 32),
rope (True; False = NoPE softmax attention), ffn (True; False = mixer-only layers).
"""

from configs.model_presets import ablation_config


def get_config(arg=None):
    return ablation_config("hybrid", arg)

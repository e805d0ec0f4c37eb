"""Mixer ablation: gated_deltanet, at the width and depth shared by every file in this folder.

    python train.py --config configs/ablations/gated_deltanet.py:d_model=128 --workdir workdirs/ablations/gated_deltanet
    python -m kimi_jax.summary --config configs/ablations/gated_deltanet.py

Args: d_model (64), num_layers (4), vocab_size (8192, the MQAR vocabulary), num_heads (0 = d_model // 32),
rope (True; False = NoPE softmax attention), ffn (True; False = mixer-only layers).
"""

from configs.model_presets import ablation_config


def get_config(arg=None):
    return ablation_config("gated_deltanet", arg)

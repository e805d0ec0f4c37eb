"""Kimi Linear 48B-A3B (2025-10-30): 27 layers (20 KDA + 7 NoPE MLA, the last layer MLA),
d_model 2304, MoE 256 experts top-8 with one shared expert, SwiGLU, plain residuals. About 49.1B
total / 3B active parameters.

    python -m kimi_jax.summary --config configs/kimi_linear.py
"""

from configs import common
from configs.model_presets import kimi_linear_model


def get_config(arg=None):
    config = common.base_config()
    config.model = kimi_linear_model()
    return config

"""Kimi K3 (released 2026-07-27), the full text model: 93 layers (69 KDA + 24 gated NoPE MLA,
3:1 with the last two layers MLA), d_model 7168, LatentMoE 896 experts top-16 with 2 shared,
SiTU-GLU, block attention residuals of 12 layers. 2.78T total / 104.2B active parameters.

    python -m kimi_jax.summary --config configs/k3.py

Training it needs a multi-host accelerator slice with expert parallelism (config.mesh); on one
host use it for the abstract summary only.
"""

from configs import common
from configs.model_presets import k3_model


def get_config(arg=None):
    config = common.base_config()
    config.model = k3_model()
    return config

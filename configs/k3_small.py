"""A ~100M-parameter model with K3's topology (torchtitan's `k3mini` shape): d_model 512,
21 layers with MLA at 4, 8, 12, 16, 20 and 21 (1-based), KDA 4 heads x 128, LatentMoE 8 experts
top-2 with 2 shared (latent 256), SiTU-GLU, attention residuals in blocks of 12 layers.

    python -m kimi_jax.summary --config configs/k3_small.py
    python train.py --config configs/k3_small.py --workdir workdirs/k3_small   (one GPU)
"""

from configs import common
from configs.model_presets import k3_small_model


def get_config(arg=None):
    config = common.base_config()
    config.model = k3_small_model()
    return config

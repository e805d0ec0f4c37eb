"""Tiny 3:1 KDA:MLA hybrid (d_model 64, 4 layers, dense first layer, LatentMoE 8 x top-2,
SiTU-GLU, attention residuals) for CPU runs and tests; the default of `make train`.

    python train.py --config configs/tiny.py --workdir workdirs/tiny
    python -m kimi_jax.summary --config configs/tiny.py

Args (`configs/tiny.py:d_model=128,vocab_size=512`): model width and vocabulary (sized for the
MQAR task; it must exceed the task's sequence length).
"""

from configs import common
from configs.model_presets import tiny_hybrid_model


def get_config(arg=None):
    arg = common.parse_arg(arg, d_model=64, vocab_size=256)
    config = common.base_config()
    config.model = tiny_hybrid_model(d_model=arg.d_model, vocab_size=arg.vocab_size)
    # `make train`: minutes on CPU; MQAR (64, 4, vocab 256) ends well above chance (~0.15 vs 1/128).
    config.total_steps, config.optim.lr, config.optim.warmup_steps = 400, 3e-3, 20
    config.eval_every_steps = config.checkpoint_every_steps = 100
    return config

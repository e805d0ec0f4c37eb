"""kimi-jax: KDA and the K3 / Kimi Linear hybrids in Flax NNX.

    from kimi_jax import build_model, load_model
    model = build_model(config, rngs=nnx.Rngs(0))      # reads config.model
    model = load_model(config, workdir)                # latest checkpoint of a train.py run
"""

from kimi_jax.config import ModelConfig
from kimi_jax.model import Model, build_model


def __getattr__(name):
    # load_model lives with the checkpointing code, which imports the model: import it lazily.
    if name == "load_model":
        from kimi_jax.checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'kimi_jax' has no attribute {name!r}")


__all__ = ["ModelConfig", "Model", "build_model", "load_model"]

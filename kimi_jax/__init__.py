"""kimi-jax: KDA and the K3 / Kimi Linear hybrids in Flax NNX."""

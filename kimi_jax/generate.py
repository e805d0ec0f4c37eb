"""Greedy generation with the decode cache: the prompt is fed token by token (each step is
`model.decode_step`, which equals the full forward), then the argmax token is appended.

    tokens = generate(model, prompt [B, T0] int32, max_new_tokens)   # [B, T0 + max_new_tokens]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def generate(model, prompt, max_new_tokens: int):
    """Greedy continuation of `prompt` [B, T0] (T0 >= 1) -> [B, T0 + max_new_tokens] int32."""
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be [B, T0 >= 1] integers; got shape {prompt.shape}, "
                         f"dtype {prompt.dtype}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
    B, T0 = prompt.shape
    prompt = prompt.astype(jnp.int32)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(B, T0 + max_new_tokens)
    new = _run(graphdef, state, prompt, cache, int(max_new_tokens))
    return jnp.concatenate([prompt, new], axis=1)


def stepwise_logits(model, tokens):
    """Teacher-forced logits from the decode path: tokens [B, T] -> [B, T, vocab] float32, one
    `decode_step` per position (equals `model(tokens)` for a single document per row)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    graphdef, state = nnx.split(model)
    return _stepwise(graphdef, state, tokens, model.init_cache(*tokens.shape))


@jax.jit(static_argnums=(0,))
def _stepwise(graphdef, state, tokens, cache):
    model = nnx.merge(graphdef, state)

    def step(cache, token):
        logits, cache = model.decode_step(token[:, None], cache)
        return cache, logits[:, 0]

    return jax.lax.scan(step, cache, tokens.T)[1].transpose(1, 0, 2)


@jax.jit(static_argnums=(0, 4))
def _run(graphdef, state, prompt, cache, max_new_tokens: int):
    model = nnx.merge(graphdef, state)

    def step(cache, token):  # token [B]
        logits, cache = model.decode_step(token[:, None], cache)
        return cache, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

    cache, predicted = jax.lax.scan(step, cache, prompt.T)  # prefill
    if max_new_tokens == 0:
        return prompt[:, :0]

    def gen(carry, _):
        cache, token = carry
        cache, nxt = step(cache, token)
        return (cache, nxt), token

    _, out = jax.lax.scan(gen, (cache, predicted[-1]), None, length=max_new_tokens)
    return out.T

"""Jitted model calls for evaluation: full forward, greedy generation through `decode_step`
(prefill by scanning the prompt into the cache) and timed decode steps.

The model is split once into (graphdef, state); every call jits over the state (graphdef static)
so a model loaded with any sharding runs without copies, and models of one structure share the
compiled programs. Shapes [B, T] change per task setting and recompile."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.evaluators.scoring import score_logits


def _model(graphdef, state):
    return nnx.merge(graphdef, state)


def _scan_prefill(model, tokens, cache):
    """Feed tokens [B, T] one at a time through decode_step (T may be 0)."""
    def body(cache, tok):
        _, cache = model.decode_step(tok[:, None], cache)
        return cache, None
    cache, _ = jax.lax.scan(body, cache, tokens.T)
    return cache


# Module-level jits with the graphdef static: runners of models with the same structure (e.g. the
# in-training evaluation, called with fresh parameters every time) share compiled programs.
@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, inputs, targets, loss_mask):
    return score_logits(_model(graphdef, state)(inputs), targets, loss_mask)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _generate(graphdef, state, prompt, num_new):
    model = _model(graphdef, state)
    B, T0 = prompt.shape
    # The last new token is returned, never fed: T0 - 1 + num_new positions (num_new >= 1).
    cache = _scan_prefill(model, prompt[:, :-1], model.init_cache(B, T0 + num_new - 1))

    def body(carry, _):
        cache, tok = carry
        logits, cache = model.decode_step(tok, cache)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        return (cache, nxt), nxt[:, 0]

    _, new = jax.lax.scan(body, (cache, prompt[:, -1:]), None, length=num_new)
    return new.T


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tokens, cache):
    return _model(graphdef, state).decode_step(tokens, cache)


class ModelRunner:
    def __init__(self, model):
        self.graphdef, self.state = nnx.split(model)

    def score(self, inputs, targets, loss_mask) -> dict:
        """Per-example `score_logits` of one batch [B, T] (NumPy out)."""
        out = _score(self.graphdef, self.state, jnp.asarray(inputs), jnp.asarray(targets),
                     jnp.asarray(loss_mask))
        return jax.tree.map(np.asarray, out)

    def greedy(self, prompt, num_new: int) -> np.ndarray:
        """Greedy continuation tokens [B, num_new] of prompt [B, T0] (T0 >= 1)."""
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 2 or prompt.shape[1] < 1 or num_new < 1:
            raise ValueError(f"greedy: prompt must be [B, T0>=1] and num_new >= 1; got "
                             f"{prompt.shape}, {num_new}")
        return np.asarray(_generate(self.graphdef, self.state, jnp.asarray(prompt), int(num_new)))

    def decode_seconds_per_token(self, context_len: int, *, batch_size: int = 1, steps: int = 8,
                                 seed: int = 0) -> float:
        """Wall time of one decode step [B, 1] after `context_len` cached tokens (random ids 0/1,
        valid for any vocab): the median over `steps` timed steps. The context is fed through the
        same jitted step (one compile per cache shape; no separate prefill program)."""
        if context_len < 0 or steps < 1:
            raise ValueError(f"decode timing needs context_len >= 0 and steps >= 1; got {context_len}, {steps}")
        model = _model(self.graphdef, self.state)
        tokens = np.random.RandomState(seed).randint(0, 2, size=(batch_size, context_len + steps))
        tokens = jnp.asarray(tokens, jnp.int32)
        cache = model.init_cache(batch_size, context_len + steps)
        for t in range(context_len):
            _, cache = _step(self.graphdef, self.state, tokens[:, t:t + 1], cache)
        jax.block_until_ready(cache)
        times = []
        for t in range(context_len, context_len + steps):
            start = time.perf_counter()
            logits, cache = _step(self.graphdef, self.state, tokens[:, t:t + 1], cache)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def cache_bytes(self, batch_size: int, max_len: int) -> int:
        """Bytes the model's decode cache allocates for [batch_size, max_len] (abstractly)."""
        model = _model(self.graphdef, self.state)
        shapes = jax.eval_shape(lambda: model.init_cache(batch_size, max_len))
        return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))

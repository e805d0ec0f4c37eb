"""A small causal LM with the project's model call signature, for the training tests that must
not depend on the full model: embedding, softmax attention that respects segment ids, an MLP or a
top-1 MoE with a non-trainable router bias, tied output head. Parameters carry logical names."""

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.sharding import constrain


def _param(rngs, shape, names, scale=0.02):
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape), out_sharding=names)


class RouterBias(nnx.Variable):
    """Non-trainable, like the MoE router biases of the real model."""


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, mlp: int, experts: int, *, rngs):
        hd = d // heads
        self.norm1 = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.norm2 = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.wq = _param(rngs, (d, heads, hd), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, (d, heads, hd), ("embed", "heads", "head_dim"))
        self.wv = _param(rngs, (d, heads, hd), ("embed", "heads", "head_dim"))
        self.wo = _param(rngs, (heads, hd, d), ("heads", "head_dim", "embed"))
        self.experts = experts
        if experts:
            self.router = _param(rngs, (d, experts), ("embed", None))
            self.bias = RouterBias(jnp.zeros((experts,)))
            self.w1 = _param(rngs, (experts, d, mlp), ("experts", "embed", "expert_mlp"))
            self.w2 = _param(rngs, (experts, mlp, d), ("experts", "expert_mlp", "embed"))
        else:
            self.w1 = _param(rngs, (d, mlp), ("embed", "mlp"))
            self.w2 = _param(rngs, (mlp, d), ("mlp", "embed"))

    def __call__(self, x, segment_ids):
        T = x.shape[1]
        h = _rms(x) * self.norm1
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, w) for w in (self.wq, self.wk, self.wv))
        s = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        mask = jnp.tril(jnp.ones((T, T), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
        s = jnp.where(mask[:, None], s.astype(jnp.float32), -1e30)
        o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
        x = x + jnp.einsum("bthk,hkd->btd", o, self.wo)
        h = _rms(x) * self.norm2
        if not self.experts:
            return x + jax.nn.gelu(h @ self.w1) @ self.w2, None
        logits = (h @ self.router).astype(jnp.float32)
        choice = jax.nn.one_hot(jnp.argmax(logits + self.bias[...], -1), self.experts)  # [B, T, E]
        gate = jnp.sum(jax.nn.softmax(logits, -1) * choice, -1, keepdims=True)
        y = jnp.einsum("bte,btef->btef", choice.astype(h.dtype), jax.nn.gelu(jnp.einsum("btd,edf->btef", h, self.w1)))
        y = jnp.einsum("btef,efd->btd", y, self.w2)
        load = jnp.mean(choice, axis=(0, 1))
        aux = 0.01 * self.experts * jnp.sum(load * jnp.mean(jax.nn.softmax(logits, -1), axis=(0, 1)))
        return x + gate.astype(y.dtype) * y, (aux, load)


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(x.dtype)


class ToyLM(nnx.Module):
    def __init__(self, vocab: int, d: int = 32, heads: int = 2, layers: int = 2, experts: int = 0, *, rngs):
        self.embed = _param(rngs, (vocab, d), ("vocab", "embed"), scale=d**-0.5)
        self.blocks = nnx.List([Block(d, heads, 2 * d, experts, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))

    def __call__(self, tokens, segment_ids=None, *, return_aux=False):
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        x = self.embed[...][tokens]
        aux_loss, loads = jnp.zeros((), jnp.float32), []
        for block in self.blocks:
            x = constrain(x, ("act_batch", "act_len", "act_embed"))
            x, aux = block(x, segment_ids)
            if aux is not None:
                aux_loss, loads = aux_loss + aux[0], loads + [aux[1]]
        logits = jnp.einsum("btd,vd->btv", _rms(x) * self.norm, self.embed[...]).astype(jnp.float32)
        if not return_aux:
            return logits
        load = jnp.stack(loads) if loads else jnp.zeros((0, 0), jnp.float32)
        return logits, {"aux_loss": aux_loss, "moe_load": load}


def apply_balancing(model, aux, rate: float = 0.01):
    """Aux-loss-free balancing: raise the bias of under-loaded experts."""
    for block, load in zip(model.blocks, aux["moe_load"]):
        block.bias[...] = block.bias[...] + rate * jnp.sign(1.0 / load.shape[0] - load)


def build(config, rngs):
    m = config.model
    return ToyLM(m.vocab_size, m.d_model, m.num_heads, m.num_layers, m.get("num_experts", 0), rngs=rngs)


def toy_config(experts: int = 0, **overrides):
    """base_config() with the toy model on MQAR (L=32, K=2, vocab 64), quick loop settings."""
    from configs import common

    config = common.base_config()
    config.model.vocab_size, config.model.d_model, config.model.num_heads = 64, 32, 2
    config.model.num_layers, config.model.num_experts = 2, experts
    config.data.task_kwargs = dict(seq_len=32, num_kv_pairs=2, vocab_size=64)
    config.data.batch_size, config.data.eval_batches = 8, 2
    config.optim.warmup_steps = 2
    config.total_steps, config.log_every_steps, config.eval_every_steps = 6, 1, 0
    config.checkpoint_every_steps = 3
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def use_one_device(monkeypatch):
    """Make train.py build its mesh over the first device only, for in-process training tests that
    do not test sharding: a program partitioned over the 8 fake CPU devices compiles and runs
    slower."""
    from kimi_jax import sharding

    real = sharding.make_mesh
    monkeypatch.setattr(sharding, "make_mesh",
                        lambda mesh_config, devices=None: real(mesh_config, devices or jax.devices()[:1]))


def use_toy_model(monkeypatch):
    """Make train.py and train_lib build the toy model (and its balancing rule)."""
    from kimi_jax import train_lib

    monkeypatch.setattr(train_lib, "build_model", build)
    monkeypatch.setattr(train_lib, "apply_balancing", apply_balancing)

"""The decoder: embedding (+ learned positions) -> blocks (token mixer + dense MLP or MoE,
pre-norm, plain or block attention residuals) -> final norm -> head (untied, or the embedding
with `tie_embeddings`). Built from a `ModelConfig`.

    model = build_model(config, rngs=nnx.Rngs(0))                 # reads config.model
    logits = model(tokens [B, T])                                 # [B, T, vocab] float32
    logits, aux = model(tokens, return_aux=True)                  # aux: see `AUX_KEYS`
    logits = model(tokens, remat="dots")                          # per-layer checkpointing
    logits = model(tokens, dropout_key=key)                       # training with the config's dropout
    cache = model.init_cache(batch_size, max_len)
    logits, cache = model.decode_step(tokens [B, 1], cache)       # equals the full forward

With `max_position_embeddings` > 0 a learned position table is added to the token embedding
(positions restart at every packed document) and the cache gains a last entry {"pos": []}.
Dropout (`embed_dropout`, softmax attention's `dropout`) applies only to calls given a
`dropout_key` (the train step's); evaluation and decoding are deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.attention import build_mixer
from kimi_jax.attn_res import AttnResRead, make_stream
from kimi_jax.config import ModelConfig
from kimi_jax.ffn import MLP
from kimi_jax.layers import Embed, Linear, RMSNorm, dropout, segment_positions
from kimi_jax.moe import STAT_KEYS, MoE
from kimi_jax.remat import check_policy, checkpointed_block
from kimi_jax.sharding import constrain

# aux keys: aux_loss [] (sum over MoE layers), moe_load [L, E] (fraction of routed pairs per
# expert), moe_max_over_mean [L], moe_load_entropy [L] (normalised to [0, 1]),
# moe_bias_target [L, E] (quantile balancing's next bias; zeros for other methods),
# moe_dropped [L] (tokens dropped by a capacity-limited expert-parallel dispatch; else 0).
# Under gradient accumulation the train step averages them over micro-batches.
AUX_KEYS = ("aux_loss",) + tuple(f"moe_{k}" for k in STAT_KEYS if k != "aux_loss")


class Block(nnx.Module):
    """One decoder layer: mixer and FFN sublayers, each read from the residual stream and
    pre-normed; AttnRes read sites exist when `config.residual == "attn_res"`."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        d, eps = config.d_model, config.norm_eps
        kw = dict(dtype=config.compute_dtype, param_dtype=config.weight_dtype, rngs=rngs)
        name = config.layer_mixers[layer]
        self.layer, self.mixer_name = layer, name
        self.mixer_norm = RMSNorm(d, eps=eps, **kw)
        self.mixer = build_mixer(name, config.settings(name), d, **kw)
        act = dict(activation=config.activation, situ_beta=config.situ_beta,
                   situ_linear_beta=config.situ_linear_beta)
        self.ffn_norm = RMSNorm(d, eps=eps, **kw) if config.ffn else None
        if not config.ffn:  # mixer-only layer
            self.ffn = None
        elif config.is_moe(layer):
            self.ffn = MoE(d, config.moe, norm_eps=eps, **act, **kw)
        else:
            self.ffn = MLP(d, config.dense_hidden, **act, **kw)
        attn_res = config.residual == "attn_res"
        self.mixer_read = AttnResRead(d, eps=eps, **kw) if attn_res else None
        self.ffn_read = AttnResRead(d, eps=eps, **kw) if attn_res else None

    def __call__(self, stream, *, segment_ids=None, cache=None, dropout_key=None):
        """Advance `stream` by this layer; returns (new mixer cache or None, MoE stats or None).
        `dropout_key` reaches a mixer with a dropout rate (softmax attention's `dropout`)."""
        # Named scopes tag every op (forward and backward) for kimi_jax/profile_summary.py.
        with jax.named_scope("attn_res"):
            x = stream.before_mixer(self.mixer_read, self.layer)
        with jax.named_scope(f"mixer_{self.mixer_name}"):
            x = self.mixer_norm(x)
            if cache is None:
                rate = getattr(getattr(self.mixer, "config", None), "dropout", 0)
                drop = {"dropout_key": dropout_key} if dropout_key is not None and rate else {}
                y, cache = self.mixer(x, segment_ids=segment_ids, **drop), None
            else:
                y, cache = self.mixer.decode(x, cache)
        stream.add(y)
        if self.ffn is None:
            return cache, None
        with jax.named_scope("attn_res"):
            x = stream.before_ffn(self.ffn_read)
        moe = isinstance(self.ffn, MoE)
        with jax.named_scope("ffn_moe" if moe else "ffn_mlp"):
            y, stats = self.ffn(self.ffn_norm(x)) if moe else (self.ffn(self.ffn_norm(x)), None)
        stream.add(y)
        return cache, stats


class Model(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d = config.d_model
        kw = dict(dtype=config.compute_dtype, param_dtype=config.weight_dtype, rngs=rngs)
        # A tied table is also the output projection, so it starts small (init_std), not at 1: logits
        # of std about sqrt(d) * init_std against the unit-RMS final hidden state.
        self.embed = Embed(config.vocab_size, d, init_std=config.init_std if config.tie_embeddings else 1.0, **kw)
        n_pos = config.max_position_embeddings
        self.pos_embed = Embed(n_pos, d, axes=(None, "embed"), **kw) if n_pos else None
        self.blocks = nnx.List([Block(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.final_read = (AttnResRead(d, eps=config.norm_eps, **kw)
                           if config.residual == "attn_res" else None)
        self.norm = RMSNorm(d, eps=config.norm_eps, **kw)
        self.head = None if config.tie_embeddings else Linear(d, config.vocab_size, axes=("embed", "vocab"), **kw)

    def __call__(self, tokens, segment_ids=None, *, return_aux: bool = False, remat: str = "none",
                 dropout_key=None):
        """tokens [B, T] int -> logits [B, T, vocab] float32 (and aux with return_aux); `remat`
        checkpoints every block: a policy of `kimi_jax.remat.POLICIES`, optionally followed by
        per-mixer overrides ("dots16/mla=dots_all"). `dropout_key` (a PRNG key; training) turns on
        the config's dropout: the embedding's with key fold 0, layer i's mixer with fold i + 1."""
        self._check_tokens(tokens)
        check_policy(remat)
        positions = None
        if self.pos_embed is not None:
            B, T = tokens.shape
            if T > self.pos_embed.vocab_size:
                raise ValueError(f"tokens have T={T} positions; the learned position table has "
                                 f"max_position_embeddings={self.pos_embed.vocab_size}")
            positions = segment_positions(segment_ids, T, B)
        keys = [None] * (len(self.blocks) + 1) if dropout_key is None else \
            [jax.random.fold_in(dropout_key, i) for i in range(len(self.blocks) + 1)]
        stream = self._stream(tokens, positions, keys[0])
        stats = [checkpointed_block(block, stream, remat, segment_ids=segment_ids, dropout_key=key)
                 for block, key in zip(self.blocks, keys[1:])]
        logits = self._logits(stream)
        return (logits, collect_aux(stats)) if return_aux else logits

    def init_cache(self, batch_size: int, max_len: int):
        """Per-layer mixer caches (a list, one entry per layer; with learned positions a last
        entry {"pos": [] int32} counts the tokens decoded so far)."""
        if self.pos_embed is not None and max_len > self.pos_embed.vocab_size:
            raise ValueError(f"max_len={max_len} exceeds the learned position table "
                             f"(max_position_embeddings={self.pos_embed.vocab_size})")
        cache = [block.mixer.init_cache(batch_size, max_len) for block in self.blocks]
        return cache + [{"pos": jnp.zeros((), jnp.int32)}] if self.pos_embed is not None else cache

    def decode_step(self, tokens, cache):
        """tokens [B, 1] -> (logits [B, 1, vocab] float32, cache)."""
        self._check_tokens(tokens)
        if tokens.shape[1] != 1:
            raise ValueError(f"decode_step takes one token per row, tokens [B, 1]; got {tokens.shape}")
        learned = self.pos_embed is not None
        if len(cache) != len(self.blocks) + learned:
            raise ValueError(f"cache has {len(cache)} entries; the model needs {len(self.blocks) + learned} "
                             f"(one per layer{', then the position' if learned else ''}): build it with init_cache")
        positions = None
        if learned:  # init_cache keeps max_len within the table; a lookup past it gives NaN (jnp.take)
            positions = jnp.broadcast_to(cache[-1]["pos"], tokens.shape)
        stream = self._stream(tokens, positions)
        new_cache = [block(stream, cache=c)[0] for block, c in zip(self.blocks, cache)]
        if learned:
            new_cache.append({"pos": cache[-1]["pos"] + 1})
        return self._logits(stream), new_cache

    def moe_layers(self) -> list[MoE]:
        """MoE layers in layer order (the order of aux's per-layer statistics)."""
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def _check_tokens(self, tokens):
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be [B, T] integers; got shape {tokens.shape}, "
                             f"dtype {tokens.dtype}")

    def _stream(self, tokens, positions=None, dropout_key=None):
        with jax.named_scope("embed"):
            h = self.embed(tokens)
            if positions is not None:
                h = h + self.pos_embed(positions)
            h = dropout(h, self.config.embed_dropout, dropout_key)
            h = constrain(h, ("act_batch", "act_len", "act_embed"))
        return make_stream(self.config.residual, h, self.config.attn_res_block_size)

    def _logits(self, stream):
        with jax.named_scope("attn_res"):
            h = stream.final(self.final_read)
        with jax.named_scope("head"):
            h = self.norm(h)
            logits = (self.embed.attend(h) if self.head is None else self.head(h)).astype(jnp.float32)
            return constrain(logits, ("act_batch", "act_len", "act_vocab"))


def collect_aux(stats) -> dict:
    """Stack per-MoE-layer statistics into the aux dict (`AUX_KEYS`)."""
    stats = [s for s in stats if s is not None]
    if not stats:
        aux = {f"moe_{k}": jnp.zeros((0, 0) if k in ("load", "bias_target") else (0,), jnp.float32)
               for k in STAT_KEYS if k != "aux_loss"}
        aux["aux_loss"] = jnp.zeros((), jnp.float32)
        return aux
    aux = {f"moe_{k}": jnp.stack([s[k] for s in stats]) for k in STAT_KEYS if k != "aux_loss"}
    aux["aux_loss"] = sum(s["aux_loss"] for s in stats)
    return aux


def build_model(config, *, rngs: nnx.Rngs) -> Model:
    """Model from the full config (reads `config.model`), a ConfigDict/dict, or a ModelConfig."""
    if not isinstance(config, ModelConfig):
        model_cfg = config["model"] if "model" in config else config
        config = ModelConfig.from_config_dict(model_cfg)
    return Model(config, rngs=rngs)

"""Training dropout (Zoology's attention: 0.1 on the embedding and on the attention probabilities):
only calls given a dropout key drop anything, the masks are those of `jax.random.bernoulli` under
the documented key folds, the train step draws them from (seed, step), and the MQAR sweep's
`dropout=` form reaches the model under its own trial names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model_presets import ablation_config
from configs.sweeps import mqar
from kimi_jax import build_model, data, optim, train_lib
from kimi_jax.attention.common import blocked_xla_attention, causal_mask, xla_attention
from kimi_jax.attention.core import attention
from kimi_jax.config import ModelConfig
from kimi_jax.layers import dropout
from tests.test_mqar_sweep_lr import _trials

ARG = "d_model=32,num_layers=2,vocab_size=64,rope=False,ffn=False,learned_positions=16"


def _model(rate):
    return build_model(ablation_config("softmax", ARG + f",dropout={rate}"), rngs=nnx.Rngs(0))


def _tokens(shape=(2, 16), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, 64, dtype=jnp.int32)


def test_dropout_masks_and_scales():
    x = jnp.ones((64, 256))
    key = jax.random.key(3)
    y = dropout(x, 0.25, key)
    keep = np.asarray(jax.random.bernoulli(key, 0.75, x.shape))
    np.testing.assert_array_equal(np.asarray(y), np.where(keep, np.float32(1) / np.float32(0.75), 0).astype(np.float32))
    assert abs(keep.mean() - 0.75) < 0.01
    assert dropout(x, 0.25, None) is x and dropout(x, 0.0, key) is x


def test_only_calls_with_a_key_drop():
    """No key: the dropout model equals the same weights without dropout (evaluation, decoding);
    with a key the logits change, and the same key gives the same logits."""
    tokens = _tokens()
    plain, dropped = _model(0.0), _model(0.3)
    base = plain(tokens)
    np.testing.assert_array_equal(np.asarray(dropped(tokens)), np.asarray(base))
    key = jax.random.key(1)
    a, b = dropped(tokens, dropout_key=key), dropped(tokens, dropout_key=key)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(a - base))) > 1e-3
    assert float(jnp.max(jnp.abs(dropped(tokens, dropout_key=jax.random.key(2)) - a))) > 1e-3
    np.testing.assert_array_equal(np.asarray(plain(tokens, dropout_key=key)), np.asarray(base))  # rates 0


def test_embedding_and_attention_dropout_follow_the_key_folds(monkeypatch):
    """The embedding (with positions) is dropped at embed_dropout with fold 0 of the key, and
    layer i's attention gets fold i + 1; without a key neither is drawn."""
    from kimi_jax import model as model_mod

    cfg = ablation_config("softmax", ARG + ",dropout=0.2")
    cfg.model.embed_dropout = 0.5
    model = build_model(cfg, rngs=nnx.Rngs(0))
    assert ModelConfig.from_config_dict(cfg.model).embed_dropout == 0.5
    tokens, key = _tokens(), jax.random.key(7)
    embed_calls, mixer_keys = [], []
    monkeypatch.setattr(model_mod, "dropout", lambda x, rate, k: embed_calls.append((x, rate, k)) or dropout(x, rate, k))
    real = type(model.blocks[0].mixer).__call__
    monkeypatch.setattr(type(model.blocks[0].mixer), "__call__",
                        lambda self, x, **kw: mixer_keys.append(kw.get("dropout_key")) or real(self, x, **kw))
    model(tokens, dropout_key=key)
    (x, rate, k0), = embed_calls
    h = model.embed(tokens) + model.pos_embed(jnp.broadcast_to(jnp.arange(16), tokens.shape))
    np.testing.assert_allclose(np.asarray(x), np.asarray(h), rtol=1e-6)
    data_of = lambda k: np.asarray(jax.random.key_data(k))  # noqa: E731
    assert rate == 0.5 and np.array_equal(data_of(k0), data_of(jax.random.fold_in(key, 0)))
    assert len(mixer_keys) == 2
    for i, k in enumerate(mixer_keys):
        assert np.array_equal(data_of(k), data_of(jax.random.fold_in(key, i + 1)))
    model(tokens)
    assert embed_calls[-1][2] is None and mixer_keys[-1] is None


def test_attention_dropout_on_the_probabilities():
    """xla_attention drops probabilities with bernoulli(key) and rescales; the blocked path draws
    each query block's mask from the key folded with the block; cuDNN refuses dropout."""
    k = jax.random.split(jax.random.key(0), 3)
    B, T, H, D = 1, 8, 2, 4
    q, kk, v = (jax.random.normal(x, (B, T, H, D)) for x in k)
    mask, key = causal_mask(None, T, B), jax.random.key(5)
    got = xla_attention(q, kk, v, mask, 0.5, dropout=(0.5, key))
    logits = jnp.einsum("bthd,bshd->bhts", q, kk) * 0.5
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)  # [B, H, T, S] as [B, G, 1, T, S]
    keep = jax.random.bernoulli(key, 0.5, (B, H, 1, T, T)).reshape(B, H, T, T)
    want = jnp.einsum("bhts,bshd->bthd", jnp.where(keep, p / 0.5, 0), v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    blocked = blocked_xla_attention(q, kk, v, None, 0.5, block=4, dropout=(0.5, key))
    for i in range(2):
        rows = slice(4 * i, 4 * i + 4)
        one = xla_attention(q[:, rows], kk, v, mask[..., rows, :], 0.5, dropout=(0.5, jax.random.fold_in(key, i)))
        np.testing.assert_allclose(np.asarray(blocked[:, rows]), np.asarray(one), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(attention(q, kk, v, scale=0.5, impl="xla", dropout=(0.5, key))),
                               np.asarray(blocked_xla_attention(q, kk, v, None, 0.5, dropout=(0.5, key))), rtol=1e-6)
    with pytest.raises(ValueError, match="cudnn"):
        attention(q, kk, v, scale=0.5, impl="cudnn", dropout=(0.5, key))


def test_train_step_draws_dropout_from_seed_and_step():
    """A dropout config trains (finite loss) with masks from (seed, step): the same step twice gives
    the same loss, another step or no dropout another one; configs without dropout pass no key."""
    cfg = ablation_config("softmax", ARG + ",dropout=0.3")
    cfg.data.task = "mqar"
    cfg.data.task_kwargs = dict(seq_len=16, num_kv_pairs=2, vocab_size=64)
    cfg.data.batch_size, cfg.total_steps = 4, 2
    assert train_lib.has_dropout(cfg) and not train_lib.has_dropout(ablation_config("softmax", ARG))
    batch = {k: jnp.asarray(v) for k, v in next(data.make_iterator(cfg, "train")).items()}

    def loss_at(config, step):
        graphdef, params, _ = train_lib.abstract_model(config)
        tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
        state = jax.jit(train_lib.make_init(config, tx))()
        _, m = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule))(state, batch, jnp.int32(step))
        return float(m["loss"])

    a, b, c = loss_at(cfg, 1), loss_at(cfg, 1), loss_at(cfg, 2)
    cfg_plain = ablation_config("softmax", ARG)
    cfg_plain.data = cfg.data
    d = loss_at(cfg_plain, 1)
    assert np.isfinite(a) and a == b and a != c and a != d
    cfg.optim.grad_accum_steps = 2  # micro-batch i draws from the step's key folded with i
    e = loss_at(cfg, 1)
    assert np.isfinite(e) and e == loss_at(cfg, 1) and abs(e - a) > 1e-6


def test_config_checks_and_sweep_form():
    with pytest.raises(ValueError, match="embed_dropout"):
        cfg = ablation_config("softmax", ARG)
        cfg.model.embed_dropout = 1.0
        ModelConfig.from_config_dict(cfg.model)
    with pytest.raises(ValueError, match="dropout"):
        build_model(ablation_config("softmax", ARG + ",dropout=-0.1"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropout=1.5"):
        mqar.get_config("gpu_long,dropout=1.5")
    plain = _trials("gpu_long,mixers=softmax,settings=512x64,widths=64,rope=False,learned_pos=True,mlp=False")
    drop = _trials("gpu_long,mixers=softmax,settings=512x64,widths=64,rope=False,learned_pos=True,mlp=False,"
                   "dropout=0.1")
    assert len(drop) == len(plain) == 1 and drop[0].name != plain[0].name
    model = mqar.get_config(drop[0].config.split(":", 1)[1]).model
    assert model.embed_dropout == 0.1 and model.mixers.softmax.dropout == 0.1
    assert mqar.get_config(plain[0].config.split(":", 1)[1]).model.embed_dropout == 0.0


def test_dropout_masks_do_not_depend_on_the_mesh():
    """Two train steps with dropout give one device's loss and parameters on 8 devices, data- and
    FSDP/tensor-sharded: the masks are drawn for the global arrays, not per shard."""
    from kimi_jax import sharding
    from tests.test_sharding import _step, assert_matches

    cfg = ablation_config("softmax", ARG + ",dropout=0.3")
    cfg.data.task = "mqar"
    cfg.data.task_kwargs = dict(seq_len=16, num_kv_pairs=2, vocab_size=64)
    cfg.data.batch_size, cfg.total_steps, cfg.optim.lr = 8, 2, 1e-2
    batch = next(data.make_iterator(cfg, "train"))
    ref_state, ref = _step(cfg, sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]), batch)
    for shape in ({"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}):
        state, metrics = _step(cfg, sharding.make_mesh(shape), batch)
        assert_matches(state, metrics, ref_state, ref, str(shape))


def test_rematerialised_blocks_redraw_the_same_masks():
    """Under a remat policy the recomputed forward draws the same masks: loss and gradients equal
    the policy-free ones for one key."""
    cfg = ablation_config("softmax", ARG.replace("ffn=False", "ffn=True") + ",dropout=0.3")
    graphdef, state = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)))
    tokens, key = _tokens(), jax.random.key(3)

    def loss(state, remat):
        return jnp.sum(nnx.merge(graphdef, state)(tokens, remat=remat, dropout_key=key) ** 2)

    (la, ga), (lb, gb) = (jax.value_and_grad(loss)(state, r) for r in ("none", "dots"))
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)

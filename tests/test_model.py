"""Model assembly: decode equals the full forward, attention residuals, logical axes on every
parameter, the aux dict, greedy generation, and clear errors for invalid configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from configs.model_presets import ABLATION_MIXERS, ablation_config
from kimi_jax import build_model, flops
from kimi_jax.attn_res import AttnResRead, BlockAttnResStream
from kimi_jax.config import ModelConfig
from kimi_jax.generate import generate, stepwise_logits
from kimi_jax.model import AUX_KEYS
from kimi_jax.sharding import LOGICAL_AXIS_RULES

LOGICAL_NAMES = {name for name, _ in LOGICAL_AXIS_RULES if not name.startswith("act_")}


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(tiny.get_config(), rngs=nnx.Rngs(0))


# One compiled forward (with aux) shared by the tests of the tiny model.
forward = nnx.jit(lambda m, t: m(t, return_aux=True))


def _tokens(vocab, shape=(2, 12), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def test_tiny_hybrid_decode_equals_forward(tiny_model):
    cfg = tiny_model.config
    assert cfg.layer_mixers == ("kda", "kda", "kda", "mla")
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, True, True]
    tokens = _tokens(cfg.vocab_size)
    full, _ = forward(tiny_model, tokens)
    steps = stepwise_logits(tiny_model, tokens)
    assert full.shape == (2, 12, cfg.vocab_size) and full.dtype == jnp.float32
    np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mixer", [m for m in ABLATION_MIXERS if m != "hybrid"])
def test_single_mixer_ablation_decode_equals_forward(mixer):
    config = ablation_config(mixer, "d_model=32,num_layers=1,vocab_size=64")
    model = build_model(config, rngs=nnx.Rngs(1))
    assert set(model.config.layer_mixers) == {mixer}
    tokens = _tokens(64, (2, 7), seed=3)
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    np.testing.assert_allclose(stepwise_logits(model, tokens), full, rtol=1e-4, atol=1e-4)


def test_packed_documents_do_not_see_each_other(tiny_model):
    """Row 0 packs [a, b], row 1 packs [b, a]: each document's logits match across rows."""
    a, b = _tokens(tiny_model.config.vocab_size, (1, 5), 4)[0], _tokens(256, (1, 7), 5)[0]
    tokens = jnp.stack([jnp.concatenate([a, b]), jnp.concatenate([b, a])])
    segments = jnp.array([[0] * 5 + [1] * 7, [0] * 7 + [1] * 5])
    logits = nnx.jit(lambda m, t, s: m(t, segment_ids=s))(tiny_model, tokens, segments)
    np.testing.assert_allclose(logits[0, 5:], logits[1, :7], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[0, :5], logits[1, 7:], rtol=1e-4, atol=1e-4)


def test_generate_is_greedy_on_the_full_forward(tiny_model):
    prompt = _tokens(tiny_model.config.vocab_size, (2, 8), seed=1)
    out = generate(tiny_model, prompt, 4)
    assert out.shape == (2, 12) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :8], prompt)
    logits, _ = forward(tiny_model, out)
    np.testing.assert_array_equal(out[:, 8:], jnp.argmax(logits[:, 7:-1], axis=-1))
    with pytest.raises(ValueError, match="prompt must be"):
        generate(tiny_model, prompt[0], 2)


def test_aux_has_the_documented_keys(tiny_model):
    cfg = tiny_model.config
    logits, aux = forward(tiny_model, _tokens(cfg.vocab_size))
    assert set(aux) == set(AUX_KEYS) >= {"aux_loss", "moe_load"}
    E = cfg.moe.num_experts
    assert aux["moe_load"].shape == (3, E) and aux["moe_bias_target"].shape == (3, E)
    assert aux["moe_max_over_mean"].shape == (3,) and aux["aux_loss"].shape == ()
    np.testing.assert_allclose(aux["moe_load"].sum(axis=1), 1.0, rtol=1e-6)
    dense = build_model(ablation_config("kda", "d_model=32,num_layers=1,vocab_size=16"),
                        rngs=nnx.Rngs(0))
    _, aux = forward(dense, _tokens(16, (1, 3)))
    assert aux["moe_load"].shape == (0, 0) and float(aux["aux_loss"]) == 0.0


def test_every_parameter_has_logical_axes(tiny_model):
    params = nnx.to_flat_state(nnx.state(tiny_model, nnx.Param))
    assert len(params) > 50
    for path, var in params:
        names = var.get_metadata().get("out_sharding")
        assert names is not None and len(names) == var.get_value().ndim, (path, names)
        assert set(names) <= LOGICAL_NAMES, (path, names)


def test_attn_res_zero_query_is_the_uniform_average():
    read = AttnResRead(8, rngs=nnx.Rngs(0))
    sources = [jax.random.normal(jax.random.key(i), (2, 3, 8)) * (i + 1) for i in range(4)]
    np.testing.assert_allclose(read(sources), sum(sources) / 4, rtol=1e-5, atol=1e-6)
    # A non-zero query: softmax over <w, rmsnorm(v_s)> with unnormalised values.
    read.query[...] = jnp.linspace(-1, 1, 8)
    v = np.stack([np.asarray(s, np.float64) for s in sources])
    kn = v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-5)
    logits = kn @ np.linspace(-1, 1, 8)
    p = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
    np.testing.assert_allclose(read(sources), (p[..., None] * v).sum(0), rtol=1e-5, atol=1e-5)


def test_block_stream_follows_the_k3_schedule():
    """Sources seen by the reads of a block size 2 stream over 5 layers (K3 §2.6)."""
    seen = []
    stream = BlockAttnResStream(jnp.zeros(1), block_size=2)
    record = lambda sources: seen.append(len(sources)) or sources[-1]
    for layer in range(5):
        stream.before_mixer(record, layer)
        stream.add(jnp.ones(1))
        stream.before_ffn(record)
        stream.add(jnp.ones(1))
    stream.final(record)
    # Layer 0's mixer takes the embedding directly; blocks are pushed at layers 0, 2, 4. The
    # mixer read of layer l >= 1 sees 2 + (l-1)//2 sources, the FFN read 2 + l//2.
    assert seen == [2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    cfg = ModelConfig.from_config_dict(_model_dict(num_layers=5))
    assert flops.attn_res_sources(cfg) == seen


def test_bf16_compute_with_float32_params_runs():
    config = tiny.get_config()
    config.model.dtype = "bfloat16"
    model = build_model(config, rngs=nnx.Rngs(0))
    assert model.blocks[1].ffn.experts.gate[...].dtype == jnp.float32
    logits, _ = forward(model, _tokens(config.model.vocab_size))
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def _model_dict(**changes):
    model = tiny.get_config().model.to_dict()
    model.update(changes)
    return model


def test_invalid_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"Unknown mixer='mamba'; expected one of .*kda"):
        ModelConfig.from_config_dict(_model_dict(mixer_pattern=("kda", "mamba")))
    with pytest.raises(ValueError, match="longer than num_layers=4"):
        ModelConfig.from_config_dict(_model_dict(mixer_pattern=("kda",) * 5))
    with pytest.raises(ValueError, match="num_heads=3 must divide d_model=64"):
        ModelConfig.from_config_dict(_model_dict(
            mixer_pattern=("linear",), mixers={"linear": {"num_heads": 3}}))
    with pytest.raises(ValueError, match="num_heads=3 must divide d_model=64"):
        ablation_config("softmax", "d_model=64,num_heads=3")
    with pytest.raises(ValueError, match=r"Unknown config.model key\(s\) \['d_modle'\]"):
        ModelConfig.from_config_dict(_model_dict(d_modle=3))
    with pytest.raises(ValueError, match="Unknown residual='sum'"):
        ModelConfig.from_config_dict(_model_dict(residual="sum"))
    with pytest.raises(ValueError, match="Unknown activation='gelu'"):
        ModelConfig.from_config_dict(_model_dict(activation="gelu"))
    with pytest.raises(ValueError, match="Unknown settings"):
        ModelConfig.from_config_dict(_model_dict(mixers={"kda": {"heads": 2}, "mla": {}}))
    with pytest.raises(ValueError, match="no settings for \\['mla'\\]"):
        ModelConfig.from_config_dict(_model_dict(mixers={"kda": {}}))
    with pytest.raises(ValueError, match="tokens must be"):
        build_model(tiny.get_config(), rngs=nnx.Rngs(0))(jnp.zeros((2, 3)))


def test_mixer_only_layers_without_ffn():
    """ffn=False (Zoology's MQAR models): no FFN parameters, its FLOPs dropped, decode still
    equals the forward, and the output differs from the same model with its MLP."""
    plain = ablation_config("softmax", "d_model=32,num_layers=2,vocab_size=64,rope=False")
    bare = ablation_config("softmax", "d_model=32,num_layers=2,vocab_size=64,rope=False,ffn=False")
    m_plain, m_bare = build_model(plain, rngs=nnx.Rngs(0)), build_model(bare, rngs=nnx.Rngs(0))
    assert all(b.ffn is None and b.ffn_norm is None for b in m_bare.blocks)
    n = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n(m_plain) - n(m_bare) == 2 * (3 * 32 * 64 + 32)  # SwiGLU 32 -> 64 -> 32 and its norm
    c_plain, c_bare = m_plain.config, m_bare.config
    assert c_bare.settings("softmax")["rope_theta"] is None
    assert flops.forward_flops_per_token(c_plain, 16) - flops.forward_flops_per_token(c_bare, 16) == 2 * 6 * 32 * 64
    tokens = _tokens(64)
    full = m_bare(tokens)
    np.testing.assert_allclose(stepwise_logits(m_bare, tokens), full, rtol=1e-4, atol=1e-4)
    assert not np.allclose(full, m_plain(tokens), atol=1e-3)


def test_mixer_only_layers_need_plain_residuals_and_no_moe():
    with pytest.raises(ValueError, match="ffn=False .* needs moe None and residual 'plain'"):
        ModelConfig.from_config_dict(_model_dict(ffn=False, residual="attn_res"))
    with pytest.raises(ValueError, match="ffn must be True or False"):
        ModelConfig.from_config_dict(_model_dict(ffn="no"))

"""Token mixers through the registry: shapes and dtypes, decode = forward, packed documents,
logical axes on every parameter, parameter counts, clear errors, byte and FLOP accounting,
MLA's absorbed decode, and the chunked kernel inside the layers."""

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.testing import assert_close
from kimi_jax.attention import MIXERS, build_mixer, mixer_config
from kimi_jax.sharding import LOGICAL_AXIS_RULES

D = 32
SETTINGS = {
    "softmax": dict(num_heads=4, num_kv_heads=2, head_dim=None),
    "linear": dict(num_heads=2, head_dim=None, impl="naive"),
    "deltanet": dict(num_heads=2, head_dim=None, impl="naive"),
    "gated_deltanet": dict(num_heads=2, head_dim=None, impl="naive"),
    "kda": dict(num_heads=2, head_dim=8, head_v_dim=12, impl="naive"),
    "kda_k3": dict(num_heads=2, head_dim=16, use_full_rank_gate=True, lower_bound=-5.0, impl="naive"),
    "mla": dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12),
    "mla_rope": dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                     rope_theta=100.0, output_gate=False),
}
CASES = sorted(SETTINGS)


def _build(case, dtype=jnp.float32, seed=0, **extra):
    """Built once per arguments (eager init compiles per parameter shape); tests do not mutate them."""
    return _build_cached(case, jnp.dtype(dtype), seed, tuple(sorted(extra.items())))


@functools.cache
def _build_cached(case, dtype, seed, extra):
    name = case.split("_k3")[0].replace("mla_rope", "mla")
    settings = {**SETTINGS[case], **dict(extra)}
    return build_mixer(name, settings, D, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))


def _x(B, T, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_shapes_and_dtypes(case, dtype):
    m = _build(case, dtype)
    y = m(_x(2, 4).astype(dtype))
    assert y.shape == (2, 4, D) and y.dtype == dtype
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    for p in jax.tree.leaves(nnx.state(m, nnx.Param)):
        assert p.dtype == jnp.float32


@pytest.mark.parametrize("case", CASES)
def test_decode_equals_forward(case):
    m = _build(case)
    x = _x(2, 7)
    full = m(x)
    cache = m.init_cache(2, 9)
    step = jax.jit(lambda mdl, xt, c: mdl.decode(xt, c))
    outs = []
    for t in range(7):
        y, cache = step(m, x[:, t : t + 1], cache)
        outs.append(y)
    assert_close(f"{case} decode", full, jnp.concatenate(outs, 1), 1e-5)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_do_not_interact(case):
    m = _build(case)
    lengths = (3, 5, 1)
    x = _x(1, sum(lengths), seed=2)
    seg = jnp.asarray([np.repeat(np.arange(3) + 7, lengths)], jnp.int32)
    packed = m(x, segment_ids=seg)
    # each document alone, one per row, right-padded with other tokens (causal: padding is unseen)
    starts = np.cumsum((0,) + lengths[:-1])
    alone = m(jnp.concatenate([jnp.roll(x, -int(s), axis=1)[:, : max(lengths)] for s in starts]))
    for i, (s, n) in enumerate(zip(starts, lengths)):
        assert_close(f"{case} doc@{s}", alone[i : i + 1, :n], packed[:, s : s + n], 1e-5)


ALLOWED_AXES = {n for n, _ in LOGICAL_AXIS_RULES if not n.startswith("act_")}


@pytest.mark.parametrize("case", CASES)
def test_every_param_has_logical_axes_and_count_matches(case):
    m = _build(case)
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        names = var.get_metadata().get("out_sharding")
        assert names is not None and len(names) == var[...].ndim, (path, names)
        assert set(names) <= ALLOWED_AXES, (path, names)
        total += var[...].size
    name = "kda" if case.startswith("kda") else "mla" if case.startswith("mla") else case
    assert mixer_config(name, SETTINGS[case]).num_params(D) == total


def test_invalid_settings_raise_clear_errors():
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Unknown mixer 'mamba'.*expected one of"):
        build_mixer("mamba", {}, D, **kw)
    with pytest.raises(ValueError, match=r"Unknown settings \['num_head'\].*num_heads"):
        build_mixer("kda", {"num_head": 2}, D, **kw)
    with pytest.raises(ValueError, match="must divide d_model"):
        build_mixer("softmax", {"num_heads": 5, "head_dim": None}, D, **kw)
    with pytest.raises(ValueError, match="must divide d_model"):
        build_mixer("gated_deltanet", {"num_heads": 3, "head_dim": None}, D, **kw)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        mixer_config("softmax", {"num_heads": 4, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="Unknown SoftmaxConfig.impl"):
        mixer_config("softmax", {"impl": "flash"})
    with pytest.raises(ValueError, match="Unknown KDAConfig.impl"):
        mixer_config("kda", {"impl": "fast"})
    with pytest.raises(ValueError, match="lower_bound"):
        mixer_config("kda", {"lower_bound": 1.0})
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        mixer_config("mla", {"rope_theta": 10000.0})
    with pytest.raises(ValueError, match="positive int"):
        mixer_config("mla", {"kv_lora_rank": 0})
    with pytest.raises(ValueError, match="cache_dtype"):
        mixer_config("mla", {"cache_dtype": "int8"})
    with pytest.raises(ValueError, match="d_model"):
        build_mixer("softmax", {}, 0, **kw)
    with pytest.raises(ValueError, match="explicit head_dim"):
        mixer_config("softmax", {}).cache_bytes_per_token()
    with pytest.raises(ValueError, match="explicit head_dim"):
        mixer_config("kda", {}).state_bytes()
    if jax.devices()[0].platform != "gpu":
        m = build_mixer("softmax", {"num_heads": 4, "impl": "cudnn"}, D, **kw)
        with pytest.raises(ValueError, match="impl='cudnn' needs a GPU"):
            m(_x(1, 3))
    m = _build("softmax")
    cache = m.init_cache(1, 1)
    _, cache = m.decode(_x(1, 1), cache)
    with pytest.raises(ValueError, match="cache is full"):
        m.decode(_x(1, 1), cache)
    with pytest.raises(ValueError, match="one token"):
        _build("kda").decode(_x(1, 2), _build("kda").init_cache(1, 2))


def _cache_nbytes(cache):
    return sum(v.nbytes for v in jax.tree.leaves(cache))


def test_cache_and_state_bytes_match_hand_counts():
    sm = mixer_config("softmax", dict(num_heads=4, num_kv_heads=2, head_dim=8))
    assert sm.cache_bytes_per_token() == 2 * 2 * 8 * 2 and sm.state_bytes() == 0
    mla = mixer_config("mla", SETTINGS["mla"])
    assert mla.cache_bytes_per_token() == (16 + 4) * 2 and mla.state_bytes() == 0
    kda = mixer_config("kda", SETTINGS["kda"])  # H=2, K=8, V=12, W=4
    assert kda.cache_bytes_per_token() == 0
    assert kda.state_bytes() == 2 * 8 * 12 * 4 + 3 * (2 * 2 * 8 + 2 * 12) * 2
    la = mixer_config("linear", dict(num_heads=2, head_dim=16, conv_size=0))
    assert la.state_bytes() == 2 * 16 * 16 * 4
    # with an explicit cache dtype the accounting equals the arrays init_cache makes
    for name, s in (("softmax", dict(num_heads=4, num_kv_heads=2, head_dim=8)), ("mla", SETTINGS["mla"])):
        cfg = mixer_config(name, {**s, "cache_dtype": "float32"})
        m = build_mixer(name, {**s, "cache_dtype": "float32"}, D, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                        rngs=nnx.Rngs(0))
        grow = _cache_nbytes(m.init_cache(3, 11)) - _cache_nbytes(m.init_cache(3, 10))
        assert grow == 3 * cfg.cache_bytes_per_token()
    s = {**SETTINGS["kda"], "cache_dtype": "bfloat16"}
    m = build_mixer("kda", s, D, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert _cache_nbytes(m.init_cache(3, 10)) == 3 * mixer_config("kda", s).state_bytes()


def test_k3_layer_sizes_match_the_release():
    """K3 (d=7168): KDA 443.74M and MLA 232.20M params per layer; 24 MLA layers cache 27,648 B/token;
    69 KDA layers hold 414 MiB of float32 state per sequence."""
    d = 7168
    kda = mixer_config("kda", dict(num_heads=96, head_dim=128, use_full_rank_gate=True, lower_bound=-5.0))
    mla = mixer_config("mla", dict(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                   qk_rope_head_dim=64, v_head_dim=128))
    assert round(kda.num_params(d) / 1e6, 2) == 443.74
    assert round(mla.num_params(d) / 1e6, 2) == 232.20
    assert 24 * mla.cache_bytes_per_token() == 27_648
    assert 69 * 96 * 128 * 128 * 4 == 69 * (kda.state_bytes() - 3 * (3 * 96 * 128) * 2)


def test_flops_per_token_hand_counts():
    sm = mixer_config("softmax", dict(num_heads=4, num_kv_heads=2, head_dim=8))
    proj = 32 * 4 * 8 * 2 + 32 * 2 * 8 * 2  # q, o + k, v
    assert sm.flops_per_token(32, 100) == 2 * proj + 4 * 4 * 8 * 50
    mla = mixer_config("mla", dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8, output_gate=False))
    proj = 32 * 2 * 12 + 32 * 20 + 16 * 2 * 16 + 2 * 8 * 32
    assert mla.flops_per_token(32, 10) == 2 * proj + 2 * 2 * (12 + 8) * 5
    la = mixer_config("linear", dict(num_heads=2, head_dim=8, conv_size=0, output_gate=False))
    proj = 3 * 32 * 16 + 16 * 32
    assert la.flops_per_token(32, 1000) == 2 * proj + 2 * (2 * 64 * 8 * 2 + 4 * 8 * 8)
    dn = mixer_config("deltanet", dict(num_heads=2, head_dim=8, conv_size=4, output_gate=False))
    rec = 6 * 16 * 8 + 4 * 16 * 8 + 6 * 64 + 16 * 16 / 3  # chunk = min(64, seq_len=16)
    assert dn.flops_per_token(32, 16) == pytest.approx(2 * (proj + 32 * 2) + 2 * 4 * 48 + 2 * rec)


def test_mla_absorbed_decode_equals_naive_latent_path():
    m = _build("mla")
    x = _x(2, 6, seed=3)
    c1 = c2 = m.init_cache(2, 6)
    step = jax.jit(lambda mdl, xt, c, absorb: mdl.decode(xt, c, absorb=absorb), static_argnums=3)
    for t in range(6):
        y1, c1 = step(m, x[:, t : t + 1], c1, True)
        y2, c2 = step(m, x[:, t : t + 1], c2, False)
        assert_close(f"absorbed step {t}", y2, y1, 1e-5)
    assert set(c1) == {"ckv", "kpe", "pos"} and c1["ckv"].shape == (2, 6, 16)


def test_bf16_decode_tracks_forward():
    """In bf16 the step path equals the forward, and both stay near the float32 model."""
    x = _x(1, 5)
    for case in ("kda", "mla"):
        m = _build(case, jnp.bfloat16)
        ref = _build(case)(x)
        full = m(x.astype(jnp.bfloat16))
        cache = m.init_cache(1, 5)
        assert jax.tree.leaves(cache)[0].dtype == jnp.bfloat16
        assert case != "kda" or cache["state"].dtype == jnp.float32
        outs, step = [], jax.jit(lambda mdl, xt, c: mdl.decode(xt, c))
        for t in range(5):
            y, cache = step(m, x[:, t : t + 1].astype(jnp.bfloat16), cache)
            outs.append(y)
        assert_close(f"{case} bf16 decode", full, jnp.concatenate(outs, 1), 0.01)
        assert_close(f"{case} bf16 forward", ref, full, 0.02)
    assert cache["pos"].dtype == jnp.int32


@pytest.mark.skipif(importlib.util.find_spec("kernels.kda.chunk") is None, reason="no chunked kernel")
@pytest.mark.parametrize("case", ["linear", "gated_deltanet", "kda_k3"])
def test_chunked_kernel_inside_layer(case):
    x = _x(2, 70, seed=4)
    seg = jnp.asarray(np.repeat([[0, 1]], [40, 30], axis=1).repeat(2, 0), jnp.int32)
    ref = _build(case)(x, segment_ids=seg)
    out = _build(case, impl="chunk")(x, segment_ids=seg)
    assert_close(f"{case} chunk vs naive", ref, out, 1e-4)


def test_runs_jitted_under_a_mesh():
    """Activation constraints resolve on a mesh (parameter sharding: tests/test_layers.py)."""
    mesh = jax.make_mesh((2, 2, 2), ("fsdp", "tensor", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    m, x = _build("kda"), _x(4, 6)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
        y = nnx.jit(lambda mdl, v: mdl(v))(m, x)
    assert_close("kda on a mesh", m(x), y, 1e-5)


def test_registry_entries():
    assert set(MIXERS) == {"softmax", "linear", "deltanet", "gated_deltanet", "kda", "mla"}
    for name, (_, cfg_cls) in MIXERS.items():
        cfg = cfg_cls()
        assert cfg == mixer_config(name, None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.num_heads = 1


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_on_gpu():
    x = _x(2, 64).astype(jnp.bfloat16)
    seg = jnp.asarray(np.repeat([[0, 1]], [40, 24], axis=1).repeat(2, 0), jnp.int32)
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    s = dict(num_heads=4, num_kv_heads=2, head_dim=16)
    ref = build_mixer("softmax", {**s, "impl": "xla"}, D, **kw, rngs=nnx.Rngs(0))
    out = build_mixer("softmax", {**s, "impl": "cudnn"}, D, **kw, rngs=nnx.Rngs(0))
    for seg_ids in (None, seg):
        assert_close("cudnn vs xla", ref(x, segment_ids=seg_ids), out(x, segment_ids=seg_ids), 0.01)


@pytest.mark.parametrize("case", CASES)
def test_every_param_gets_a_gradient(case):
    m = _build(case)
    x = _x(1, 4, seed=5)
    seg = jnp.asarray([[0, 0, 1, 1]], jnp.int32)
    loss = lambda mdl: jnp.sum(mdl(x, segment_ids=seg) ** 2)
    grads = nnx.jit(nnx.grad(loss))(m)
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...])
        assert np.all(np.isfinite(g)) and np.any(g != 0), path


@pytest.mark.parametrize("packed", [False, True])
def test_blocked_xla_attention_matches_the_one_shot_form_in_less_memory(packed):
    """blocked_xla_attention (query blocks, per-block remat) equals xla_attention under
    causal_mask, values and gradients, with GQA, a narrower value head, packed documents and T
    not a multiple of the block; its gradient program's temporaries are a fraction of the
    one-shot form's."""
    from kimi_jax.attention.common import blocked_xla_attention, causal_mask, xla_attention

    r = np.random.default_rng(int(packed))
    B, T, H, G, Dk, Dv = 2, 300, 4, 2, 16, 8
    q = jnp.asarray(r.standard_normal((B, T, H, Dk)), jnp.float32)
    k = jnp.asarray(r.standard_normal((B, T, G, Dk)), jnp.float32)
    v = jnp.asarray(r.standard_normal((B, T, G, Dv)), jnp.float32)
    seg = jnp.asarray(np.cumsum(r.uniform(size=(B, T)) < 0.02, axis=1), jnp.int32) if packed else None

    def one_shot(q, k, v):
        return xla_attention(q, k, v, causal_mask(seg, T, B), 0.25)

    def blocked(q, k, v):
        return blocked_xla_attention(q, k, v, seg, 0.25, block=64)

    w = jnp.asarray(r.standard_normal((B, T, H, Dv)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)  # noqa: E731
    for a, b in zip((one_shot(q, k, v), *jax.grad(loss(one_shot), (0, 1, 2))(q, k, v)),
                    (blocked(q, k, v), *jax.grad(loss(blocked), (0, 1, 2))(q, k, v))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    assert blocked_xla_attention(q, k, v, seg, 0.25, block=512).shape == (B, T, H, Dv)  # one block
    with pytest.raises(ValueError, match="block"):
        blocked_xla_attention(q, k, v, seg, 0.25, block=0)

    T = 2048  # memory: the one-shot gradient holds [B, H, T, T] float32 several times over
    big = [jnp.zeros((1, T, 2, 16), jnp.float32)] * 3
    seg = jnp.zeros((1, T), jnp.int32) if packed else None

    def temp(f):
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2)))
        return g.lower(*big).compile().memory_analysis().temp_size_in_bytes

    one = temp(lambda q, k, v: xla_attention(q, k, v, causal_mask(seg, T, 1), 0.25))
    blk = temp(lambda q, k, v: blocked_xla_attention(q, k, v, seg, 0.25, block=256))
    assert one >= 2 * 2 * T * T * 4 and blk * 4 < one, (one, blk)


def test_activation_layout_constraint_is_checked_and_value_preserving():
    from kimi_jax.attention import common

    x = jnp.arange(24.0).reshape(1, 2, 3, 4)
    assert common.constrain_layout(None) is None and common.constrain_layout(x) is x  # "xla": untouched
    with common.activation_layout("row_major"):
        f = jax.jit(common.constrain_layout)
        assert "LayoutConstraint" in f.lower(x).as_text()
        np.testing.assert_array_equal(f(x), x)
    assert common.ACTIVATION_LAYOUT == "xla"  # restored
    with pytest.raises(ValueError, match="ACTIVATION_LAYOUT"):
        with common.activation_layout("T_minor"):
            pass

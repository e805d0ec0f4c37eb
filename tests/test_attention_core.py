"""attention/core.py on CPU: "auto" is the XLA path there and equals the float32-logit reference,
the cuDNN packing structure (segment_layout) against a hand-worked example and against the mask
it must encode, and clear errors for unknown impls, cuDNN without a GPU and bad settings."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.attention import build_mixer, mixer_config
from kimi_jax.attention.common import causal_mask, xla_attention
from kimi_jax.attention.core import attention, count_runs, resolve_impl, segment_layout

pytestmark = pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="CPU behaviour of impl='auto'")


def _qkv(B=2, T=16, H=4, G=2, dqk=16, dv=8, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, H, dqk), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, G, dqk), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, G, dv), jnp.float32).astype(dtype)
    return q, k, v


SEG = jnp.asarray([[1] * 5 + [2] * 7 + [0] * 4, [3] * 16], jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seg", [None, SEG], ids=["unpacked", "packed"])
def test_auto_on_cpu_is_the_xla_path(dtype, seg):
    q, k, v = _qkv(dtype=dtype)
    assert resolve_impl("auto", q, k, v, seg) == "xla"
    ref = xla_attention(q, k, v, causal_mask(seg, 16, 2), 0.25)
    for impl in ("auto", "xla"):
        out = attention(q, k, v, seg, scale=0.25, impl=impl)
        assert out.shape == (2, 16, 4, 8) and out.dtype == dtype
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_auto_on_cpu_does_not_log(caplog):
    q, k, v = _qkv(dtype=jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="kimi_jax.attention.core"):
        attention(q, k, v, SEG, scale=0.25)
    assert not caplog.records


def test_segment_layout_hand_worked():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [5] * 8, [1, 2, 3, 3, 4, 5, 6, 6]], jnp.int32)
    seqlens, offsets, covered = segment_layout(seg, 4)
    np.testing.assert_array_equal(seqlens, [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 2, 1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 4, -1]])
    # Row 2 has 6 runs; the last two (positions 5..7) do not fit in 4 slots.
    np.testing.assert_array_equal(covered, [[True] * 8, [True] * 8, [True] * 5 + [False] * 3])
    np.testing.assert_array_equal(count_runs(seg), [3, 1, 6])


def _mask_from_layout(seqlens, offsets, T):
    """[B, T, T] bool: query t sees key s when both lie in one (offset, length) run and s <= t."""
    seqlens, offsets = np.asarray(seqlens), np.asarray(offsets)
    mask = np.zeros((seqlens.shape[0], T, T), bool)
    for b in range(seqlens.shape[0]):
        for start, n in zip(offsets[b], seqlens[b]):
            if n >= 0:
                mask[b, start:start + n, start:start + n] = np.tril(np.ones((n, n), bool))
    return mask


def test_segment_layout_encodes_the_packed_causal_mask(rng):
    B, T = 4, 64
    rows = []
    for _ in range(B):  # random document lengths, ids increasing as the packer writes them
        lengths = rng.integers(1, 20, size=T)
        ids = np.repeat(np.arange(1, T + 1), lengths)[:T]
        rows.append(ids)
    rows[-1][-9:] = 0  # trailing padding is a run of its own
    seg = jnp.asarray(np.stack(rows), jnp.int32)
    M = int(max(1 + np.sum(r[1:] != r[:-1]) for r in rows))
    seqlens, offsets, covered = segment_layout(seg, M)
    assert np.all(covered)
    expected = np.asarray(causal_mask(seg, T, B))[:, 0]
    np.testing.assert_array_equal(_mask_from_layout(seqlens, offsets, T), expected)
    # Every token lies in exactly one run, and the runs tile the row in order.
    assert np.all(np.asarray(seqlens).clip(0).sum(1) == T)


def test_segment_layout_under_jit_matches_eager():
    eager = segment_layout(SEG, 3)
    jitted = jax.jit(segment_layout, static_argnums=1)(SEG, 3)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(a, b)


def test_clear_errors():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"Unknown attention impl='flash'.*\['auto', 'xla', 'cudnn'\]"):
        attention(q, k, v, scale=0.25, impl="flash")
    with pytest.raises(ValueError, match="impl='cudnn' needs a GPU.*no CUDA GPU"):
        attention(q, k, v, SEG, scale=0.25, impl="cudnn")
    with pytest.raises(ValueError, match="max_segments must be an int >= 2"):
        attention(q, k, v, SEG, scale=0.25, max_segments=1)
    with pytest.raises(ValueError, match="segment_ids must be"):
        attention(q, k, v, SEG[:, :8], scale=0.25)
    with pytest.raises(ValueError, match="do not fit"):
        attention(q, k[:, :, :, :8], v, scale=0.25)
    with pytest.raises(ValueError, match="Unknown MLAConfig.attention_impl"):
        mixer_config("mla", {"attention_impl": "flash"})
    with pytest.raises(ValueError, match="max_segments"):
        mixer_config("mla", {"max_segments": 0})
    with pytest.raises(ValueError, match="max_segments"):
        mixer_config("softmax", {"max_segments": 1})


MLA = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=12)


@pytest.mark.parametrize("name,settings", [("mla", MLA), ("softmax", dict(num_heads=4, num_kv_heads=2))])
def test_mixers_auto_equals_xla_and_cudnn_raises(name, settings):
    key = "attention_impl" if name == "mla" else "impl"
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 16, 32), jnp.float32)
    auto = build_mixer(name, settings, 32, **kw, rngs=nnx.Rngs(0))
    assert getattr(auto.config, key) == "auto"
    xla = build_mixer(name, {**settings, key: "xla"}, 32, **kw, rngs=nnx.Rngs(0))
    for seg in (None, SEG):
        np.testing.assert_array_equal(auto(x, segment_ids=seg), xla(x, segment_ids=seg))
    cudnn = build_mixer(name, {**settings, key: "cudnn"}, 32, **kw, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="impl='cudnn' needs a GPU"):
        cudnn(x, segment_ids=SEG)


def test_rows_past_max_segments_take_the_exact_path(monkeypatch, caplog):
    """Chosen inside jit per batch: the plain cuDNN kernel when every row is one document, the
    ragged layout when every row fits max_segments, else the XLA path (logged)."""
    from kimi_jax.attention import core

    monkeypatch.setattr(core, "resolve_impl", lambda *a, **k: "cudnn")
    # Stand-in for cuDNN: 0 from the ragged (packed) layout, 1 from the plain causal kernel.
    monkeypatch.setattr(core, "cudnn_attention",
                        lambda q, k, v, seg, scale, m: jnp.full(q.shape[:3] + v.shape[-1:], seg is None, v.dtype))
    q, k, v = _qkv(dtype=jnp.bfloat16)
    B, T = q.shape[:2]
    few = jnp.asarray(np.repeat([[1, 2]], [T // 2, T - T // 2], axis=1).repeat(B, 0), jnp.int32)
    many = few.at[0, -1].set(7)  # row 0: three runs
    f = jax.jit(lambda seg: core.attention(q, k, v, seg, scale=0.25, impl="cudnn", max_segments=2))
    assert not np.asarray(f(few), np.float32).any()
    assert (np.asarray(f(jnp.full_like(few, 3)), np.float32) == 1).all()  # one document per row
    with caplog.at_level(logging.WARNING, logger="kimi_jax.attention.core"):
        out = jax.block_until_ready(f(many))
    ref = jax.jit(lambda seg: xla_attention(q, k, v, causal_mask(seg, T, B), 0.25))(many)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
    assert np.abs(np.asarray(out, np.float32)).sum() > 0
    assert any("3 documents" in r.getMessage() for r in caplog.records)


def test_switch_residuals_hold_no_score_matrix(monkeypatch):
    """Under autodiff every branch of the run-time switch returns the residuals of all branches;
    the XLA fallback is rematerialised so that no [T, T] logits or probabilities ride along (they
    would be written as zeros on every cuDNN step)."""
    from kimi_jax.attention import core

    monkeypatch.setattr(core, "resolve_impl", lambda *a, **k: "cudnn")
    monkeypatch.setattr(core, "cudnn_attention", lambda q, k, v, seg, scale, m: (q[..., : v.shape[-1]] * 2 + v).astype(v.dtype))
    q, k, v = _qkv(B=2, T=32, H=4, G=4, dqk=8, dv=8, dtype=jnp.bfloat16)
    seg = jnp.ones((2, 32), jnp.int32)
    loss = lambda q, k, v: jnp.sum(core.attention(q, k, v, seg, scale=0.25, impl="cudnn").astype(jnp.float32))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    outs = [o.aval.shape for e in jaxpr.eqns if e.primitive.name == "cond" for o in e.outvars]
    assert outs and not [s for s in outs if tuple(s[-2:]) == (32, 32)], outs

"""cuDNN fused attention (attention/core.py, impl="cudnn") against the float32-logit XLA path on
GPU: MLA shapes (q/k 192, v 128) and GQA, with and without packed documents, values and
gradients at bf16 tolerances; rows with more documents than max_segments; the MLA mixer.

    JAX_PLATFORMS=cuda,cpu python -m pytest -q -m gpu tests/test_attention_cudnn_gpu.py -rs
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.testing import assert_close
from kimi_jax.attention import build_mixer
from kimi_jax.attention.core import attention, resolve_impl

pytestmark = pytest.mark.gpu

B, T = 2, 1024
# Row 0: three documents and trailing padding (id 0); row 1: one document.
SEG = jnp.asarray(np.stack([np.repeat([1, 2, 3, 0], [300, 500, 200, 24]), np.ones(T)]), jnp.int32)
TOL = 0.02  # relative RMS: bf16 q k^T and p v in cuDNN against float32 logits


def _qkv(H, G, dqk, dv, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, dqk), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, G, dqk), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, G, dv), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, T, H, dv), jnp.float32)
    return q, k, v, do


def _value_and_grads(impl, q, k, v, do, seg, scale, max_segments=8):
    def loss(q, k, v):
        o = attention(q, k, v, seg, scale=scale, impl=impl, max_segments=max_segments)
        return jnp.sum(o.astype(jnp.float32) * do), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return o, grads


@pytest.mark.parametrize("seg", [None, SEG], ids=["unpacked", "packed"])
@pytest.mark.parametrize("H,G,dqk,dv", [(4, 4, 192, 128), (4, 2, 128, 128)], ids=["mla", "gqa"])
def test_cudnn_matches_xla(seg, H, G, dqk, dv):
    q, k, v, do = _qkv(H, G, dqk, dv)
    assert resolve_impl("auto", q, k, v, seg, 8) == "cudnn"
    scale = dqk**-0.5
    ref_o, ref_g = _value_and_grads("xla", q, k, v, do, seg, scale)
    out_o, out_g = _value_and_grads("cudnn", q, k, v, do, seg, scale)
    assert out_o.dtype == jnp.bfloat16 and out_o.shape == (B, T, H, dv)
    assert_close("o", ref_o, out_o, TOL)
    for name, r, o in zip(("dq", "dk", "dv"), ref_g, out_g):
        assert_close(name, r, o, TOL)


def test_packed_documents_do_not_leak():
    """Changing one document's keys and values leaves every other document's outputs as they were."""
    q, k, v, _ = _qkv(4, 4, 192, 128)
    doc2 = (SEG == 2)[:, :, None, None]
    k2, v2 = jnp.where(doc2, -k, k), jnp.where(doc2, 2 * v, v)
    f = jax.jit(lambda k, v: attention(q, k, v, SEG, scale=192**-0.5, impl="cudnn", max_segments=8))
    a, b = np.asarray(f(k, v), np.float32), np.asarray(f(k2, v2), np.float32)
    other = ~np.asarray(doc2[:, :, 0, 0])
    np.testing.assert_array_equal(a[other], b[other])
    assert not np.allclose(a[~other], b[~other])


def test_rows_past_max_segments_take_the_exact_path(caplog):
    """A batch with a row of more documents than max_segments runs the XLA path (impl="xla" up to
    bf16 rounding of its fusions) and says so; the cuDNN ragged layout leaves such tokens unattended (NaN)."""
    from kimi_jax.attention.core import cudnn_attention

    q, k, v, _ = _qkv(4, 4, 192, 128)
    ref = np.asarray(jax.jit(lambda: attention(q, k, v, SEG, scale=192**-0.5, impl="xla"))(), np.float32)
    f = jax.jit(lambda q, k, v, seg: attention(q, k, v, seg, scale=192**-0.5, impl="cudnn", max_segments=2))
    with caplog.at_level("WARNING", logger="kimi_jax.attention.core"):
        o = np.asarray(jax.block_until_ready(f(q, k, v, SEG)), np.float32)
    assert_close("fallback vs xla", ref, o, 1e-3)  # the same XLA path, fused inside lax.switch
    from kimi_jax.attention.core import _has_cpu

    if _has_cpu():  # the log comes from a host callback (JAX_PLATFORMS=cuda,cpu)
        assert any("max_segments=2" in r.getMessage() for r in caplog.records)
    raw = np.asarray(jax.jit(lambda: cudnn_attention(q, k, v, SEG, 192**-0.5, 2))(), np.float32)
    assert np.isnan(raw[0, 800:]).all() and np.isfinite(raw[0, :800]).all()
    ok = np.asarray(f(q, k, v, jnp.ones_like(SEG)), np.float32)  # one document per row: cuDNN
    assert_close("one run", np.asarray(jax.jit(lambda: attention(q, k, v, jnp.ones_like(SEG), scale=192**-0.5,
                                                                 impl="xla"))(), np.float32), ok, TOL)


def test_mla_mixer_cudnn_matches_xla():
    s = dict(num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, rope_theta=10000.0, max_segments=8)
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(3), (B, T, 256), jnp.float32).astype(jnp.bfloat16)
    mixers = {impl: build_mixer("mla", {**s, "attention_impl": impl}, 256, **kw, rngs=nnx.Rngs(0))
              for impl in ("xla", "cudnn")}

    def run(model, seg):
        graphdef, params = nnx.split(model)

        def loss(params, x):
            y = nnx.merge(graphdef, params)(x, segment_ids=seg)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    for seg in (None, SEG):
        (_, y_ref), (gp_ref, gx_ref) = run(mixers["xla"], seg)
        (_, y), (gp, gx) = run(mixers["cudnn"], seg)
        assert_close(f"y seg={seg is not None}", y_ref, y, TOL)
        assert_close(f"dx seg={seg is not None}", gx_ref, gx, 0.03)
        for (path, r), (_, o) in zip(nnx.to_flat_state(gp_ref), nnx.to_flat_state(gp)):
            assert_close(f"d{path} seg={seg is not None}", r[...], o[...], 0.03)

"""moe_dispatch.GATE_UP: gate and up as one grouped matmul against [gate | up] ("fused"), or two
with the backward of one ("fused_bwd"), give the values and gradients of two, through XLA's
ragged_dot, the Pallas grouped matmul (interpreted) and packed MXFP4 experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import mxfp4
from kernels.gmm import pallas_gpu
from kimi_jax import moe_dispatch, moe_ep
from kimi_jax.ffn import glu_activation
from kimi_jax.moe_dispatch import ExpertWeights, concat_n, gate_up, grouped_ffn, ragged_dispatch
from kimi_jax.moe_ep import gmm_dispatch, grouped_matmul


def _inputs(E=4, D=64, F=64, N=24, k=2, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (N, D), dtype)
    idx = jax.random.randint(keys[1], (N, k), 0, E - 1)  # the last expert gets no rows
    idx = idx.at[:, 1].set((idx[:, 0] + 1) % (E - 1))
    w = jax.random.uniform(keys[2], (N, k))
    experts = ExpertWeights(jax.random.normal(keys[3], (E, D, F)) / D**0.5,
                            jax.random.normal(keys[4], (E, D, F)) / D**0.5,
                            jax.random.normal(keys[5], (E, F, D)) / F**0.5)
    return x, idx, w, experts


def _value_and_grads(mode, matmul, x, idx, w, experts):
    act = glu_activation("swiglu")

    def loss(x, experts):
        y = ragged_dispatch(x, idx, w, experts, act, matmul=matmul)
        return jnp.sum(jnp.sin(y)), y

    with gate_up(mode):  # traced here: the setting is read while tracing
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, experts)


@pytest.mark.parametrize("mode", ["fused", "fused_bwd"])
@pytest.mark.parametrize("path", ["ragged_dot", "pallas_gpu"])
def test_fused_gate_up_matches_separate(path, mode):
    if path == "ragged_dot":
        x, idx, w, experts = _inputs()
        matmul, tol = jax.lax.ragged_dot, dict(rtol=1e-5, atol=1e-5)
    else:  # bf16 through the Mosaic GPU kernels (interpreted on CPU): N = 2F = 128 in the fused call
        x, idx, w, experts = _inputs(dtype=jnp.bfloat16)
        blocks = pallas_gpu.Blocks(bm=64, bn=64, bk=64, stages=2)
        matmul = lambda a, b, gs: pallas_gpu.gmm_vjp(a, b, gs, blocks, True)  # noqa: E731
        tol = dict(rtol=2e-2, atol=2e-2)
    (_, y_sep), g_sep = _value_and_grads("separate", matmul, x, idx, w, experts)
    (_, y_fused), g_fused = _value_and_grads(mode, matmul, x, idx, w, experts)
    np.testing.assert_allclose(np.asarray(y_fused, np.float32), np.asarray(y_sep, np.float32), **tol)
    for a, b in zip(jax.tree.leaves(g_sep), jax.tree.leaves(g_fused)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), **tol)
    assert float(jnp.abs(g_fused[1].up).max()) > 0 and float(jnp.abs(g_fused[1].gate).max()) > 0


def test_fused_bwd_runs_seven_products():
    """fused_bwd's step compiles to seven matmuls: gate, up and down forward, down's two
    gradients, and one each for the input and the weight gradient of [gate | up]; the unused
    forward product inside its backward is dropped (separate: nine, fused: six)."""
    x, _, _, experts = _inputs(N=32)
    gs = jnp.array([8, 8, 16, 0], jnp.int32)
    act = glu_activation("swiglu")
    counts = {}
    for mode in ("separate", "fused", "fused_bwd"):
        with gate_up(mode):
            f = jax.jit(jax.grad(lambda x, ex: jnp.sum(jnp.sin(grouped_ffn(x, gs, ex, act))), argnums=(0, 1)))
            counts[mode] = f.lower(x, experts).compile().as_text().count(" dot(")
    assert counts == dict(separate=9, fused=6, fused_bwd=7)


def test_fused_gate_up_reads_packed_mxfp4_experts():
    """Packed experts concatenate their codes and scales along N; the grouped matmul that reads
    them gives the outputs of the two separate packed matmuls."""
    x, idx, w, experts = _inputs(D=64, F=32)
    packed = ExpertWeights(*(mxfp4.MXFP4Weight.from_dense(a) for a in experts))
    both = concat_n(packed.gate, packed.up)
    assert both.shape == (4, 64, 64) and both.packed.shape == (4, 64, 32) and both.scales.shape == (4, 64, 2)
    act = glu_activation("swiglu")
    x = x.astype(jnp.bfloat16)
    ys = {}
    for mode in ("separate", "fused", "fused_bwd"):
        with gate_up(mode):
            ys[mode] = np.asarray(ragged_dispatch(x, idx, w, packed, act, matmul=grouped_matmul))
    with gate_up("fused_glu"), pytest.raises(ValueError, match="dense expert weights"):
        gmm_dispatch(x, idx, w, packed, act)
    np.testing.assert_allclose(ys["fused"], ys["separate"], rtol=1e-6, atol=1e-6)
    # The concatenation is exact: dequantised, the halves are the two packed weights.
    np.testing.assert_array_equal(mxfp4.dequantize(both.packed, both.scales)[:, :32],
                                  mxfp4.dequantize(packed.gate.packed, packed.gate.scales))


def test_gate_up_rejects_unknown_modes_and_mixed_weights():
    with pytest.raises(ValueError, match="GATE_UP"):
        with gate_up("interleaved"):
            pass
    _, _, _, experts = _inputs()
    with pytest.raises(ValueError, match="both"):
        concat_n(mxfp4.MXFP4Weight.from_dense(experts.gate), experts.up)
    old = moe_dispatch.GATE_UP
    moe_dispatch.GATE_UP = "interleaved"  # set by hand, not through gate_up: caught when traced
    try:
        with pytest.raises(ValueError, match="GATE_UP"):
            grouped_ffn(jnp.zeros((4, 64)), jnp.array([4, 0, 0, 0], jnp.int32), experts, glu_activation("swiglu"))
    finally:
        moe_dispatch.GATE_UP = old


@pytest.mark.parametrize("activation,mode", [("swiglu", "fused_glu"), ("situ", "fused_glu"), ("situ", "fused_ffn")])
def test_fused_glu_matches_separate_through_the_gmm_dispatch(activation, mode, monkeypatch):
    """GATE_UP="fused_glu" / "fused_ffn" hand the whole expert FFN to kernels.gmm.glu_ffn with
    fusion "glu" / "ffn" (its reference on the CPU; the Pallas kernels have their own parity
    tests): same values and gradients as separate. A dispatch without a fused GLU, or an
    activation that is not a named GLU, is refused."""
    x, idx, w, experts = _inputs()
    act = glu_activation(activation)
    fusions = []
    glu_ffn = moe_ep.gmm_ops.glu_ffn
    monkeypatch.setattr(moe_ep.gmm_ops, "glu_ffn", lambda *a, **kw: fusions.append(kw["fusion"]) or glu_ffn(*a, **kw))

    def run(mode):
        def loss(x, experts):
            y = gmm_dispatch(x, idx, w, experts, act)
            return jnp.sum(jnp.sin(y)), y

        with gate_up(mode):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, experts)

    (_, y_sep), g_sep = run("separate")
    (_, y_glu), g_glu = run(mode)
    assert fusions and set(fusions) == {mode.removeprefix("fused_")}
    np.testing.assert_allclose(np.asarray(y_glu), np.asarray(y_sep), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sep), jax.tree.leaves(g_glu)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    with gate_up(mode):
        with pytest.raises(ValueError, match="fused GLU kernel"):
            ragged_dispatch(x, idx, w, experts, act)
        with pytest.raises(ValueError, match="named GLU"):
            gmm_dispatch(x, idx, w, experts, lambda g, u: g * u)


def test_auto_gate_up_resolves_by_width_weights_activation_and_platform(monkeypatch):
    """GATE_UP="auto" (the default) runs "fused_glu" for narrow dense experts with a named GLU when
    the dispatch's fused GLU is the Pallas kernel (Hopper), else "separate"; an explicit mode wins."""
    from kimi_jax.moe_dispatch import resolve_gate_up

    _, _, _, narrow = _inputs(D=256, F=224)
    _, _, _, wide = _inputs(D=256, F=320)
    act, glu, bf16 = glu_activation("swiglu"), moe_ep.fused_glu_ffn, jnp.bfloat16
    assert moe_dispatch.GATE_UP == "auto"
    assert resolve_gate_up(narrow, act, glu, bf16) == "separate"  # not on Hopper: the reference
    monkeypatch.setattr(moe_dispatch.gmm_ops, "_is_hopper", lambda: True)
    assert resolve_gate_up(narrow, act, glu, bf16) == "fused_glu"
    assert resolve_gate_up(narrow, act, glu, jnp.float32) == "separate"  # the kernels take 16-bit operands
    assert resolve_gate_up(wide, act, glu, bf16) == "separate"
    assert resolve_gate_up(narrow, act, None, bf16) == "separate"  # a dispatch without a fused GLU
    assert resolve_gate_up(narrow, lambda g, u: g * u, glu, bf16) == "separate"
    packed = ExpertWeights(*(mxfp4.MXFP4Weight.from_dense(x) for x in narrow))
    assert resolve_gate_up(packed, act, glu, bf16) == "separate"
    with gate_up("fused"):
        assert resolve_gate_up(narrow, act, glu, bf16) == "fused"


def test_auto_gate_up_runs_the_fused_glu_on_hopper(monkeypatch):
    """Under "auto" with the Pallas kernels chosen (Hopper, here faked), the dispatch hands the
    narrow experts' FFN to its fused GLU ("glu" fusion), whose result it returns."""
    x, idx, w, experts = _inputs()
    x = x.astype(jnp.bfloat16)
    act, calls = glu_activation("swiglu"), []

    def glu_ffn(xs, wg, wu, wd, gs, activation, fusion):
        calls.append(fusion)
        return moe_dispatch.grouped_ffn(xs, gs, ExpertWeights(wg, wu, wd), activation)  # no fused GLU: separate

    monkeypatch.setattr(moe_dispatch.gmm_ops, "_is_hopper", lambda: True)
    y = ragged_dispatch(x, idx, w, experts, act, glu_ffn=glu_ffn)
    with gate_up("separate"):
        y_sep = ragged_dispatch(x, idx, w, experts, act)
    assert calls == ["glu"]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_sep))

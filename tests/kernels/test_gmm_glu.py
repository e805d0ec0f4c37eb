"""kernels.gmm.glu_ffn: the gated expert FFN with its activation fused into the grouped matmuls.

The Mosaic GPU kernels run in the interpreter on the CPU: outputs and every gradient against the
ragged_dot reference (autodiff), and each fused kernel's outputs against the separate steps it
replaces. Ragged groups with an empty one, rows past the total, and widths that are not tile
multiples (F = 96 with bn = 64, M = 200 with bm = 64) cover the padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import glu, pallas_gpu, pallas_gpu_glu, reference
from kernels.gmm.glu_math import glu_backward, glu_forward
from kernels.testing import assert_close
from tests.jaxprs import equations

M, D, F, G = 200, 64, 96, 4
SIZES = jnp.array([70, 0, 60, 50], jnp.int32)  # 180 of 200 rows; group 1 empty
ACTS = {"swiglu": ("swiglu", 0.0, 0.0), "situ": ("situ", 4.0, 25.0), "situ_narrow": ("situ", 0.7, 1.3)}
BLOCKS = glu.DEFAULT_GLU_BLOCKS


def _data(seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    bf = lambda key, shape, scale: (jax.random.normal(key, shape) * scale).astype(jnp.bfloat16)  # noqa: E731
    return (bf(k[0], (M, D), 1.0), bf(k[1], (G, D, F), D**-0.5), bf(k[2], (G, D, F), D**-0.5),
            bf(k[3], (G, F, D), F**-0.5), bf(k[4], (M, D), 1.0))


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def check_against_reference(act, **glu_kw):
    """glu_ffn's Pallas path (interpreted) against ragged_dot: values, every gradient, zero rows past
    the total and no gradient for the empty group's weights."""
    kind, beta, lb = ACTS[act]
    x, wg, wu, wd, dy = _data()

    def run(impl):
        def loss(x, wg, wu, wd):
            y = glu.glu_ffn(x, wg, wu, wd, SIZES, kind=kind, beta=beta, linear_beta=lb, impl=impl, **glu_kw)
            return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32)), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, wg, wu, wd)

    (_, y_ref), g_ref = run("ragged_dot")
    (_, y), g = run("pallas_gpu")
    assert y.shape == (M, D) and y.dtype == jnp.bfloat16
    assert_close("y", _f64(y_ref), _f64(y), 1e-2)
    assert not np.any(_f64(y)[180:]), "rows past the total must be zero"
    for name, a, b in zip(("dx", "dgate", "dup", "ddown"), g_ref, g):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_close(name, _f64(a), _f64(b), 2e-2)
    assert not np.any(_f64(g[0])[180:]), "rows past the total get no gradient"
    assert not np.any(_f64(g[1])[1]) and not np.any(_f64(g[3])[1]), "the empty group's weights get no gradient"


@pytest.mark.parametrize("act", list(ACTS))
def test_pallas_matches_reference_values_and_gradients(act):
    check_against_reference(act)


@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_fused_kernels_equal_the_steps_they_replace(act):
    """glu_gmm: gu = [gate | up] as the plain grouped matmuls store them (bf16) and h = act of
    those; glu_gmm_bwd: [dgate | dup] = act's backward at (gate, up) with dh rounded to bf16.
    Padded rows and columns are zero."""
    act_t = ACTS[act]
    x, wg, wu, wd, dy = _data(1)
    h, gu = pallas_gpu_glu.glu_gmm(x, wg, wu, SIZES, act=act_t, blocks=BLOCKS, interpret=True)
    Mp, Np = h.shape
    assert (Mp, Np) == (256, 128) and gu.shape == (Mp, 2 * Np)
    gate, up = reference.gmm(x, wg, SIZES), reference.gmm(x, wu, SIZES)
    assert_close("gate", _f64(gate), _f64(gu[:M, :F]), 1e-2)
    assert_close("up", _f64(up), _f64(gu[:M, Np:Np + F]), 1e-2)
    want_h = glu_forward(act_t[0], gu[:, :F], gu[:, Np:Np + F], *act_t[1:]).astype(jnp.bfloat16)
    assert_close("h", _f64(want_h), _f64(h[:, :F]), 1e-2)
    for name, pad in (("h", h[:, F:]), ("gate", gu[:, F:Np]), ("up", gu[:, Np + F:]), ("rows", gu[180:])):
        assert not np.any(_f64(pad)), f"padding of {name} must be zero"

    dgu = pallas_gpu_glu.glu_gmm_bwd(dy, wd, gu, SIZES, act=act_t, blocks=BLOCKS, interpret=True)
    dh = reference.gmm(dy, wd, SIZES, transpose_rhs=True)
    dg, du = glu_backward(act_t[0], gu[:M, :F], gu[:M, Np:Np + F], dh, *act_t[1:])
    assert_close("dgate", _f64(dg), _f64(dgu[:M, :F]), 2e-2)
    assert_close("dup", _f64(du), _f64(dgu[:M, Np:Np + F]), 2e-2)
    assert not np.any(_f64(dgu[:, F:Np])) and not np.any(_f64(dgu[180:]))


def test_step_runs_six_grouped_matmul_kernels():
    """Forward: the fused gate/up/activation kernel and the down projection; backward: the fused
    dh/activation-backward kernel, the down weight's tgmm, dx (contraction 2F) and one tgmm for
    both gate and up weights (each `plgpu.kernel` launch traces to one mpmd_map)."""
    x, wg, wu, wd, _ = _data()
    f = jax.grad(lambda *a: glu.glu_ffn(*a, SIZES, impl="pallas_gpu").astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    jaxpr = jax.make_jaxpr(f)(x, wg, wu, wd).jaxpr
    assert sum(e.primitive.name == "mpmd_map" for e in equations(jaxpr)) == 6


def test_lowers_for_cuda_within_smem_at_k3_small_shapes(monkeypatch):
    """jit(grad) of the pallas path lowers for CUDA on the CPU at k3_small's expert shapes
    (65536 rows, D = 256, F = 224, 8 experts, SiTU-GLU), every kernel within an H200 SM's 227 KiB."""
    import jax.experimental.mosaic.gpu.core as mgpu_core

    from kernels.gmm import ops

    sizes = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda t: sizes.append(size(t)) or sizes[-1])
    monkeypatch.setattr(ops, "_interpret", lambda: False)
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    f = jax.jit(jax.grad(lambda *a: glu.glu_ffn(*a, kind="situ", impl="pallas_gpu").astype(jnp.float32).sum(),
                         argnums=(0, 1, 2, 3)))
    args = (bf(65536, 256), bf(8, 256, 224), bf(8, 256, 224), bf(8, 224, 256), jax.ShapeDtypeStruct((8,), jnp.int32))
    assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()[:4000]
    assert len(sizes) >= 4 and max(sizes) <= 227 * 1024


def test_rejects_bad_inputs():
    x, wg, wu, wd, dy = _data()
    with pytest.raises(ValueError, match="kind"):
        glu.glu_ffn(x, wg, wu, wd, SIZES, kind="gelu")
    with pytest.raises(ValueError, match="shapes"):
        glu.glu_ffn(x, wg, wu, wu, SIZES)
    with pytest.raises(ValueError, match="accumulators"):
        glu.glu_ffn(x, wg, wu, wd, SIZES, impl="pallas_gpu", glu_blocks=pallas_gpu.Blocks(bm=128, bn=128))
    with pytest.raises(ValueError, match="warpgroup"):
        glu.glu_ffn(x, wg, wu, wd, SIZES, impl="pallas_gpu", glu_blocks=pallas_gpu.Blocks(bm=64, bn=64, wgs=2))
    with pytest.raises(ValueError, match="one operand dtype"):
        glu.glu_ffn(x, wg, wu, wd.astype(jnp.float16), SIZES, impl="pallas_gpu")
    with pytest.raises(ValueError, match="same blocks"):
        pallas_gpu_glu.glu_gmm_bwd(dy, wd, jnp.zeros((256, 128), jnp.bfloat16), SIZES, act=ACTS["swiglu"],
                                   blocks=BLOCKS, interpret=True)


def check_compiled_against_f32(act, rows, D, F, experts, empty, seed, **glu_kw):
    """The compiled kernels (bf16) against the float32 ragged_dot reference, values and gradients:
    `rows` rows (all but 192 routed) over `experts` groups, the groups in `empty` without rows."""
    kind, beta, lb = ACTS[act]
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(experts, 2.0))
    p[list(empty)] = 0
    sizes = jnp.asarray(rng.multinomial(rows - 192, p / p.sum()), jnp.int32)
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (rows, D), jnp.float32)
    w = [jax.random.normal(k[i], s, jnp.float32) / np.sqrt(s[1]) for i, s in
         ((1, (experts, D, F)), (2, (experts, D, F)), (3, (experts, F, D)))]
    dy = jax.random.normal(k[4], (rows, D), jnp.float32)

    def run(impl, dtype):
        def loss(x, wg, wu, wd):
            y = glu.glu_ffn(x.astype(dtype), wg.astype(dtype), wu.astype(dtype), wd.astype(dtype), sizes,
                            kind=kind, beta=beta, linear_beta=lb, impl=impl, **glu_kw)
            return jnp.vdot(y.astype(jnp.float32), dy), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *w)

    (_, y_ref), g_ref = run("ragged_dot", jnp.float32)
    (_, y), g = run("pallas_gpu", jnp.bfloat16)
    assert_close("y", _f64(y_ref), _f64(y), 2e-2)
    for name, a, b in zip(("dx", "dgate", "dup", "ddown"), g_ref, g):
        assert_close(name, _f64(a), _f64(b), 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_gpu_glu_ffn_at_wide_expert_shapes(act):
    """The compiled fused kernels with deep K-pipelines and many column blocks (D = 1024, F = 768,
    16 experts with two empty, 8192 rows) against the float32 reference: values and gradients."""
    check_compiled_against_f32(act, 8192, 1024, 768, 16, (0, 9), seed=2)

"""kernels.gmm.glu_ffn(fusion="ffn"): the whole expert FFN of a block of rows in one kernel.

The Mosaic GPU kernels of `pallas_gpu_ffn` run in the interpreter on the CPU: values and every
gradient against the ragged_dot reference, each kernel's outputs against the separate steps it
replaces, with blocks of rows that span two and three groups, an empty group, rows past the total
and widths that are not tile multiples (D = 64 padded to 128 by 128-wide tiles, F = 96)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import glu, pallas_gpu, pallas_gpu_ffn, reference
from kernels.gmm.glu_math import glu_backward, glu_forward
from kernels.testing import assert_close
from tests.jaxprs import equations
from tests.kernels.test_gmm_glu import (ACTS, SIZES, D, F, M, _data, _f64, check_against_reference,
                                        check_compiled_against_f32)

TILES = {"64": glu.DEFAULT_FFN_BLOCKS, "128": pallas_gpu.Blocks(bm=64, bn=128, bk=64, stages=2)}


@pytest.mark.parametrize("act,tiles", [("swiglu", "64"), ("situ", "64"), ("situ_narrow", "128")])
def test_matches_reference_values_and_gradients(act, tiles):
    check_against_reference(act, fusion="ffn", glu_blocks=TILES[tiles])


@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_kernels_equal_the_steps_they_replace(act):
    """ffn_fwd: y = act(gate, up) @ w_down with gate, up and h rounded to bf16 as the plain grouped
    matmuls store them; ffn_bwd_rows: h, [dgate | dup] at dh rounded to bf16, and dx = dgate @
    w_gate^T + dup @ w_up^T; padded rows and columns zero."""
    act_t = ACTS[act]
    x, wg, wu, wd, dy = _data(1)
    blocks = glu.DEFAULT_FFN_BLOCKS
    gate, up = reference.gmm(x, wg, SIZES), reference.gmm(x, wu, SIZES)
    h = glu_forward(act_t[0], gate, up, *act_t[1:]).astype(jnp.bfloat16)
    y = pallas_gpu_ffn.ffn_fwd(x, wg, wu, wd, SIZES, act=act_t, blocks=blocks, interpret=True)
    assert_close("y", _f64(reference.gmm(h, wd, SIZES)), _f64(y), 1e-2)

    dx, h_k, dgu = pallas_gpu_ffn.ffn_bwd_rows(x, dy, wg, wu, wd, SIZES, act=act_t, blocks=blocks, interpret=True)
    Mp, Fp = h_k.shape
    assert (Mp, Fp) == (256, 128) and dgu.shape == (Mp, 2 * Fp) and dx.shape == (M, D)
    assert_close("h", _f64(h), _f64(h_k[:M, :F]), 1e-2)
    dh = reference.gmm(dy, wd, SIZES, transpose_rhs=True)
    dg, du = glu_backward(act_t[0], gate, up, dh, *act_t[1:])
    dg, du = dg.astype(jnp.bfloat16), du.astype(jnp.bfloat16)
    assert_close("dgate", _f64(dg), _f64(dgu[:M, :F]), 2e-2)
    assert_close("dup", _f64(du), _f64(dgu[:M, Fp:Fp + F]), 2e-2)
    want_dx = (jnp.asarray(reference.gmm(dg, wg, SIZES, transpose_rhs=True), jnp.float32)
               + jnp.asarray(reference.gmm(du, wu, SIZES, transpose_rhs=True), jnp.float32))
    assert_close("dx", _f64(want_dx), _f64(dx), 2e-2)
    for name, pad in (("h", h_k[:, F:]), ("dgate", dgu[:, F:Fp]), ("dup", dgu[:, Fp + F:]), ("rows", dgu[180:]),
                      ("h rows", h_k[180:]), ("dx rows", dx[180:])):
        assert not np.any(_f64(pad)), f"padding of {name} must be zero"


def test_step_runs_four_kernels():
    """Forward: one kernel; backward: the rows kernel (dx, h, [dgate | dup]) and two tgmm (each
    `plgpu.kernel` launch traces to one mpmd_map); x is the forward's only activation residual."""
    x, wg, wu, wd, _ = _data()
    f = jax.grad(lambda *a: glu.glu_ffn(*a, SIZES, impl="pallas_gpu", fusion="ffn").astype(jnp.float32).sum(),
                 argnums=(0, 1, 2, 3))
    jaxpr = jax.make_jaxpr(f)(x, wg, wu, wd).jaxpr
    assert sum(e.primitive.name == "mpmd_map" for e in equations(jaxpr)) == 4


def test_lowers_for_cuda_within_smem_at_k3_small_shapes(monkeypatch):
    """jit(grad) lowers for CUDA on the CPU at k3_small's expert shapes (65536 rows, D = 256,
    F = 224, 8 experts, SiTU-GLU), every kernel within an H200 SM's 227 KiB, and the forward within
    half of it (two programs per SM), as `smem_bytes` counts."""
    import jax.experimental.mosaic.gpu.core as mgpu_core

    from kernels.gmm import ops

    sizes = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda t: sizes.append(size(t)) or sizes[-1])
    monkeypatch.setattr(ops, "_interpret", lambda: False)
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    f = jax.jit(jax.grad(lambda *a: glu.glu_ffn(*a, kind="situ", impl="pallas_gpu", fusion="ffn")
                         .astype(jnp.float32).sum(), argnums=(0, 1, 2, 3)))
    args = (bf(65536, 256), bf(8, 256, 224), bf(8, 256, 224), bf(8, 224, 256), jax.ShapeDtypeStruct((8,), jnp.int32))
    assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()[:4000]
    assert len(sizes) >= 2 and max(sizes) <= 227 * 1024
    need = pallas_gpu_ffn.smem_bytes(256, 224, glu.DEFAULT_FFN_BLOCKS)
    assert need["fwd"] <= 113 * 1024 < need["bwd"] <= 227 * 1024


def test_rejects_what_does_not_fit():
    """K3's expert widths (D = 3584, F = 3072) keep [bm, F] three times in SMEM: refused with the
    way out named; so are unknown fusions and warp-specialized tiles."""
    with pytest.raises(ValueError, match="fusion='glu'"):
        pallas_gpu_ffn.check_ffn_fits(3584, 3072, glu.DEFAULT_FFN_BLOCKS)
    x, wg, wu, wd, _ = _data()
    with pytest.raises(ValueError, match="fusion"):
        glu.glu_ffn(x, wg, wu, wd, SIZES, fusion="all")
    with pytest.raises(ValueError, match="warpgroup"):
        glu.glu_ffn(x, wg, wu, wd, SIZES, impl="pallas_gpu", fusion="ffn",
                    glu_blocks=pallas_gpu.Blocks(bm=64, bn=128, wgs=2))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_gpu_ffn_at_k3_small_shapes(act):
    """The compiled kernels at k3_small's expert widths (D = 256, F = 224, 8 experts with one
    empty, 16384 rows) against the float32 reference: values and gradients."""
    check_compiled_against_f32(act, 16384, 256, 224, 8, (3,), seed=3, fusion="ffn")

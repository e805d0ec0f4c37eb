"""The Mosaic reverse pass writing the state gradients in the compute dtype
(`grad_scan(dhs_dtype=bf16)`, used under `chunk.settings(cotangents="compute")`): the rounded copy
its kg dS product reads, so exactly the float32 output rounded; it also reads Aqk^T do in the
compute dtype there; both training levers lower for CUDA and match naive on the GPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import chunk, mosaic_scan
from tests.kernels.test_kda_chunk import BF16_TOL, make_inputs
from tests.kernels.test_kda_mosaic_scan import _compare, cuda_train_module


@pytest.mark.parametrize("delta, grad_issue, block_v", [(True, "in_order", 64), (True, "early", 32),
                                                        (False, "in_order", 64)])
def test_compute_dtype_dhs_is_the_rounded_float32_dhs(rng, delta, grad_issue, block_v):
    N, B, H, K, V = 3, 1, 2, 128, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    w = f(N, B, H, 64, K) if delta else None
    kg, qg, do = f(N, B, H, 64, K), f(N, B, H, 64, K), f(N, B, H, 64, V)
    dvi = jnp.asarray(rng.standard_normal((N, B, H, 64, V)), jnp.float32)
    decay = jnp.asarray(rng.uniform(0.3, 1.0, (N, B, H, K)), jnp.float32)
    dS = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    run = lambda dt: mosaic_scan.grad_scan_chunks(dS, w, kg, qg, do, dvi, decay, cd=jnp.bfloat16,  # noqa: E731
                                                  interpret=True, dhs_dtype=dt)
    with chunk.settings(grad_issue=grad_issue, block_v=block_v):
        full, compact = run(jnp.float32), run(jnp.bfloat16)
    assert compact[0].dtype == jnp.bfloat16 and full[0].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(full[0].astype(jnp.bfloat16), np.float32),
                                  np.asarray(compact[0], np.float32))
    for a, b in zip(full[1:], compact[1:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("delta", [True, False])
def test_compute_dtype_dvn_intra_reads_the_same_values(rng, delta):
    """Aqk^T do in bf16 (what cotangents="compute" passes): the same outputs, bit for bit, as its
    float32 copy, so the kernel only narrows what it reads."""
    N, B, H, K, V = 3, 1, 2, 64, 128
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)  # noqa: E731
    w = f(N, B, H, 64, K) if delta else None
    kg, qg, do, dvi = f(N, B, H, 64, K), f(N, B, H, 64, K), f(N, B, H, 64, V), f(N, B, H, 64, V)
    decay = jnp.asarray(rng.uniform(0.3, 1.0, (N, B, H, K)), jnp.float32)
    dS = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    run = lambda x: mosaic_scan.grad_scan_chunks(dS, w, kg, qg, do, x, decay, cd=jnp.bfloat16,  # noqa: E731
                                                 interpret=True, dhs_dtype=jnp.bfloat16)
    for a, b in zip(run(dvi.astype(jnp.float32)), run(dvi)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_other_dhs_and_dvn_intra_dtypes_are_refused(rng):
    x = jnp.zeros((1, 2, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="dhs_dtype=float16"):
        mosaic_scan.grad_scan(x, x, x, x, jnp.zeros((1, 2, 64, 64)), jnp.zeros((1, 2, 64)), jnp.zeros((2, 64, 64)),
                              interpret=True, dhs_dtype=jnp.float16)
    with pytest.raises(ValueError, match="dvn_intra's dtype=float16"):
        mosaic_scan.grad_scan(x, x, x, x, jnp.zeros((1, 2, 64, 64), jnp.float16), jnp.zeros((1, 2, 64)),
                              jnp.zeros((2, 64, 64)), interpret=True)


@pytest.mark.parametrize("settings", [dict(cotangents="compute"), dict(cotangents="compute", residuals="states_vn"),
                                      dict(cotangents="compute", grad_issue="early", block_v=32)])
def test_training_levers_lower_for_cuda(settings):
    assert cuda_train_module(2, 256, 2, 128, **settings).count("mosaic_gpu") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("seg", [None, "random"])
def test_gpu_training_levers_match_naive(rng, seg):
    """Compiled kernels at a training shape with both levers: every output and gradient within the
    bf16 tolerances of naive."""
    inputs = make_inputs(rng, 2, 4096, 16, 128, 128, "channel", lower=-5.0, seg=seg)
    with chunk.settings(cotangents="compute", residuals="states_vn"):
        _compare(rng, inputs, BF16_TOL, -5.0, jnp.bfloat16)

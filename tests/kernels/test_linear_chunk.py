"""Chunked (gated) linear attention (`impl="chunk"`) against the float64 oracle and the naive impl,
outputs, final states and gradients, for plain, per-head and per-channel gates."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import linear_attention
from kernels.testing import assert_close
from tests.kernels.test_kda_chunk import BF16_TOL, F32_TOL, make_inputs
from tests.oracle import delta_rule_np


@functools.partial(jax.jit, static_argnames=("impl",))
def _fwd_bwd(q, k, v, g, h0, seg, do, dS, *, impl):
    def run(q, k, v, g, h0):
        return linear_attention(q, k, v, g, initial_state=h0, segment_ids=seg, output_final_state=True, impl=impl)

    (o, S), vjp = jax.vjp(run, q, k, v, g, h0)
    return o, S, vjp((do.astype(o.dtype), dS))


@pytest.mark.parametrize(
    "T, gate, dtype",
    [(130, "channel", jnp.float32), (64, "none", jnp.float32), (97, "head", jnp.bfloat16)],
)
def test_linear_chunk_matches_naive(rng, T, gate, dtype):
    q, k, v, g, _, h0, seg = make_inputs(rng, 2, T, 2, 32, 48, gate, seg="edge")
    g = jnp.zeros(q.shape, jnp.float32) if g is None else g  # a zero gate exercises the gradient of g too
    do = rng.standard_normal(v.shape).astype(np.float32)
    dS = rng.standard_normal(h0.shape).astype(np.float32)
    qc, kc, vc = (jnp.asarray(x, dtype) for x in (q, k, v))
    up = lambda x: x.astype(jnp.float32)
    ref = _fwd_bwd(up(qc), up(kc), up(vc), g, h0, seg, do, dS, impl="naive")
    out = _fwd_bwd(qc, kc, vc, g, h0, seg, do, dS, impl="chunk")
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert out[0].dtype == dtype
    assert_close("o", ref[0], out[0], tol["o"])
    assert_close("S", ref[1], out[1], tol["S"])
    for name, r, x in zip(("dq", "dk", "dv", "dg", "dh0"), ref[2], out[2]):
        assert_close(name, r, x, tol[name])


def test_linear_chunk_matches_oracle(rng):
    q, k, v, g, _, h0, seg = make_inputs(rng, 1, 100, 3, 16, 20, "head", lower=-3.0, seg="random")
    o_ref, S_ref = delta_rule_np(q, k, v, g, initial_state=h0, segment_ids=seg, delta=False)
    o, S = linear_attention(q, k, v, g, initial_state=h0, segment_ids=seg, output_final_state=True, impl="chunk")
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)

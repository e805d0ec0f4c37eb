"""The naive (token-serial) reference against the float64 NumPy oracle, and the API's checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kda import kda, kda_gate, kda_step, linear_attention
from kernels.testing import assert_close
from tests.oracle import delta_rule_np


def _inputs(rng, B=2, T=37, H=3, K=16, V=12, gate="channel"):
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = {"none": None, "head": -rng.uniform(0, 1, (B, T, H)), "channel": -rng.uniform(0, 1, (B, T, H, K))}[gate]
    g = None if g is None else g.astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    seg = np.cumsum(rng.uniform(size=(B, T)) < 0.1, axis=1).astype(np.int32)
    return q, k, v, g, beta, h0, seg


@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_naive_matches_oracle(rng, gate):
    q, k, v, g, beta, h0, seg = _inputs(rng, gate=gate)
    o, S = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True, impl="naive")
    o_ref, S_ref = delta_rule_np(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


def test_linear_attention_naive_matches_oracle(rng):
    q, k, v, g, _, h0, seg = _inputs(rng)
    o, S = linear_attention(q, k, v, g, initial_state=h0, segment_ids=seg, output_final_state=True, impl="naive")
    o_ref, S_ref = delta_rule_np(q, k, v, g, initial_state=h0, segment_ids=seg, delta=False)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)


def test_step_matches_full_sequence(rng):
    q, k, v, g, beta, h0, _ = _inputs(rng, T=9)
    o_full, S_full = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl="naive")
    S = jnp.asarray(h0)
    for t in range(q.shape[1]):
        o_t, S = kda_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        assert_close(f"o[{t}]", o_full[:, t], o_t, 1e-6)
    assert_close("S", S_full, S, 1e-6)


def test_gate_forms():
    z = jnp.linspace(-30.0, 30.0, 2 * 3 * 4).reshape(2, 3, 4)
    A_log = jnp.log(jnp.array([1.0, 2.0, 4.0]))
    dt = jnp.full((3, 4), 0.5)
    g = kda_gate(z, A_log, dt)
    x = np.asarray(z, np.float64) + 0.5
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    assert_close("softplus gate", -np.array([1.0, 2.0, 4.0])[:, None] * sp, g, 1e-6)
    gb = kda_gate(z, A_log, dt, lower_bound=-5.0)
    ref = -5.0 / (1.0 + np.exp(-np.array([1.0, 2.0, 4.0])[:, None] * x))
    assert_close("bounded gate", ref, gb, 1e-6)
    assert float(gb.min()) >= -5.0 and float(gb.max()) <= 0.0


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=np.zeros((2, 4, 3))), "q must be"),
        (dict(v=np.zeros((2, 5, 3, 8), np.float32)), "v must be"),
        (dict(g=np.zeros((2, 4, 3, 7), np.float32)), "g must be"),
        (dict(g=np.full((2, 4, 3), 0.5, np.float32)), "g must be <= 0"),
        (dict(beta=np.zeros((2, 4), np.float32)), "beta must be"),
        (dict(initial_state=np.zeros((2, 3, 16, 9), np.float32)), "initial_state must be"),
        (dict(q=np.zeros((2, 4, 3, 16), np.int32), k=np.zeros((2, 4, 3, 16), np.int32)), "unsupported dtype"),
        (dict(impl="cuda"), "Unknown impl"),
    ],
)
def test_bad_input_raises(bad, match):
    args = dict(
        q=np.zeros((2, 4, 3, 16), np.float32),
        k=np.zeros((2, 4, 3, 16), np.float32),
        v=np.zeros((2, 4, 3, 8), np.float32),
        g=None,
        beta=None,
        initial_state=None,
        impl="naive",
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kda(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), **args)


def test_naive_grads_exist_for_all_inputs(rng):
    q, k, v, g, beta, h0, _ = _inputs(rng, T=5)

    def loss(q, k, v, g, beta, h0):
        o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl="naive")
        return jnp.sum(o**2) + jnp.sum(S**2)

    grads = jax.grad(loss, argnums=range(6))(q, k, v, g, beta, h0)
    for x, dx in zip((q, k, v, g, beta, h0), grads):
        assert dx.shape == x.shape and np.all(np.isfinite(dx)) and np.any(dx != 0)


@pytest.mark.parametrize("platform,kind,want,want_step", [
    ("cpu", "cpu", "chunk", "naive"),
    ("gpu", "hopper", "chunk_mosaic", "pallas_gpu"),
    ("gpu", "other", "chunk", "naive"),
    ("tpu", "other", "pallas_tpu", "naive"),
])
def test_auto_resolves_per_platform(monkeypatch, platform, kind, want, want_step):
    from kernels.kda import hopper, ops

    monkeypatch.setattr(ops, "_platform", lambda: platform)
    monkeypatch.setattr(hopper, "device_kind", lambda: kind)
    assert ops.resolve_impl("auto") == want
    assert ops.resolve_impl("auto", ops.LINEAR_IMPLS) == "chunk"
    assert ops.resolve_step_impl("auto") == want_step
    assert ops.resolve_impl("chunk") == "chunk"


@pytest.mark.parametrize("name", ["state", "g", "beta"])
def test_step_rejects_integer_state_gate_and_beta(name):
    B, H, K, V = 1, 2, 4, 4
    args = dict(state=jnp.zeros((B, H, K, V)), q=jnp.ones((B, H, K)), k=jnp.ones((B, H, K)), v=jnp.ones((B, H, V)),
                g=-jnp.ones((B, H)), beta=jnp.ones((B, H)))
    kda_step(**args)
    args[name] = args[name].astype(jnp.int32)
    with pytest.raises(ValueError, match=f"{name} has unsupported dtype int32"):
        kda_step(**args)


@pytest.mark.parametrize("delta", [True, False])
def test_blocked_scan_matches_oracle_and_plain_gradients(rng, delta, monkeypatch):
    """Past REMAT_BLOCK * 4 tokens the scan runs over checkpointed blocks (T = 150 here, not a
    multiple of the block): the oracle's values, and the plain scan's gradients of every input."""
    from kernels.kda import naive

    monkeypatch.setattr(naive, "REMAT_BLOCK", 16)
    q, k, v, g, beta, h0, seg = _inputs(rng, B=1, T=150, H=2, K=8, V=4)
    if delta:
        run = lambda *a: kda(*a, initial_state=h0, segment_ids=seg, output_final_state=True, impl="naive")
        args = (q, k, v, g, beta)
        o_ref, S_ref = delta_rule_np(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    else:
        run = lambda *a: linear_attention(*a, initial_state=h0, segment_ids=seg, output_final_state=True,
                                          impl="naive")
        args = (q, k, v, g)
        o_ref, S_ref = delta_rule_np(q, k, v, g, initial_state=h0, segment_ids=seg, delta=False)
    o, S = run(*args)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("S", S_ref, S, 1e-5)
    loss = lambda *a: jnp.sum(run(*a)[0] * o_ref) + jnp.sum(run(*a)[1] * S_ref)
    blocked = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    monkeypatch.setattr(naive, "REMAT_BLOCK", 64)  # 150 <= 4 * 64: the plain scan
    plain = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    for name, a, b in zip("qkvgb", plain, blocked):
        assert_close(f"d{name}", a, b, 1e-6)


def test_blocked_scan_keeps_one_state_per_block():
    """The backward's buffers at T = 4096 stay far below the plain scan's T per-token states."""
    from kernels.kda import naive

    B, T, H, K, V = 1, 4096, 1, 32, 32
    x = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    loss = lambda q, k, v, g: jnp.sum(kda(q, k, v, g, jnp.ones((B, T, H)), impl="naive")[0])
    temp = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, jax.ShapeDtypeStruct((B, T, H, V), jnp.float32),
                                                            x).compile().memory_analysis().temp_size_in_bytes
    state = B * H * K * V * 4
    assert temp < T * state / 4, (temp, T * state, naive.REMAT_BLOCK)

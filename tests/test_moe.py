"""MoE: dispatch strategies agree (outputs and gradients), routing semantics, and the three
load-balancing methods (quantile balancing, DeepSeek's bias update, the sequence-wise loss)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax import moe_balance, moe_dispatch
from kimi_jax.config import MoEConfig
from kimi_jax.ffn import glu_activation, situ_glu
from kimi_jax.moe import MoE, RouterBias, apply_balancing
from kimi_jax.moe_dispatch import (ExpertWeights, combine_rows, dispatch_fn, gather_pairs, inverse_permutation, pair_sort,
                                   permute_rows, sort_by_expert, sort_pairs)
from tests.jaxprs import equations


def _experts(key, E=6, D=8, F=12):
    k1, k2, k3 = jax.random.split(key, 3)
    return ExpertWeights(jax.random.normal(k1, (E, D, F)) / D**0.5,
                         jax.random.normal(k2, (E, D, F)) / D**0.5,
                         jax.random.normal(k3, (E, F, D)) / F**0.5)


@pytest.mark.parametrize("activation,sort", [("swiglu", "argsort"), ("situ", "argsort"), ("situ", "counting")])
def test_dense_and_ragged_dispatch_agree_with_gradients(activation, sort):
    key = jax.random.key(0)
    N, E, k, D = 10, 6, 2, 8
    x = jax.random.normal(jax.random.fold_in(key, 1), (N, D))
    # Few tokens, experts 4 and 5 never chosen: empty groups must work.
    idx = jax.random.randint(jax.random.fold_in(key, 2), (N, k), 0, 4)
    idx = idx.at[:, 1].set((idx[:, 0] + 1) % 4)
    w = jax.random.uniform(jax.random.fold_in(key, 3), (N, k))
    experts = _experts(jax.random.fold_in(key, 4), E, D)
    act = glu_activation(activation)

    def loss(name, x, w, experts):
        y = dispatch_fn(name)(x, idx, w, experts, act)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (_, y_dense), g_dense = grad("dense", x, w, experts)
    with pair_sort(sort):  # read while tracing
        (_, y_ragged), g_ragged = grad("ragged", x, w, experts)
    np.testing.assert_allclose(y_ragged, y_dense, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_ragged)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    # And the reference itself against a per-token loop.
    for n in range(N):
        ref = sum(float(w[n, j]) * _expert_np(x[n], experts, int(idx[n, j]), act) for j in range(k))
        np.testing.assert_allclose(y_dense[n], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,k,E", [(10, 2, 6), (257, 2, 8), (5, 3, 3), (1, 1, 1)])
def test_counting_sort_equals_the_stable_argsort(N, k, E, monkeypatch):
    """PAIR_SORT="counting" gives argsort's stable order, its inverse and the group sizes (the last
    expert never chosen where E > 1); past COUNTING_MAX_ELEMENTS it refuses."""
    idx = jax.random.randint(jax.random.key(N), (N, k), 0, max(E - 1, 1))
    flat = np.asarray(idx).reshape(-1)
    for mode in ("argsort", "counting"):
        with pair_sort(mode):
            order, inverse, sizes = jax.jit(sort_pairs, static_argnums=1)(idx, E)
        assert np.asarray(order).tolist() == np.argsort(flat, kind="stable").tolist(), mode
        assert np.asarray(inverse).tolist() == np.argsort(np.asarray(order)).tolist(), mode
        assert np.asarray(sizes).tolist() == np.bincount(flat, minlength=E).tolist(), mode
    monkeypatch.setattr(moe_dispatch, "COUNTING_MAX_ELEMENTS", N * k * E - 1)
    with pair_sort("counting"), pytest.raises(ValueError, match="argsort"):
        sort_pairs(idx, E)
    # "auto" (the default): counting while the one-hot fits, argsort past it; the same order.
    assert moe_dispatch.PAIR_SORT == "auto"
    assert moe_dispatch.resolve_pair_sort(N * k, E) == "argsort"
    assert moe_dispatch.resolve_pair_sort(N * k - 1, E) == "counting"
    monkeypatch.setattr(moe_dispatch, "COUNTING_MAX_ELEMENTS", N * k * E)
    assert moe_dispatch.resolve_pair_sort(N * k, E) == "counting"
    order, _, _ = sort_pairs(idx, E)
    assert np.asarray(order).tolist() == np.argsort(flat, kind="stable").tolist()
    with pytest.raises(ValueError, match="PAIR_SORT"):
        with pair_sort("radix"):
            pass


def _primitives(jaxpr):
    return {e.primitive.name for e in equations(jaxpr)}


def test_pair_gathers_have_gather_backwards_equal_to_autodiff():
    """gather_pairs / permute_rows against the plain gathers' autodiff (a scatter-add), with no
    scatter left in their backward."""
    key = jax.random.key(5)
    N, k, E, D = 7, 3, 4, 5
    idx = jax.random.randint(jax.random.fold_in(key, 1), (N, k), 0, E)
    order, token, _ = sort_by_expert(idx, E)
    inverse = inverse_permutation(order)
    assert np.asarray(inverse).tolist() == np.argsort(np.asarray(order)).tolist()
    x = jax.random.normal(jax.random.fold_in(key, 2), (N, D))
    ct = jax.random.normal(jax.random.fold_in(key, 3), (N * k, D))
    ours = lambda x: jnp.vdot(ct, jnp.sin(permute_rows(gather_pairs(x, order, inverse), inverse, order)))  # noqa: E731
    plain = lambda x: jnp.vdot(ct, jnp.sin(x[token][inverse]))  # noqa: E731
    np.testing.assert_allclose(ours(x), plain(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6)
    assert np.asarray(gather_pairs(x, order, inverse)).tolist() == np.asarray(x[order // k]).tolist()
    assert "scatter-add" in _primitives(jax.make_jaxpr(jax.grad(plain))(x).jaxpr)
    prims = _primitives(jax.make_jaxpr(jax.grad(ours))(x).jaxpr)
    assert not {p for p in prims if p.startswith("scatter")}, prims
    with pytest.raises(ValueError, match="multiple"):
        gather_pairs(x, order[:-1], inverse[:-1])


def test_combine_rows_matches_the_plain_weighted_sum_with_dropped_pairs():
    """combine_rows against autodiff of the un-permute and einsum it replaces: values and both
    gradients, with two pairs dropped (src out of range: zero rows) and a spare row that holds no
    pair (dst out of range: zero gradient); its backward has no scatter and no batched product."""
    key = jax.random.key(7)
    N, k, D, R = 6, 3, 5, 20
    perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1), R))
    src = perm[:N * k].copy()
    src[[2, 7]] = R  # dropped pairs
    dst = np.full(R, N * k)
    kept = src < R
    dst[src[kept]] = np.arange(N * k)[kept]
    src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
    rows = jax.random.normal(jax.random.fold_in(key, 2), (R, D), jnp.bfloat16)
    w = jax.random.uniform(jax.random.fold_in(key, 3), (N, k))
    ct = jax.random.normal(jax.random.fold_in(key, 4), (N, D))

    def plain(rows, w):
        y = jnp.take(rows, src, axis=0, mode="fill", fill_value=0).reshape(N, k, D).astype(jnp.float32)
        return jnp.vdot(ct, jnp.einsum("nkd,nk->nd", y, w))

    ours = lambda rows, w: jnp.vdot(ct, combine_rows(rows, src, w, dst))  # noqa: E731
    np.testing.assert_allclose(ours(rows, w), plain(rows, w), rtol=1e-5)
    (dr, dw), (pr, pw) = jax.grad(ours, argnums=(0, 1))(rows, w), jax.grad(plain, argnums=(0, 1))(rows, w)
    assert dr.dtype == jnp.bfloat16 and dw.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(dr, np.float32), np.asarray(pr, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dw, pw, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(dr, np.float32)[np.asarray(dst) >= N * k]), "rows with no pair get no gradient"
    assert not np.any(np.asarray(dw).reshape(-1)[[2, 7]]), "dropped pairs' weights get no gradient"
    _, vjp = jax.vjp(lambda r, w: combine_rows(r, src, w, dst), rows, w)
    prims = _primitives(jax.make_jaxpr(vjp)(ct).jaxpr)
    assert not {p for p in prims if p.startswith("scatter")} and "dot_general" not in prims, prims
    with pytest.raises(ValueError, match="one entry per row"):
        combine_rows(rows, src, w, dst[:-1])


def _expert_np(x, w: ExpertWeights, e, act):
    h = act(x @ w.gate[e], x @ w.up[e])
    return np.asarray(h @ w.down[e])


def test_latent_moe_module_dispatches_agree_and_routes_with_unbiased_weights():
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=2,
                    latent_dim=12, routed_scaling_factor=2.5, dispatch="dense")
    dense = MoE(24, cfg, activation="situ", rngs=nnx.Rngs(0))
    ragged = MoE(24, dataclasses.replace(cfg, dispatch="ragged"), activation="situ", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 24))
    y_d, _ = dense(x)
    y_r, _ = ragged(x)
    np.testing.assert_allclose(y_r, y_d, rtol=1e-5, atol=1e-5)

    def loss(m, x):
        return jnp.sum(m(x)[0] ** 2)

    g_d = nnx.jit(nnx.grad(loss))(dense, x)
    g_r = nnx.jit(nnx.grad(loss))(ragged, x)
    for a, b in zip(jax.tree.leaves(g_d), jax.tree.leaves(g_r)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)

    # A huge bias on expert 3 forces its selection but not its weight (selection only).
    dense.router.bias[...] = jnp.zeros(8).at[3].set(100.0)
    flat = x.reshape(10, 24)
    scores, idx, _ = dense.router(flat, 2)
    assert bool(jnp.all(idx[:, 0] == 3))
    assert isinstance(dense.router.bias, RouterBias) and not isinstance(dense.router.bias, nnx.Param)
    assert len(nnx.state(dense, nnx.Param).flat_state()) > 0
    assert "bias" not in str(nnx.state(dense.router, nnx.Param))


def test_routing_weights_are_renormalised_unbiased_scores():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, routed_scaling_factor=2.0)
    m = MoE(6, cfg, rngs=nnx.Rngs(0))
    m.router.bias[...] = jnp.array([0.0, 5.0, 0.0, 0.0])
    x = jax.random.normal(jax.random.key(0), (3, 6))
    scores, idx, weights, values = m.route(x)
    np.testing.assert_allclose(scores, jax.nn.sigmoid(x @ m.router.proj.kernel[...]), rtol=1e-6)
    assert bool(jnp.all(idx[:, 0] == 1))  # the bias decides the selection...
    s = jnp.take_along_axis(scores, idx, axis=1)  # ...but the weights are unbiased scores
    np.testing.assert_allclose(weights, 2.0 * s / s.sum(1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(values[:, 0], scores[:, 1] + 5.0, rtol=1e-6)
    third = jnp.sort(scores + m.router.bias[...], axis=1)[:, -3]  # the cutoff: (k+1)-th biased
    np.testing.assert_allclose(values[:, 2], third, rtol=1e-6)


def test_unknown_dispatch_and_balancing_raise():
    with pytest.raises(ValueError, match="Unknown moe.dispatch='nope'"):
        MoEConfig(num_experts=4, top_k=2, expert_hidden=8, dispatch="nope")
    with pytest.raises(ValueError, match="Unknown moe.balancing"):
        MoEConfig(num_experts=4, top_k=2, expert_hidden=8, balancing="loss")
    with pytest.raises(ValueError, match="top_k=5 exceeds"):
        MoEConfig(num_experts=4, top_k=5, expert_hidden=8)
    with pytest.raises(ValueError, match="Unknown dispatch='x'"):
        dispatch_fn("x")


def _skewed_scores(step, N=2048, E=16):
    key = jax.random.fold_in(jax.random.key(7), step)
    skew = jnp.linspace(-3.0, 3.0, E)
    return jax.nn.sigmoid(jax.random.normal(key, (N, E)) + skew)


def test_quantile_balancing_balances_a_skewed_router_in_a_few_updates():
    E, k = 16, 2
    bias = jnp.zeros(E)
    ratios = []

    @jax.jit
    def step(s, bias):  # route with the current bias, then estimate the next one
        values, idx = jax.lax.top_k(s + bias, k + 1)
        ratio = moe_balance.load_metrics(moe_balance.expert_load(idx[:, :k], E))[0]
        return ratio, moe_balance.quantile_bias(s, values[:, k], bias, k, num_bins=1000)

    for i in range(6):
        ratio, bias = step(_skewed_scores(i, E=E), bias)  # a fresh batch each step, same skew
        ratios.append(float(ratio))
        assert abs(float(bias.mean())) < 1e-5  # mean-centred
    assert ratios[0] > 4.0, ratios  # badly skewed before
    assert max(ratios[3:]) < 1.3, ratios  # near balance after a few updates (batch noise ~5%)
    s = _skewed_scores(99, E=E)  # on one batch the fixed point is balanced
    for _ in range(6):
        ratio, bias = step(s, bias)
    assert float(ratio) < 1.1, float(ratio)


def test_apply_balancing_through_the_module():
    E = 8
    cfg = MoEConfig(num_experts=E, top_k=2, expert_hidden=8, balancing="quantile")
    m = MoE(4, cfg, rngs=nnx.Rngs(0))
    kernel = jax.random.normal(jax.random.key(9), (4, E))
    m.router.proj.kernel[...] = kernel.at[0].set(jnp.linspace(-3, 3, E))  # x[..., 0] = 1: a skew
    forward = nnx.jit(lambda m, x: m(x)[1])
    ratios = []
    for step in range(6):
        x = jax.random.normal(jax.random.key(step), (4, 256, 4)).at[..., 0].set(1.0)
        stats = forward(m, x)
        ratios.append(float(stats["max_over_mean"]))
        aux = {"moe_load": stats["load"][None], "moe_bias_target": stats["bias_target"][None]}
        apply_balancing(m, aux)
    assert ratios[0] > 2.5 and max(ratios[3:]) < 1.3, ratios


def test_deepseek_bias_update_moves_biases_towards_balance():
    load = jnp.array([0.5, 0.1, 0.2, 0.2])
    new = moe_balance.aux_free_update(jnp.zeros(4), load, 1e-3)
    np.testing.assert_allclose(new, [-1e-3, 1e-3, 1e-3, 1e-3])
    cfg = MoEConfig(num_experts=4, top_k=1, expert_hidden=8, balancing="aux_free", balance_rate=0.01)
    m = MoE(4, cfg, rngs=nnx.Rngs(0))
    apply_balancing(m, {"moe_load": load[None], "moe_bias_target": jnp.zeros((1, 4))})
    np.testing.assert_allclose(m.router.bias[...], [-0.01, 0.01, 0.01, 0.01])
    with pytest.raises(ValueError, match="statistics for 2 MoE layers"):
        apply_balancing(m, {"moe_load": jnp.zeros((2, 4)), "moe_bias_target": jnp.zeros((2, 4))})


def test_sequence_aux_loss_matches_hand_computation():
    scores = jnp.array([[[0.9, 0.5, 0.1], [0.2, 0.8, 0.6]]])  # B=1, T=2, E=3
    idx = jnp.array([[[0], [1]]])  # k=1
    # f_i = E / (k T) * count_i = 1.5 * [1, 1, 0]; P_i = mean_t s_ti / sum_j s_tj.
    p = (np.array([0.9, 0.5, 0.1]) / 1.5 + np.array([0.2, 0.8, 0.6]) / 1.6) / 2
    expected = 0.01 * (1.5 * p[0] + 1.5 * p[1])
    got = moe_balance.sequence_aux_loss(scores, idx, top_k=1, coef=0.01)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # The module returns it (with a gradient to the router) only for balancing="aux_loss".
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, balancing="aux_loss", aux_loss_coef=0.1)
    m = MoE(4, cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    grads = nnx.grad(lambda m: m(x)[1]["aux_loss"])(m)
    assert float(jnp.abs(grads.router.proj.kernel[...]).sum()) > 0


def test_situ_glu_bounds_and_limit():
    g = jnp.linspace(-50, 50, 101)
    out = situ_glu(g, g)
    assert float(jnp.abs(out).max()) <= 100.0
    small = jnp.linspace(-0.5, 0.5, 11)
    big = situ_glu(small, small, beta=1e6, linear_beta=1e6)
    np.testing.assert_allclose(big, jax.nn.silu(small) * small, rtol=1e-5, atol=1e-7)

"""kernels/vma.py: a custom VJP inside shard_map with its varying-axes check on, as the Pallas
grouped matmuls run in expert_parallel. Its operands cast to one type first, the gradient of a
weight replicated over the data axis is the sum of every shard's part (the cast's transpose), equal
to the single-device gradient; without the cast the rule's cotangent types do not match."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from kernels import vma
from kernels.testing import assert_close


@jax.custom_vjp
def _matmul(x, w):
    return x @ w


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _matmul_bwd(res, dy):
    x, w = res
    return dy @ w.T, x.T @ dy


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _loss(x, w, align):
    def shard(x, w):
        if align:
            x, w = vma.same_varying(x, w)
        return jax.lax.psum(jnp.sum(jnp.sin(_matmul(x, w))), "data")

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    return jax.shard_map(shard, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())(x, w)


def test_replicated_weight_gradient_is_summed_over_shards():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(functools.partial(_loss, align=True), argnums=(0, 1)))(x, w)
    for name, a, b in zip(("dx", "dw"), want, got):
        assert_close(name, a, b, 1e-6)
    with pytest.raises(Exception, match="manual axis types|vma|varying"):
        jax.jit(jax.grad(functools.partial(_loss, align=False), argnums=(0, 1)))(x, w)


def test_kernel_outputs_take_the_inputs_axes_and_are_no_ops_outside():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    seen = {}

    def shard(x, w):
        out = vma.kernel_outputs(jnp.zeros((2,)), x, w)  # a constant stands in for a kernel's result
        seen["out"], seen["w"] = vma.varying_axes(out), vma.varying_axes(w)
        return x

    jax.shard_map(shard, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(jnp.ones(4), jnp.ones(3))
    assert seen == {"out": frozenset({"data"}), "w": frozenset()}
    z = jnp.zeros(3)
    assert vma.kernel_outputs(z, jnp.ones(2)) is z and vma.varying_axes(z) == frozenset()

"""Run `kernels.kda.kda` under a (data=2, tensor=2, fsdp=2) mesh of the 8 fake CPU devices, with
inputs sharded over batch and heads, beside the unsharded naive reference."""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from kernels.kda import kda
from kimi_jax.sharding import make_mesh


def kda_on_mesh(impl, q, k, v, g, beta, h0, seg):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; h0 [B, H, K, V]; seg [B, T] (B, H
    even) -> ((o, S) of `impl` on the mesh, (o, S) of impl="naive" unsharded)."""
    mesh = make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    x4 = P("data", None, "tensor", None)
    args = (put(q, x4), put(k, x4), put(v, x4), put(g, x4), put(beta, P("data", None, "tensor")))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda *a: kda(*a, initial_state=put(h0, P("data", "tensor")), segment_ids=seg,
                                   output_final_state=True, impl=impl))
        got = f(*args)
    ref = kda(q, k, v, g, beta, initial_state=h0, segment_ids=seg, output_final_state=True, impl="naive")
    return got, ref

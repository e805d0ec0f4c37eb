"""Every Mosaic GPU kernel launch carries its own name (`kernel_name=`): profiles list kernels by
that name (`<name>_mosaic_gpu_kernel`) and Mosaic GPU's profiler names its trace files after it, so
an unnamed body ("anonymous", or a wrapper's "scoped" / "body") hides which kernel took the time.
Traced (not run) as on a Hopper GPU, at small shapes."""

import jax
import jax.numpy as jnp
import pytest

from kernels.gmm import glu
from kernels.gmm import ops as gmm_ops
from kernels.kda import hopper, kda, kda_step, mosaic_intra_bf16
from kernels.mxfp4 import format as mxfp4_format
from kernels.mxfp4 import ops as mxfp4_ops
from kernels.short_conv import ops as conv_ops
from kernels.short_conv import pallas_gpu as conv_gpu
from tests.jaxprs import equations

GENERIC = {"anonymous", "body", "scoped", "kernel_body", "wrapper"}
sds = jax.ShapeDtypeStruct
bf16, f32 = jnp.bfloat16, jnp.float32


def _kernel_names(fn, *args) -> list[str]:
    with hopper.assume_device_kind("hopper"):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e.params["name"] for e in equations(jaxpr) if e.primitive.name == "mpmd_map"]


def _kda_args(B=1, T=128, H=2, D=64):
    return (sds((B, T, H, D), bf16),) * 3 + (sds((B, T, H, D), f32), sds((B, T, H), f32))


def _kda_train(*a):
    return jax.grad(lambda *x: jnp.sum(kda(*x, lower_bound=-5.0, impl="chunk_mosaic")[0].astype(f32)),
                    argnums=(0, 1, 2, 3, 4))(*a)


def _gmm_train(x, w, sizes):
    return jax.grad(lambda x, w: jnp.sum(gmm_ops.gmm(x, w, sizes, impl="pallas_gpu").astype(f32)), argnums=(0, 1))(x, w)


def _ffn_train(x, wg, wu, wd, sizes):
    loss = lambda *a: jnp.sum(glu.glu_ffn(*a, sizes, kind="situ", impl="pallas_gpu", fusion="ffn").astype(f32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)


def _mxfp4(x, w, sizes):
    packed, scales = mxfp4_format.quantize(w)
    return mxfp4_ops.gmm(x, packed, scales, sizes, impl="pallas_gpu")


M, D, F, G = 256, 64, 64, 2
CASES = {
    # state_chain="auto" runs the register chain here: a few programs, fewer than the SMs
    "kda forward": (lambda *a: kda(*a, lower_bound=-5.0, impl="chunk_mosaic")[0], _kda_args(),
                    {"kda_intra_bf16", "kda_mosaic_state_regs_body"}),
    "kda intra bf16": (lambda q, k, v, g, b: mosaic_intra_bf16.intra_bf16(q, k, v, g, jnp.moveaxis(b, 1, 2), scale=0.125),
                       _kda_args(), {"kda_intra_bf16"}),
    # the forward pass that forms o (chunk_output.FORWARD_STATE "output") is the state kernel
    "kda train": (_kda_train, _kda_args(), {"kda_intra_bf16", "kda_mosaic_state_body", "kda_mosaic_scan_bwd_body",
                                            "kda_wy_bwd", "kda_prep_bwd"}),
    "kda decode": (lambda *a: kda_step(*a, impl="pallas_gpu"),
                   (sds((4, 2, 64, 64), f32),) + (sds((4, 2, 64), bf16),) * 3 + (sds((4, 2, 64), f32), sds((4, 2), f32)),
                   {"kda_decode"}),
    "short conv": (lambda x, dy, w: conv_gpu.tap_grads(x, dy, w, conv_ops.tap_masks(None, 1, 256, 4)),
                   (sds((1, 256, 128), bf16),) * 2 + (sds((4, 128), f32),), {"short_conv_tap_grads"}),
    "gmm": (_gmm_train, (sds((M, D), bf16), sds((G, D, F), bf16), sds((G,), jnp.int32)), {"gmm", "tgmm"}),
    "ffn": (_ffn_train, (sds((M, D), bf16), sds((G, D, F), bf16), sds((G, D, F), bf16), sds((G, F, D), bf16),
                         sds((G,), jnp.int32)), {"ffn_fwd", "ffn_bwd_rows", "tgmm"}),
    "mxfp4 gmm": (_mxfp4, (sds((M, D), bf16), sds((G, F, D), f32), sds((G,), jnp.int32)), {"mxfp4_gmm"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_launch_is_named(case):
    fn, args, want = CASES[case]
    names = _kernel_names(fn, *args)
    assert names, f"{case}: no Mosaic GPU kernel traced"
    assert set(names) == want, names
    assert not GENERIC & set(names)

"""Feed-forward blocks: SwiGLU and K3's SiTU-GLU, and the dense gated MLP.

SiTU-GLU (K3 §2.5): a = b1 tanh(g / b1) sigmoid(g), u' = b2 tanh(u / b2), out = a u', computed in
float32 with b1 = 4, b2 = 25, so |out| <= 100 (it bounds activations for MXFP8 QAT). As b -> inf it
becomes SwiGLU, silu(g) u.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.gmm.glu_math import glu_backward, glu_forward
from kimi_jax.layers import Linear, read_setting, traced_setting
from kimi_jax.sharding import constrain

# How a GLU is differentiated: "autodiff" (JAX's linearization: it keeps float32 intermediates
# of the activation, up to seven [.., F] arrays per call for SiTU-GLU) or "recompute" (a custom
# VJP that keeps only gate and up in their own dtype and recomputes the activation's derivative
# in the backward). Read while tracing; `glu_vjp(mode)` sets it for a block. On an H200 the 1.3B
# train step took 406.2 ms with "recompute" against 409.4 with "autodiff", the same temporaries
# (benchmarks/results/train-vjp-*-h200x2-20261130T2217.json; within the spread): XLA's fusion
# already keeps only what the custom VJP keeps, so the default stays.
GLU_VJP = "autodiff"
GLU_VJP_MODES = ("autodiff", "recompute")


def glu_vjp(mode: str | None):
    """Within the block, trace GLUs with backward `mode` (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "GLU_VJP", GLU_VJP_MODES, mode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _glu_recompute(kind, gate, up, beta, linear_beta):
    return glu_forward(kind, gate, up, beta, linear_beta)


def _glu_recompute_fwd(kind, gate, up, beta, linear_beta):
    return glu_forward(kind, gate, up, beta, linear_beta), (gate, up)


def _glu_recompute_bwd(kind, beta, linear_beta, res, ct):
    gate, up = res
    dg, du = glu_backward(kind, gate, up, ct, beta, linear_beta)
    return dg.astype(gate.dtype), du.astype(up.dtype)


_glu_recompute.defvjp(_glu_recompute_fwd, _glu_recompute_bwd)


def _differentiated(kind: str, gate, up, beta: float, linear_beta: float):
    if read_setting(sys.modules[__name__], "GLU_VJP", GLU_VJP_MODES) == "recompute":
        return _glu_recompute(kind, gate, up, float(beta), float(linear_beta))
    return glu_forward(kind, gate, up, beta, linear_beta)


def swiglu(gate, up):
    """silu(gate) * up in float32."""
    return _differentiated("swiglu", gate, up, 0.0, 0.0)


def situ_glu(gate, up, *, beta: float = 4.0, linear_beta: float = 25.0):
    """K3's bounded GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta), float32."""
    return _differentiated("situ", gate, up, beta, linear_beta)


@dataclasses.dataclass(frozen=True)
class GLU:
    """A resolved activation: (gate, up) -> hidden in float32. `kind`, `beta` and `linear_beta`
    name it for the fused expert kernels (`kernels.gmm.glu_ffn`)."""

    kind: str
    beta: float = 0.0
    linear_beta: float = 0.0

    def __call__(self, gate, up):
        return _differentiated(self.kind, gate, up, self.beta, self.linear_beta)


def glu_activation(name: str, *, beta: float = 4.0, linear_beta: float = 25.0) -> GLU:
    """The one place an FFN activation name is resolved: (gate, up) -> hidden, float32."""
    if name == "swiglu":
        return GLU("swiglu")
    if name == "situ":
        return GLU("situ", float(beta), float(linear_beta))
    raise ValueError(f"Unknown activation={name!r}; expected one of ['situ', 'swiglu']")


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x), up(x))). x [..., D] -> [..., D]; hidden [..., F]."""

    def __init__(self, d_model: int, hidden: int, *, activation: str = "swiglu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                 in_axis: str = "embed", dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        glu_activation(activation)  # fail at build time on an unknown name
        self.activation = (activation, situ_beta, situ_linear_beta)
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = Linear(d_model, hidden, axes=(in_axis, "mlp"), **kw)
        self.up = Linear(d_model, hidden, axes=(in_axis, "mlp"), **kw)
        self.down = Linear(hidden, d_model, axes=("mlp", in_axis), **kw)

    def __call__(self, x):
        name, beta, linear_beta = self.activation
        act = glu_activation(name, beta=beta, linear_beta=linear_beta)
        h = act(self.gate(x), self.up(x)).astype(self.dtype)
        if h.ndim == 3:
            h = constrain(h, ("act_batch", "act_len", "act_mlp"))
        return self.down(h)

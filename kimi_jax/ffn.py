"""Feed-forward blocks: SwiGLU and K3's SiTU-GLU, and the dense gated MLP.

SiTU-GLU (K3 §2.5): a = b1 tanh(g / b1) sigmoid(g), u' = b2 tanh(u / b2), out = a u', computed in
float32 with b1 = 4, b2 = 25, so |out| <= 100 (it bounds activations for MXFP8 QAT). As b -> inf it
becomes SwiGLU, silu(g) u.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

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


def _glu(kind: str, gate, up, beta: float, linear_beta: float):
    """The activation in float32 (see swiglu / situ_glu)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if kind == "swiglu":
        return jax.nn.silu(gate) * up
    act = beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
    return act * (linear_beta * jnp.tanh(up / linear_beta))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _glu_recompute(kind, gate, up, beta, linear_beta):
    return _glu(kind, gate, up, beta, linear_beta)


def _glu_recompute_fwd(kind, gate, up, beta, linear_beta):
    return _glu(kind, gate, up, beta, linear_beta), (gate, up)


def _glu_recompute_bwd(kind, beta, linear_beta, res, ct):
    gate, up = res
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    if kind == "swiglu":  # d/dg [g s(g)] = s (1 + g (1 - s))
        dg, du = ct * u * s * (1 + g * (1 - s)), ct * g * s
    else:  # a = beta tanh(g / beta) s(g), u' = linear_beta tanh(u / linear_beta)
        t1, t2 = jnp.tanh(g / beta), jnp.tanh(u / linear_beta)
        da = (1 - t1 * t1) * s + beta * t1 * s * (1 - s)
        dg, du = ct * linear_beta * t2 * da, ct * beta * t1 * s * (1 - t2 * t2)
    return dg.astype(gate.dtype), du.astype(up.dtype)


_glu_recompute.defvjp(_glu_recompute_fwd, _glu_recompute_bwd)


def _differentiated(kind: str, gate, up, beta: float, linear_beta: float):
    if read_setting(sys.modules[__name__], "GLU_VJP", GLU_VJP_MODES) == "recompute":
        return _glu_recompute(kind, gate, up, float(beta), float(linear_beta))
    return _glu(kind, gate, up, beta, linear_beta)


def swiglu(gate, up):
    """silu(gate) * up in float32."""
    return _differentiated("swiglu", gate, up, 0.0, 0.0)


def situ_glu(gate, up, *, beta: float = 4.0, linear_beta: float = 25.0):
    """K3's bounded GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta), float32."""
    return _differentiated("situ", gate, up, beta, linear_beta)


def glu_activation(name: str, *, beta: float = 4.0, linear_beta: float = 25.0):
    """The one place an FFN activation name is resolved: (gate, up) -> hidden, float32."""
    if name == "swiglu":
        return swiglu
    if name == "situ":
        return functools.partial(situ_glu, beta=beta, linear_beta=linear_beta)
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

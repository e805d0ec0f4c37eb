"""Feed-forward blocks: SwiGLU and K3's SiTU-GLU, and the dense gated MLP.

SiTU-GLU (K3 §2.5): a = b1 tanh(g / b1) sigmoid(g), u' = b2 tanh(u / b2), out = a u', computed in
float32 with b1 = 4, b2 = 25, so |out| <= 100 (it bounds activations for MXFP8 QAT). As b -> inf it
becomes SwiGLU, silu(g) u.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.layers import Linear
from kimi_jax.sharding import constrain


def swiglu(gate, up):
    """silu(gate) * up in float32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.nn.silu(gate) * up


def situ_glu(gate, up, *, beta: float = 4.0, linear_beta: float = 25.0):
    """K3's bounded GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta), float32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    act = beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
    return act * (linear_beta * jnp.tanh(up / linear_beta))


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

"""The gated FFN activations and their derivatives, elementwise in float32.

One definition for the model (`kimi_jax.ffn`), the fused Pallas epilogues (`pallas_gpu_glu`) and
their reference: `kind` "swiglu" is silu(g) u; "situ" is K3's bounded SiTU-GLU,
beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta) (|out| <= beta * linear_beta).
Only lax ops with Mosaic GPU lowerings (exp through sigmoid, tanh, arithmetic) appear here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GLU_KINDS = ("swiglu", "situ")


def check_kind(kind: str) -> None:
    if kind not in GLU_KINDS:
        raise ValueError(f"Unknown GLU kind={kind!r}; expected one of {list(GLU_KINDS)}")


def glu_forward(kind: str, gate, up, beta: float, linear_beta: float):
    """act(gate, up) in float32 (beta, linear_beta: SiTU's bounds; unused by swiglu)."""
    check_kind(kind)
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if kind == "swiglu":
        return jax.nn.silu(g) * u
    return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))


def glu_backward(kind: str, gate, up, ct, beta: float, linear_beta: float):
    """(d act / d gate * ct, d act / d up * ct) in float32."""
    check_kind(kind)
    g, u, ct = gate.astype(jnp.float32), up.astype(jnp.float32), ct.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    if kind == "swiglu":  # d/dg [g s(g)] = s (1 + g (1 - s))
        return ct * u * s * (1 + g * (1 - s)), ct * g * s
    # a = beta tanh(g / beta) s(g), u' = linear_beta tanh(u / linear_beta)
    t1, t2 = jnp.tanh(g / beta), jnp.tanh(u / linear_beta)
    da = (1 - t1 * t1) * s + beta * t1 * s * (1 - s)
    return ct * linear_beta * t2 * da, ct * beta * t1 * s * (1 - t2 * t2)

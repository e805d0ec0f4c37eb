"""Pure-JAX reference for `pallas_gpu.tap_grads` (the same contract, the taps as padded shifts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tap_grads(x, dy, w, masks, *, from_da: bool = False, per_batch: bool = False):
    """x, dy [B, T, C]; w [W, C]; masks [B, W, T] -> dw [W, C] float32 ([B, W, C] with per_batch).
    `from_da`: dy is da = dy * silu'(a) already."""
    B, T, C = x.shape
    W = w.shape[0]
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    taps = []
    for i in range(W):
        s = W - 1 - i
        shifted = jnp.pad(xf, ((0, 0), (s, 0), (0, 0)))[:, :T]
        taps.append(shifted * masks[:, i, :, None])
    if from_da:
        da = dy.astype(jnp.float32)
    else:
        a = sum(t * wf[i] for i, t in enumerate(taps))
        da = dy.astype(jnp.float32) * jax.grad(lambda z: jnp.sum(jax.nn.silu(z)))(a)
    part = jnp.stack([jnp.sum(da * t, axis=1) for t in taps], axis=1)  # [B, W, C]
    return part if per_batch else part.sum(axis=0)

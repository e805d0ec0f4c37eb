"""A float64 NumPy oracle written straight from the recurrence (independent of the JAX code)."""

import numpy as np


def delta_rule_np(q, k, v, g=None, beta=None, scale=None, initial_state=None, segment_ids=None, delta=True):
    """q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H] | [B, T, H, K]; beta None | [B, T, H].
    Returns (o [B, T, H, V], S [B, H, K, V]) in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if g is None:
        g = np.zeros((B, T, H, K))
    g = np.asarray(g, np.float64)
    if g.ndim == 3:
        g = np.repeat(g[..., None], K, axis=-1)
    beta = np.ones((B, T, H)) if beta is None else np.asarray(beta, np.float64)
    o = np.zeros((B, T, H, V))
    S_out = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            S = np.zeros((K, V)) if initial_state is None else np.asarray(initial_state, np.float64)[b, h].copy()
            for t in range(T):
                if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                    S = np.zeros((K, V))
                S = np.exp(g[b, t, h])[:, None] * S
                kt, vt = k[b, t, h], v[b, t, h]
                if delta:
                    S = S + beta[b, t, h] * np.outer(kt, vt - S.T @ kt)
                else:
                    S = S + np.outer(kt, vt)
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_out[b, h] = S
    return o, S_out

"""The seed essay's toy memory: 64 dims, 20 key-value pairs, then key 0 rewritten with a new value.

Linear attention keeps both values of key 0 (error 1.20), the delta rule replaces it (0.00); both
blur key 5 through overlapping keys (0.31 and 0.36). Our ops reproduce the essay's table: reading
the memory with q = the key, beta = 1, no gate, scale = 1."""

import numpy as np
import pytest

from kernels.kda import kda, linear_attention

D = 64


def _stream():
    """Exactly the essay's draws: numpy default_rng(0), keys, then values, then the new value."""
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x)
    keys = [unit(rng.standard_normal(D)) for _ in range(20)]
    values = [rng.standard_normal(D) for _ in range(20)]
    new_value_for_key0 = rng.standard_normal(D)
    ks = np.stack(keys + [keys[0]])
    vs = np.stack(values + [new_value_for_key0])
    return keys, values, new_value_for_key0, ks, vs


def _final_state(op, impl):
    _, _, _, ks, vs = _stream()
    k = ks[None, :, None, :].astype(np.float32)  # [B=1, T=21, H=1, K=64]
    v = vs[None, :, None, :].astype(np.float32)
    if op == "linear":
        _, S = linear_attention(k, k, v, scale=1.0, output_final_state=True, impl=impl)
    else:
        _, S = kda(k, k, v, None, None, scale=1.0, output_final_state=True, impl=impl)
    return np.asarray(S[0, 0], np.float64)


def _error(S, key, target):
    return np.linalg.norm(S.T @ key - target) / np.linalg.norm(target)


@pytest.mark.parametrize("impl", ["naive", "chunk"])
@pytest.mark.parametrize("op, key0, key5", [("linear", "1.20", "0.31"), ("delta", "0.00", "0.36")])
def test_seed_toy_table(op, key0, key5, impl):
    keys, values, new_value, _, _ = _stream()
    S = _final_state(op, impl)
    assert f"{_error(S, keys[0], new_value):.2f}" == key0
    assert f"{_error(S, keys[5], values[5]):.2f}" == key5

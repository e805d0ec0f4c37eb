"""The parity metric shared by kernel tests and benchmarks.

flash-linear-attention's `assert_close`: err = RMS(ref - out) / (RMS(ref) + 1e-8), with an
automatic pass when max|ref - out| <= 1e-6. Computed in float64 on the host.
"""

import numpy as np


def rel_rms(ref, out) -> float:
    """Relative RMS error of `out` against `ref` (any array-likes of one shape)."""
    ref = np.asarray(ref, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"shape mismatch: ref {ref.shape} vs out {out.shape}")
    if ref.size == 0:
        return 0.0
    return float(np.sqrt(np.mean((ref - out) ** 2)) / (np.sqrt(np.mean(ref**2)) + 1e-8))


def assert_close(name: str, ref, out, ratio: float, atol: float = 1e-6) -> None:
    """Assert `out` matches `ref` to relative RMS `ratio` (pass outright if within `atol`)."""
    ref = np.asarray(ref, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {out.shape} != reference {ref.shape}")
    if not np.all(np.isfinite(out)):
        raise AssertionError(f"{name}: non-finite values in output")
    diff = np.max(np.abs(ref - out)) if ref.size else 0.0
    if diff <= atol:
        return
    err = rel_rms(ref, out)
    if not err < ratio:
        raise AssertionError(f"{name}: relative RMS error {err:.3g} >= {ratio} (max abs diff {diff:.3g})")

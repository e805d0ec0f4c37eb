"""`pytest -m gpu` without JAX_PLATFORMS: the suite defaults to the CPU, so on a GPU machine every
gpu test would be skipped without a word. The selection is refused with the way to run them."""

import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "tests/test_gpu_marker_selection.py"


def _pytest(*args, platforms=None):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTEST_ADDOPTS")}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, TARGET],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_selection_without_platform_is_refused():
    out = _pytest("-m", "gpu", "-k", "placeholder")
    assert out.returncode == 4, out.stdout + out.stderr
    assert "JAX_PLATFORMS=cuda" in out.stdout + out.stderr
    # Deselecting gpu tests, or naming the CPU platform, runs as before.
    assert _pytest("-m", "not gpu", "-k", "placeholder").returncode == 5  # nothing selected
    out = _pytest("-m", "gpu", "-k", "placeholder", platforms="cpu")
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
def test_gpu_placeholder():
    """Selected by the subprocess runs above (skipped there); on a GPU run, the GPU is the platform."""
    assert jax.devices()[0].platform == "gpu"

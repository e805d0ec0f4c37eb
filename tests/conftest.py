"""Test set-up: CPU with 8 fake devices unless JAX_PLATFORMS says otherwise, fixed seeds,
the relative-RMS metric, and a `gpu` marker that skips without a GPU."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The CPU suite is dominated by XLA compiles of tiny programs: LLVM's -O0 cuts them by about a
# third (tests/test_remat.py 73 -> 50 s on 2 cores) for slightly slower execution (the 400-step
# MQAR training test 50 -> 57 s). Only the CPU backend's code generation changes; the values the
# tests compare are computed by the same XLA graphs.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kernels.testing import assert_close, rel_rms  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: long-running test")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run with JAX_PLATFORMS=cuda on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)

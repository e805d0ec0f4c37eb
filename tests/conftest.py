"""Test set-up: CPU with 8 fake devices unless JAX_PLATFORMS says otherwise, fixed seeds,
the relative-RMS metric, a `gpu` marker that skips without a GPU, and one persistent compilation
cache for the whole run."""

import os
import re
import shutil
import tempfile

from tests.cpu_env import CPU_O0_FLAG

# Must happen before jax is imported anywhere.
_PLATFORM_DEFAULTED = "JAX_PLATFORMS" not in os.environ
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# LLVM -O0 on CPU: the suite is compile-bound (tests/cpu_env.py says why and what it costs).
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in _flags:
    _flags += " " + CPU_O0_FLAG
os.environ["XLA_FLAGS"] = _flags.strip()

# One XLA compilation cache for the run, shared by the xdist workers and the train.py / eval.py
# processes tests start (JAX reads these variables): many tests compile the same programs again
# (a resumed run, a second trial, the tiny model's train step in several files) from new closures
# that hash to the same HLO. The directory is made by the first process (the xdist controller,
# before it starts the workers) and removed when that process ends; it never outlives the run.
_CACHE_OWNER = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_OWNER:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kimi-jax-tests-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kernels.testing import assert_close, rel_rms  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_unconfigure(config):
    if _CACHE_OWNER:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    asks_gpu = re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr", "") or "")
    if _PLATFORM_DEFAULTED and asks_gpu and any("gpu" in item.keywords for item in items):
        # `-m gpu` on a GPU machine would otherwise skip every test without a word.
        raise pytest.UsageError("gpu tests selected, but this suite runs on the CPU unless JAX_PLATFORMS "
                                "says otherwise: run `make test-gpu` or set JAX_PLATFORMS=cuda")
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

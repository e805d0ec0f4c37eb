"""Every model config builds abstractly with the expected parameter count; K3's count is the
doc's arithmetic (K3 notes §2.7) written out independently here."""

import glob
import importlib.util
import os

import ml_collections
import pytest

from kimi_jax.config import ModelConfig
from kimi_jax.summary import count_params, param_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_MODEL_CONFIGS = {"common.py", "model_presets.py", "evals.py", "__init__.py"}
MODEL_CONFIGS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    + glob.glob(os.path.join(ROOT, "configs", "ablations", "*.py"))
    if os.path.basename(p) not in NOT_MODEL_CONFIGS
)
FULL_SIZE = {"configs/k3.py", "configs/kimi_linear.py"}  # counted below, once each


def _load(path):
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def k3_params_by_hand():
    """K3 notes §2.7: d=7168, H=96, K=128, W=4, R=128, V=163840, E=896, k=16, l=3584, f=3072."""
    d, H, K, W, R, V, E, k, l, f = 7168, 96, 128, 4, 128, 163840, 896, 16, 3584, 3072
    kda = 4 * d * H * K + 3 * H * K * W + d * R + R * H * K + H * K + H + d * H + K + H * K * d
    mla = (d * 1536 + 1536 + 1536 * H * 192 + d * 576 + 512 + 512 * H * 256 + d * H * 128
           + H * 128 * d)
    routed = 3 * E * l * f
    moe_rest = d * E + E + 2 * d * l + l + 3 * d * 6144
    total = (69 * kda + 24 * mla + 92 * (routed + moe_rest) + 3 * d * 33792 + 2 * V * d
             + 93 * 6 * d + 3 * d)
    active = total - V * d - 92 * routed + 92 * 3 * k * l * f
    return total, active


@pytest.mark.parametrize("path", MODEL_CONFIGS)
def test_config_files_build_abstractly(path):
    module = _load(path)
    assert "python " in (module.__doc__ or ""), f"{path}: the docstring gives the launch command"
    config = module.get_config()
    assert isinstance(config, ml_collections.ConfigDict)
    for key in ("seed", "total_steps", "log_every_steps", "model"):
        assert key in config, (path, key)
    cfg = ModelConfig.from_config_dict(config.model)
    if path in FULL_SIZE:
        return
    total, active = count_params(cfg)
    assert 0 < active <= total
    if path == "configs/k3_small.py":
        assert 80e6 < total < 130e6, total


def test_k3_count_is_the_released_arithmetic():
    config = _load("configs/k3.py").get_config()
    cfg = ModelConfig.from_config_dict(config.model)
    table = param_table(cfg)
    total, active = count_params(cfg, table)
    assert (total, active) == k3_params_by_hand()
    assert round(total / 1e12, 2) == 2.78 and round(active / 1e9, 1) == 104.2
    assert cfg.layer_mixers.count("kda") == 69 and cfg.layer_mixers[-2:] == ("mla", "mla")
    assert table["moe routed experts"] == (92, 92 * 3 * 896 * 3584 * 3072)


def test_kimi_linear_is_about_49b():
    config = _load("configs/kimi_linear.py").get_config()
    cfg = ModelConfig.from_config_dict(config.model)
    total, active = count_params(cfg)
    assert abs(total - 49.1e9) < 0.1e9, total
    assert abs(active - 3.1e9) < 0.1e9, active  # "A3B": the head counts, the embedding does not
    mla = [i for i, m in enumerate(cfg.layer_mixers) if m == "mla"]
    assert mla == [3, 7, 11, 15, 19, 23, 26]

"""The summary: the CLI's last line, cache and state bytes (K3 notes §2.8), FLOPs per token."""

import os
import subprocess
import sys

import pytest

from configs import model_presets, tiny
from kimi_jax import flops
from kimi_jax.config import ModelConfig
from kimi_jax.summary import cache_bytes, count_params, recurrent_state_bytes, train_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_prints_a_table_and_ends_with_the_counts():
    out = subprocess.run([sys.executable, "-m", "kimi_jax.summary", "--config", "configs/tiny.py"],
                         cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
    lines = out.strip().splitlines()
    total, active = count_params(tiny.get_config())
    assert lines[-1] == f"params total={total} active={active}"
    assert any(line.startswith("mixer kda") for line in lines)
    assert any("moe routed experts" in line for line in lines)
    assert any("cache bytes per token" in line for line in lines)


def test_k3_cache_and_state_bytes():
    cfg = ModelConfig.from_config_dict(model_presets.k3_model())
    per_token, state = cache_bytes(cfg)
    assert per_token == 24 * 576 * 2 == 27_648
    recurrent = 69 * 96 * 128 * 128 * 4  # 414 MiB of float32 KDA state
    assert recurrent == 414 * 2**20
    conv = 69 * 3 * 96 * 128 * 3 * 2  # (W - 1) bf16 values per q/k/v channel
    assert state == recurrent + conv
    assert recurrent_state_bytes(cfg) == recurrent


def test_active_params_use_top_k_experts():
    config = tiny.get_config()
    total, active = count_params(config)
    moe = config.model.moe
    E, k, width, F = moe.num_experts, moe.top_k, moe.latent_dim, moe.expert_hidden
    routed = 3 * (config.model.num_layers - 1) * E * width * F
    embed = config.model.vocab_size * config.model.d_model
    assert total - active == embed + routed - routed // E * k


def test_train_flops_per_token():
    config = model_presets.ablation_model("softmax", d_model=64, num_layers=2, vocab_size=128)
    cfg = ModelConfig.from_config_dict(config)
    short, long = train_flops_per_token(cfg, 128), train_flops_per_token(cfg, 1024)
    # Softmax attention grows with the context: 3 x 2 layers x 2 (QK, AV) x 2 x d x (T / 2).
    assert long - short == pytest.approx(3 * 2 * 2 * 2 * 64 * (1024 - 128) / 2)
    # At least 6 FLOPs per active parameter (matmuls) on top of the attention.
    _, active = count_params(cfg)
    assert short >= 6 * (active - 2 * 64 * 2 - 64)  # norms are not matmuls
    moe = ModelConfig.from_config_dict(model_presets.tiny_hybrid_model())
    m = moe.moe
    ffn = flops.ffn_flops_per_token(moe, 1)
    expected = 2 * (64 * m.num_experts + 3 * 32 * 32 * m.top_k + 2 * 64 * 32 + 3 * 64 * 32)
    assert ffn == expected


def test_k3_attn_res_sources_follow_the_schedule():
    cfg = ModelConfig.from_config_dict(model_presets.k3_model())
    reads = flops.attn_res_sources(cfg)
    assert len(reads) == 2 * 93 - 1 + 1  # layer 0's mixer reads the embedding directly
    assert reads[-1] == 9  # the embedding, 7 finished 12-layer blocks and a 9-layer tail
    mixer_reads = [reads[2 * l - 1] for l in range(1, 93)]
    assert mixer_reads == [2 + (l - 1) // 12 for l in range(1, 93)]

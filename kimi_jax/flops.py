"""Training FLOPs per token (2 FLOPs per multiply-add; backward = 2x forward), mixer-aware.

The mixers report their own forward FLOPs (projections plus attention over the average causal
context, or the chunked recurrence); this file adds the FFN / MoE (active experts only), the
attention-residual reads and the head. The embedding lookup is free.
"""

from __future__ import annotations

from kimi_jax.attention import mixer_config
from kimi_jax.config import ModelConfig


def ffn_flops_per_token(cfg: ModelConfig, layer: int) -> float:
    """Forward FLOPs of one layer's FFN per token (MoE: router, latent projections, the k active
    experts and the shared experts)."""
    d = cfg.d_model
    if not cfg.ffn:
        return 0.0
    if not cfg.is_moe(layer):
        return 2.0 * 3 * d * cfg.dense_hidden
    m = cfg.moe
    width = m.latent_dim or d
    flops = 2.0 * d * m.num_experts + 2.0 * 3 * width * m.expert_hidden * m.top_k
    if m.latent_dim:
        flops += 2.0 * 2 * d * m.latent_dim
    return flops + 2.0 * 3 * d * m.num_shared_experts * m.expert_hidden


def attn_res_sources(cfg: ModelConfig) -> list[int]:
    """Number of sources of every AttnRes read (in order: per layer mixer, ffn; then the final)."""
    reads, blocks, prefix = [], 0, True
    for layer in range(cfg.num_layers):
        if blocks:
            reads.append(blocks + int(prefix))
        if layer % cfg.attn_res_block_size == 0:
            blocks, prefix = blocks + 1, False
        prefix = True
        reads.append(blocks + 1)
    reads.append(blocks + 1)
    return reads


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    d = cfg.d_model
    flops = 2.0 * d * cfg.vocab_size  # head
    for layer, name in enumerate(cfg.layer_mixers):
        flops += mixer_config(name, cfg.settings(name)).flops_per_token(d, seq_len)
        flops += ffn_flops_per_token(cfg, layer)
    if cfg.residual == "attn_res":  # logits and weighted sum over the sources of each read
        flops += sum(4.0 * d * s for s in attn_res_sources(cfg))
    return flops


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token at sequence length `seq_len`."""
    return 3.0 * forward_flops_per_token(cfg, seq_len)


def forward_flops_breakdown(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by component ("head", "mixer <name>", "ffn", "attn_res"); the
    values sum to `forward_flops_per_token`."""
    out = {"head": 2.0 * cfg.d_model * cfg.vocab_size, "ffn": 0.0}
    for layer, name in enumerate(cfg.layer_mixers):
        key = f"mixer {name}"
        out[key] = out.get(key, 0.0) + mixer_config(name, cfg.settings(name)).flops_per_token(cfg.d_model, seq_len)
        out["ffn"] += ffn_flops_per_token(cfg, layer)
    if cfg.residual == "attn_res":
        out["attn_res"] = sum(4.0 * cfg.d_model * s for s in attn_res_sources(cfg))
    return out

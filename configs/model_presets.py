"""`config.model` presets shared by the config files (schema: `kimi_jax/config.py`).

Exact released architectures (K3, Kimi Linear 48B-A3B; see the K3 architecture notes §1.1, §2.1)
and small models that keep their topology. Each returns a fresh ConfigDict, so a config file
can change any key afterwards.
"""

from __future__ import annotations

import ml_collections

from configs import common

HYBRID = ("kda", "kda", "kda", "mla")  # the 3:1 KDA:MLA pattern of Kimi Linear and K3


def _cd(**kw) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(kw)


def k3_model() -> ml_collections.ConfigDict:
    """Kimi K3 (2026-07, released config): 93 layers, 69 KDA + 24 MLA, LatentMoE 896 x top-16,
    SiTU-GLU, block attention residuals of 12 layers. 2.78T total / 104.2B active parameters."""
    return _cd(
        vocab_size=163840, d_model=7168, num_layers=93,
        mixer_pattern=HYBRID, final_mixer="mla",
        mixers=_cd(
            kda=_cd(num_heads=96, head_dim=128, conv_size=4, gate_rank=128,
                    use_full_rank_gate=True, lower_bound=-5.0, norm_eps=1e-5),
            mla=_cd(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, output_gate=True, norm_eps=1e-6,
                    cache_dtype="bfloat16"),
        ),
        activation="situ", situ_beta=4.0, situ_linear_beta=25.0,
        dense_layers=1, dense_hidden=33792,
        moe=_cd(num_experts=896, top_k=16, expert_hidden=3072, num_shared_experts=2,
                latent_dim=3584, latent_norm=True, routed_scaling_factor=1.0,
                dispatch="auto", balancing="quantile"),
        residual="attn_res", attn_res_block_size=12,
        norm_eps=1e-5, dtype="bfloat16", param_dtype="float32",
    )


def kimi_linear_model() -> ml_collections.ConfigDict:
    """Kimi Linear 48B-A3B (2025-10): 27 layers, 20 KDA + 7 MLA (the last is MLA), MoE 256 x top-8
    with one shared expert, SwiGLU, plain residuals. About 49.1B total parameters."""
    return _cd(
        vocab_size=163840, d_model=2304, num_layers=27,
        mixer_pattern=HYBRID, final_mixer="mla",
        mixers=_cd(
            kda=_cd(num_heads=32, head_dim=128, conv_size=4, gate_rank=128,
                    use_full_rank_gate=False, norm_eps=1e-5),
            mla=_cd(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, output_gate=False, norm_eps=1e-6,
                    cache_dtype="bfloat16"),
        ),
        activation="swiglu", dense_layers=1, dense_hidden=9216,
        moe=_cd(num_experts=256, top_k=8, expert_hidden=1024, num_shared_experts=1,
                latent_dim=0, routed_scaling_factor=2.446, dispatch="auto",
                balancing="aux_free"),
        residual="plain", attn_res_block_size=1,
        norm_eps=1e-5, dtype="bfloat16", param_dtype="float32",
    )


def k3_small_model() -> ml_collections.ConfigDict:
    """A ~100M-parameter model with K3's topology (after torchtitan's `k3mini`): d 512, 21 layers
    with MLA at 4, 8, 12, 16, 20, 21 (1-based), KDA 4 x 128 (FlashKDA-compatible), LatentMoE
    (latent d/2) with 8 experts top-2 and 2 shared, SiTU-GLU, AttnRes blocks of 12 layers."""
    model = k3_model()
    model.update(dict(vocab_size=32768, d_model=512, num_layers=21, dense_hidden=896))
    model.mixers.kda.update(dict(num_heads=4, head_dim=128))
    model.mixers.mla.update(dict(num_heads=4, q_lora_rank=128, kv_lora_rank=512))
    model.moe.update(dict(num_experts=8, top_k=2, expert_hidden=224, num_shared_experts=2,
                          latent_dim=256))
    return model


def tiny_hybrid_model(d_model: int = 64, vocab_size: int = 256) -> ml_collections.ConfigDict:
    """The 3:1 KDA:MLA hybrid at CPU size: 4 layers, a dense first layer, then LatentMoE with 8
    experts top-2 and one shared expert; K3's gates, SiTU-GLU and AttnRes (blocks of 2)."""
    heads = max(d_model // 32, 1)
    return _cd(
        vocab_size=vocab_size, d_model=d_model, num_layers=4,
        mixer_pattern=HYBRID, final_mixer="",
        mixers=_cd(
            kda=_cd(num_heads=heads, head_dim=d_model // heads, conv_size=4,
                    use_full_rank_gate=True, lower_bound=-5.0, impl="auto"),
            mla=_cd(num_heads=heads, q_lora_rank=d_model // 2, kv_lora_rank=d_model // 2,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, output_gate=True),
        ),
        activation="situ", situ_beta=4.0, situ_linear_beta=25.0,
        dense_layers=1, dense_hidden=2 * d_model,
        moe=_cd(num_experts=8, top_k=2, expert_hidden=d_model // 2, num_shared_experts=1,
                latent_dim=d_model // 2, latent_norm=True, routed_scaling_factor=1.0,
                dispatch="auto", balancing="quantile"),
        residual="attn_res", attn_res_block_size=2,
        norm_eps=1e-5, dtype="float32", param_dtype="float32",
    )


ABLATION_MIXERS = ("softmax", "linear", "deltanet", "gated_deltanet", "kda", "hybrid")


def ablation_model(mixer: str, d_model: int = 64, num_layers: int = 4, vocab_size: int = 8192,
                   num_heads: int = 0, *, rope: bool = True, ffn: bool = True,
                   learned_positions: int = 0, dropout: float = 0.0, tied: bool = False,
                   conv: bool = True) -> ml_collections.ConfigDict:
    """Models that differ only in the token mixer (Zoology-style recall ablations): the same
    width, depth, heads, dense SwiGLU MLP (2 d_model) and plain residuals. "hybrid" is the 3:1
    KDA:MLA pattern. num_heads 0 = max(1, d_model // 32). rope=False: softmax attention without
    positions (NoPE; the recurrent mixers and the hybrid's MLA have none anyway); ffn=False:
    mixer-only layers, as Zoology's MQAR models; learned_positions > 0: a learned absolute position
    table of that length added to the token embedding (Zoology's attention); dropout: the training
    dropout rate of the embedding and of softmax attention's probabilities (Zoology's: 0.1); tied:
    the head is the token embedding (Zoology's, initialised at std 0.02); conv=False: the recurrent
    mixers (and the hybrid's KDA layers) without their short convolution (plain linear attention as
    the Based / Zoology baselines have it: the previous-token shift must then come from a layer)."""
    if mixer not in ABLATION_MIXERS:
        raise ValueError(f"Unknown ablation mixer={mixer!r}; expected one of {list(ABLATION_MIXERS)}")
    heads = num_heads or max(1, d_model // 32)
    if d_model % heads:
        raise ValueError(f"num_heads={heads} must divide d_model={d_model}")
    head_dim = d_model // heads
    recurrent = _cd(num_heads=heads, head_dim=head_dim, conv_size=4 if conv else 0)
    mixers = _cd(
        softmax=_cd(num_heads=heads, head_dim=head_dim, rope_theta=10000.0 if rope else None,
                    dropout=float(dropout)),
        linear=recurrent, deltanet=recurrent, gated_deltanet=recurrent, kda=recurrent,
        mla=_cd(num_heads=heads, q_lora_rank=None, kv_lora_rank=d_model // 2,
                qk_nope_head_dim=head_dim, qk_rope_head_dim=0, v_head_dim=head_dim),
    )
    pattern = HYBRID if mixer == "hybrid" else (mixer,)
    used = set(pattern)
    return _cd(
        vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
        mixer_pattern=pattern, final_mixer="",
        mixers=_cd(**{name: mixers[name] for name in sorted(used)}),
        activation="swiglu", dense_layers=num_layers, dense_hidden=2 * d_model, ffn=bool(ffn), moe=None,
        residual="plain", attn_res_block_size=1, max_position_embeddings=int(learned_positions),
        embed_dropout=float(dropout), tie_embeddings=bool(tied), norm_eps=1e-5, dtype="float32",
        param_dtype="float32",
    )


def ablation_config(mixer: str, arg=None) -> ml_collections.ConfigDict:
    """Full config of one mixer ablation; arg "d_model=128,num_layers=4,vocab_size=8192,num_heads=0,
    rope=True,ffn=True,learned_positions=0,dropout=0.0,tied=False,conv=True" (see `ablation_model`)."""
    arg = common.parse_arg(arg, d_model=64, num_layers=4, vocab_size=8192, num_heads=0, rope=True, ffn=True,
                           learned_positions=0, dropout=0.0, tied=False, conv=True)
    config = common.base_config()
    config.model = ablation_model(mixer, arg.d_model, arg.num_layers, arg.vocab_size, arg.num_heads,
                                  rope=arg.rope, ffn=arg.ffn, learned_positions=arg.learned_positions,
                                  dropout=arg.dropout, tied=arg.tied, conv=arg.conv)
    return config

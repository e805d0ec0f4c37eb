"""The model FLOP count (kimi_jax/flops.py) against XLA's own count of the compiled forward of
the 1.3B-topology dense config, scaled down: they agree once MLA's attention is counted over the
full [T, T] score matrix XLA computes (the MFU count takes the causal half, T/2 per token)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import k3_1b3_dense
from kimi_jax import flops, summary, train_lib


@pytest.mark.parametrize("seq_len", [256, 1024])
def test_flop_count_matches_xla_cost_analysis(seq_len):
    config = k3_1b3_dense.get_config("d_model=512,num_layers=8,vocab_size=4096")
    cfg = summary.model_config(config)
    graphdef, params, rest = train_lib.abstract_model(config)

    def forward(params, tokens):
        return nnx.merge(graphdef, train_lib._cast(params, jnp.bfloat16), rest)(tokens)
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    cost = jax.jit(forward).lower(params.to_pure_dict(), tokens).cost_analysis()
    xla = (cost if isinstance(cost, dict) else cost[0])["flops"]
    ours = flops.forward_flops_per_token(cfg, seq_len) * seq_len
    mla = cfg.settings("mla")
    per_pair = 2 * mla["num_heads"] * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] + mla["v_head_dim"])
    masked_half = cfg.layer_mixers.count("mla") * per_pair * seq_len * seq_len / 2
    assert xla > ours  # XLA also counts the masked half and elementwise work
    assert abs(xla / (ours + masked_half) - 1) < 0.03, (xla, ours, masked_half)

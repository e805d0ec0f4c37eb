"""MXFP4 experts end to end: a tiny LatentMoE model trained for 40 steps (held-out loss ~0.11
from 5.5), quantised in memory and through `python -m kimi_jax.quantize` (checkpoint in,
checkpoint out): eval loss within 2% of the float model, 4.25 bits per routed-expert parameter,
and the summary reports it."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kimi_jax import build_model, load_model, quantize, summary

# configs/tiny.py's LatentMoE (8 experts top-2, latent 32, width 32) on a 2-layer softmax trunk
# (quick to compile), as a config file for the command line.
CONFIG_SRC = """
from configs import common, tiny
from configs.model_presets import ablation_model


def get_config(arg=None):
    config = common.base_config()
    config.model = ablation_model("softmax", d_model=64, num_layers=2, vocab_size=256)
    config.model.update(dense_layers=1, moe=tiny.get_config().model.moe)
    config.model.moe.dispatch = "gmm"
    return config
"""

STEPS = 40  # enough to move the loss well below chance (ln 256 = 5.5)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "moe_tiny.py"
    path.write_text(CONFIG_SRC)
    return str(path)


def _batches(config, seq_len=32):
    """Sequences of a fixed random bigram permutation from random starts: learnable in a few
    dozen steps, so the float model is trained, not at chance, when it is quantised."""
    rng = np.random.default_rng(0)
    vocab = config.model.vocab_size
    perm = rng.permutation(vocab)
    seqs = np.empty((STEPS * 16 + 64, seq_len + 1), np.int32)
    seqs[:, 0] = rng.integers(0, vocab, size=len(seqs))
    for t in range(seq_len):
        seqs[:, t + 1] = perm[seqs[:, t]]
    data = {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}
    return ({k: v[:-64] for k, v in data.items()}, {k: v[-64:] for k, v in data.items()})


def _loss(model, batch):
    logits = model(jnp.asarray(batch["inputs"]))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.asarray(batch["targets"])))


@nnx.jit
def _eval(model, batch):
    return _loss(model, batch)


@pytest.fixture(scope="module")
def trained(config_path):
    config = summary.load_config(config_path)
    model = build_model(config, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train, held_out = _batches(config)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        opt.update(model, grads)
        return loss

    for i in range(STEPS):
        step(model, opt, {k: v[16 * i:16 * i + 16] for k, v in train.items()})
    return config, model, held_out


def test_quantised_eval_loss_within_two_percent(trained):
    config, model, held_out = trained
    qmodel = quantize.quantize_model(model, config)
    base, quant = float(_eval(model, held_out)), float(_eval(qmodel, held_out))
    assert base < 3.5, base  # trained: the 2% bound is not a statement about an untrained model
    assert abs(quant - base) / base < 0.02, (base, quant)
    experts = qmodel.moe_layers()[0].experts
    assert isinstance(experts, quantize.MXFP4Experts)
    dense = model.moe_layers()[0].experts.weights()
    deq = experts.weights().gate.dequantize()
    assert not np.array_equal(np.asarray(deq), np.asarray(dense.gate))  # really quantised
    np.testing.assert_allclose(np.asarray(deq), np.asarray(dense.gate), atol=0.3 * float(
        jnp.max(jnp.abs(dense.gate))))
    params, nbytes = quantize.storage(qmodel)
    n_routed = sum(w.size for m in model.moe_layers() for w in m.experts.weights())
    assert params == n_routed and 8 * nbytes / params == 4.25


def test_cli_converts_a_checkpoint(trained, tmp_path, config_path):
    config, model, held_out = trained
    quantize.save(model, str(tmp_path), step=STEPS)
    out = quantize.main(["--config", config_path, "--workdir", str(tmp_path)])
    qconfig = quantize.quantized_config(config)
    restored = load_model(qconfig, out)
    in_memory = quantize.quantize_model(model, config)
    for a, b in zip(restored.moe_layers()[0].experts.weights(),
                    in_memory.moe_layers()[0].experts.weights()):
        np.testing.assert_array_equal(np.asarray(a.packed), np.asarray(b.packed))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
    assert "4.25 bits per parameter" in summary.report(qconfig, seq_len=64)
    total, _ = summary.count_params(qconfig)
    assert total == summary.count_params(config)[0]


def test_quantized_config_keeps_a_packed_dispatch():
    """"ragged" cannot read packed weights and becomes "gmm"; "auto" (the default, also where the
    config leaves the key out) and the other packed dispatches stay."""
    from configs import tiny

    config = tiny.get_config()
    for given, want in (("ragged", "gmm"), ("auto", "auto"), ("expert_parallel", "expert_parallel"), (None, "auto")):
        cfg = config.copy_and_resolve_references()
        if given is None:
            del cfg.model.moe["dispatch"]
        else:
            cfg.model.moe.dispatch = given
        q = quantize.quantized_config(cfg)
        assert q.model.moe.get("dispatch", "auto") == want and q.model.moe.experts_dtype == "mxfp4", given


def test_config_checks():
    with pytest.raises(ValueError, match="experts_dtype"):
        quantize.check_experts_dtype("fp8", "gmm")
    with pytest.raises(ValueError, match="dispatch"):
        quantize.check_experts_dtype("mxfp4", "dense")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize.MXFP4Experts(2, 48, 32, in_axis="latent", rngs=nnx.Rngs(0))

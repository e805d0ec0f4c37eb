"""Per-layer remat (kimi_jax/remat.py) changes memory, never values: the loss and every gradient
of the tiny hybrid (KDA, MLA, LatentMoE, block attention residuals, packed documents) match the
un-checkpointed model under each policy, and the train step reads `config.remat`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from kimi_jax import build_model, optim, train_lib
from kimi_jax.remat import POLICIES


REMATS = ("full", "dots", "dots16/mla=dots_all")


@pytest.fixture(scope="module")
def results():
    """Loss and gradients of the tiny hybrid on a packed batch without remat and under each policy
    in REMATS, from one jitted program: one compile of the model's forward and backward in place
    of four (XLA may share identical forward ops between them; remat's recomputation in the
    backward pass is what differs, decided before XLA)."""
    model = build_model(tiny.get_config(), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, model.config.vocab_size)
    segment_ids = jnp.asarray([[1] * 10 + [2] * 14, [1] * 24], jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, remat):
        m = nnx.merge(graphdef, params, rest)
        logits, aux = m(tokens, segment_ids, return_aux=True, remat=remat)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.mean(logits[..., 0] ** 2) + aux["aux_loss"]
    policies = ("none",) + REMATS
    out = jax.jit(lambda p: [jax.value_and_grad(loss)(p, r) for r in policies])(params)
    return dict(zip(policies, out))


@pytest.mark.parametrize("remat", REMATS)
def test_remat_keeps_loss_and_gradients(results, remat):
    (ref_loss, ref_grads), (loss, grads) = results["none"], results[remat]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat_ref, flat = jax.tree.leaves(ref_grads), jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) > 50
    for g, r in zip(flat, flat_ref):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6)
    assert any(float(jnp.abs(g).max()) > 0 for g in flat)


def test_unknown_policy_raises():
    model = build_model(tiny.get_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="remat policy"):
        model(jnp.zeros((1, 4), jnp.int32), remat="sometimes")
    config = tiny.get_config()
    config.remat = "sometimes"
    with pytest.raises(ValueError, match="remat policy"):
        train_lib.make_loss_fn(config, None)


def test_train_step_uses_config_remat():
    """The train step of a config with remat="full" recomputes each block's forward in the
    backward pass: more matmuls in its lowered program than without remat."""
    dots = {}
    for remat in ("none", "full"):
        config = tiny.get_config()
        config.remat = remat
        graphdef, params, rest = train_lib.abstract_model(config)
        tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
        state = jax.eval_shape(train_lib.make_init(config, tx))
        step = jax.jit(train_lib.make_train_step(config, graphdef, tx, schedule))
        batch = {k: jax.ShapeDtypeStruct((2, 16), d) for k, d in
                 (("inputs", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.bool_), ("segment_ids", jnp.int32))}
        dots[remat] = step.lower(state, batch, jax.ShapeDtypeStruct((), jnp.int32)).as_text().count("dot_general")
    assert dots["full"] > dots["none"] > 0, dots
    assert sorted(POLICIES) == ["dots", "dots16", "dots_all", "full", "none"]


def test_spec_gives_each_mixer_its_policy():
    from kimi_jax.remat import parse_spec, policy_for

    assert parse_spec("dots16/mla=dots_all/kda=none") == ("dots16", {"mla": "dots_all", "kda": "none"})
    assert policy_for("dots16/mla=dots_all", "mla") == "dots_all"
    assert policy_for("dots16/mla=dots_all", "kda") == "dots16"
    for bad in ("dots/mla", "dots/mla=sometimes", "/mla=dots", "dots/=full"):
        with pytest.raises(ValueError):
            parse_spec(bad)


@pytest.mark.parametrize("impl", ["chunk", "chunk_mosaic", "pallas_gpu"])
def test_dots16_keeps_the_kda_chunk_states(impl, monkeypatch):
    """Under "dots16" the KDA chunk states (a kernel's or a scan's output, named
    kernels.kda.chunk.STATES_NAME) are saved residuals, so the backward does not rerun the
    forward state pass: for the XLA scan, one state pass fewer in the gradient's program than
    when the name is not kept (remat does not rerun the Mosaic kernels either way); the same
    gradients. On CPU the Mosaic GPU impls are traced as on a Hopper GPU and not run (remat
    cannot take the interpreter's callbacks); the gradients are compared on a GPU."""
    from jax._src.ad_checkpoint import saved_residuals

    from kernels.kda import chunk_mosaic, hopper, kda, pallas_gpu
    from kimi_jax import remat

    run = impl == "chunk" or hopper.device_kind() == "hopper"
    if not run:
        for module, name in ((hopper, "device_kind"), (chunk_mosaic, "_device_kind"), (pallas_gpu, "_device_kind")):
            monkeypatch.setattr(module, name, lambda: "hopper")

    B, T, H, K = 1, 128, 2, 64
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(B, T, H, K)), jnp.bfloat16)
    g = jnp.asarray(-np.abs(r.normal(size=(B, T, H, K))), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)
    w = jnp.asarray(r.normal(size=(K, K)) * 0.1, jnp.bfloat16)

    def f(x, g):
        y = jnp.einsum("bthk,kd->bthd", x, w)
        y = y / jnp.linalg.norm(y.astype(jnp.float32), axis=-1, keepdims=True).astype(y.dtype)
        o, _ = kda(y, y, y, g, beta, lower_bound=-5.0, impl=impl)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    keep = remat.Dots16(remat.SMALL_PER_TOKEN * B * T)

    def drop(prim, *avals, **params):  # dots16 without its names
        return prim.name != "name" and keep(prim, *avals, **params)

    saved = [d for _, d in saved_residuals(jax.checkpoint(f, policy=keep), x, g)]
    named = lambda name: any(f"named '{name}'" in d for d in saved)  # noqa: E731
    if impl != "chunk":  # chunk's jit hides the names here; its pass count below shows both kept
        assert named("kda_chunk_states"), saved
        # chunk's forward (chunk_mosaic's route) keeps v' (residuals="states_vn"); the kernels write none
        assert named("kda_chunk_vn") == (impl == "chunk_mosaic"), saved

    def passes(policy):  # state passes: lax.scan (chunk) or Mosaic GPU kernels (mpmd_map)
        text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy), (0, 1)))(x, g))
        return text.count("scan[") + text.count("pallas_call[") + text.count("mpmd_map[")

    if impl == "chunk":  # states and v' kept: the forward scan is not rerun for either
        assert passes(keep) == passes(drop) - 1
    else:  # remat never reruns a Mosaic kernel (an effectful custom call): its outputs are residuals anyway
        assert passes(keep) == passes(drop)
    if not run:
        return
    grads = [jax.jit(jax.grad(jax.checkpoint(f, policy=p), (0, 1)))(x, g) for p in (keep, drop)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)

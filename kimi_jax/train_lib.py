"""Pieces of train.py: abstract model and state shardings, the loss, the train and eval steps.

The train state is a dict of pure-dict pytrees: `params` (float32 master weights, `nnx.Param`),
`rest` (the model's other variables, e.g. MoE router biases) and `opt_state` (optax).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax import sharding
from kimi_jax.optim import path_name

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Scalar train metrics averaged over each logging window.
SCALARS = ("loss", "ce_loss", "z_loss", "aux_loss", "accuracy", "grad_norm", "param_norm", "lr")


def build_model(config, rngs):
    """The project's model for `config` (a seam tests may replace)."""
    import kimi_jax

    return kimi_jax.build_model(config, rngs=rngs)


def apply_balancing(model, aux):
    """MoE router-bias update after the gradient step (a seam tests may replace)."""
    from kimi_jax import moe

    moe.apply_balancing(model, aux)


def maybe_initialize_distributed(coordinator_address=None, num_processes=None, process_id=None) -> bool:
    """`jax.distributed.initialize()` when flags or the environment describe several processes
    (explicit flags, SLURM with several tasks, a TPU pod slice, or JAX's own variables)."""
    if coordinator_address:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
        return True
    env = os.environ
    multi = (int(env.get("SLURM_NTASKS", "1")) > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", "")
             or "JAX_COORDINATOR_ADDRESS" in env or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
    if multi:
        jax.distributed.initialize()
    return multi


def _split(model):
    return nnx.split(model, nnx.Param, ...)


def abstract_model(config):
    """(graphdef, abstract params State, abstract rest State) without allocating anything."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: build_model(config, nnx.Rngs(config.seed)))
    return _split(model)


def param_names(abstract_params) -> dict:
    """{"path/to/param": logical names} for the optimizer's masks and Muon's axes."""
    out = {}
    for path, var in nnx.to_flat_state(abstract_params):
        meta = var.get_metadata()
        out["/".join(str(k) for k in path)] = meta.get("out_sharding") or meta.get("sharding_names")
    return out


def state_shardings(tx, abstract_params, abstract_rest, mesh) -> dict:
    """NamedShardings of the train state: parameters by the logical rules, optimizer state like
    the parameters it mirrors, everything else replicated."""
    params = sharding.state_shardings(abstract_params, mesh).to_pure_dict()
    rest = sharding.state_shardings(abstract_rest, mesh).to_pure_dict()
    abstract_opt = jax.eval_shape(tx.init, abstract_params.to_pure_dict())
    opt = sharding.optimizer_shardings(tx, abstract_opt, params, mesh)
    return {"params": params, "rest": rest, "opt_state": opt}


def make_init(config, tx):
    """(seed = config.seed) -> train state; jit it with `out_shardings` to create the state
    already sharded, and pass the seed as an array (`seed_array`): with a seed known at compile
    time XLA folds every parameter's key derivation into constants, and the 1.3B model's jitted
    init compiled in 249 s instead of 134 s on an H200
    (benchmarks/results/init-compile-h200-20261130.json)."""
    def init(seed=None):
        seed = config.seed if seed is None else seed
        with nnx.use_eager_sharding(False):
            model = build_model(config, nnx.Rngs(jax.random.key(seed)))
        _, params, rest = _split(model)
        params = params.to_pure_dict()
        return {"params": params, "rest": rest.to_pure_dict(), "opt_state": tx.init(params)}
    return init


def seed_array(seed) -> np.ndarray:
    """`config.seed` as the uint32 array `make_init`'s jitted init takes (same keys as the int)."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"config.seed must be an integer in [0, 2**32); got {seed!r}")
    return np.uint32(seed)


def token_losses(logits, targets):
    """Per-token negative log-likelihood, log-partition squared (z-loss) and correctness, [B, T]."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = jnp.argmax(logits, axis=-1) == targets
    return log_z - picked, jnp.square(log_z), correct


def _cast(params, dtype):
    """Matrices in the compute dtype; vectors (norms, gates, biases) stay float32."""
    return jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 and jnp.issubdtype(p.dtype, jnp.floating) else p,
                        params)


def remat_policy(config) -> str:
    """`config.remat` (top-level, optional): the per-layer checkpointing policy of the train step
    (`kimi_jax.remat.POLICIES`); "none" when absent."""
    from kimi_jax.remat import check_policy

    return check_policy(str(config.get("remat", "none") or "none"))


def has_dropout(config) -> bool:
    """Whether `config.model` asks for dropout in training (the embedding's or a mixer's rate)."""
    model = config.model
    rates = [model.get("embed_dropout", 0.0)] + [(s or {}).get("dropout", 0.0)
                                                  for s in (model.get("mixers") or {}).values()]
    return any(float(r) > 0 for r in rates)


def make_loss_fn(config, graphdef):
    """loss(params, rest, batch, num_tokens, dropout_key=None) -> (loss, (sums, aux, rest)): the
    mean cross-entropy over the global batch's trained tokens, plus z-loss and the MoE auxiliary
    loss; `dropout_key` turns on the model config's dropout."""
    dtype = COMPUTE_DTYPES.get(config.optim.compute_dtype)
    if dtype is None:
        raise ValueError(f"Unknown optim.compute_dtype={config.optim.compute_dtype!r}; "
                         f"expected one of {sorted(COMPUTE_DTYPES)}")
    z_coef, accum = float(config.optim.z_loss), int(config.optim.grad_accum_steps)
    remat = remat_policy(config)
    kw = {} if remat == "none" else {"remat": remat}

    def loss_fn(params, rest, batch, num_tokens, dropout_key=None):
        model = nnx.merge(graphdef, _cast(params, dtype), rest)
        drop = {} if dropout_key is None else {"dropout_key": dropout_key}
        logits, aux = model(batch["inputs"], segment_ids=batch["segment_ids"], return_aux=True, **drop, **kw)
        with jax.named_scope("loss"):
            mask = batch["loss_mask"].astype(jnp.float32)
            nll, z2, correct = token_losses(logits, batch["targets"])
            sums = {"nll": jnp.sum(nll * mask), "z": jnp.sum(z2 * mask), "correct": jnp.sum(correct * mask)}
        loss = (sums["nll"] + z_coef * sums["z"]) / num_tokens + aux["aux_loss"] / accum
        new_rest = nnx.state(model, nnx.Not(nnx.Param)).to_pure_dict()
        return loss, (sums, aux, new_rest)
    return loss_fn


def _microbatches(batch, n: int):
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each micro-batch stays spread over the
    batch-sharded devices."""
    def split(x):
        if x.shape[0] % n:
            raise ValueError(f"batch of {x.shape[0]} rows is not divisible by grad_accum_steps={n}")
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def _grads(loss_fn, state, batch, num_tokens, accum: int, key):
    """Gradients (summed over `accum` micro-batches), loss, token sums, mean aux, new rest;
    micro-batch i draws its dropout from `key` folded with i."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum == 1:
        (loss, (sums, aux, rest)), grads = grad_fn(state["params"], state["rest"], batch, num_tokens, key)
        return grads, loss, sums, aux, rest

    def body(carry, micro):
        grads, loss, sums, aux, rest = carry
        micro, i = micro
        (l, (s, a, rest)), g = grad_fn(state["params"], rest, micro, num_tokens,
                                       None if key is None else jax.random.fold_in(key, i))
        add = lambda x, y: x + y  # noqa: E731
        return (jax.tree.map(add, grads, g), loss + l, jax.tree.map(add, sums, s),
                jax.tree.map(lambda x, y: x + y / accum, aux, a), rest), None

    micro = _microbatches(batch, accum)
    first = jax.tree.map(lambda x: x[0], micro)
    _, (s0, a0, _) = jax.eval_shape(loss_fn, state["params"], state["rest"], first, num_tokens)
    zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), t)  # noqa: E731
    carry = (zeros(state["params"]), jnp.zeros((), jnp.float32), zeros(s0), zeros(a0), state["rest"])
    (grads, loss, sums, aux, rest), _ = jax.lax.scan(body, carry, (micro, jnp.arange(accum)))
    return grads, loss, sums, aux, rest


def make_train_step(config, graphdef, tx, schedule):
    """(state, batch, step, lr) -> (state, metrics): one optimizer step on the global batch.

    `tx` and `schedule` come from `optim.make_optimizer` at peak learning rate 1: the updates are
    multiplied by `lr`, a float32 scalar argument (so the compiled step is the same for every
    learning rate), and the logged lr is `lr * schedule(step - 1)`. Left out, `lr` is
    `config.optim.lr` as a constant of the program. Non-finite loss or gradients: with
    `skip_nonfinite_updates` the old state is kept, else the caller stops on
    `metrics["finite"] == False` before anything is saved."""
    loss_fn = make_loss_fn(config, graphdef)
    accum, skip = int(config.optim.grad_accum_steps), bool(config.skip_nonfinite_updates)
    seed, dropout = int(config.seed), has_dropout(config)
    nan_step = int(config.inject_nan_at_step)

    def train_step(state, batch, step, lr=None):
        lr = jnp.asarray(float(config.optim.lr) if lr is None else lr, jnp.float32)
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        if nan_step >= 0:  # fault injection for tests of the non-finite handling
            num_tokens = num_tokens / jnp.where(step == nan_step, jnp.nan, 1.0)
        # Dropout (where the model config has any) draws from (seed, step): the same masks on
        # every mesh, and a resumed run repeats them.
        key = jax.random.fold_in(jax.random.key(seed), step) if dropout else None
        grads, loss, sums, aux, rest = _grads(loss_fn, state, batch, num_tokens, accum, key)
        with jax.named_scope("optimizer"):
            grad_norm = optax.global_norm(grads)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
            params = optax.apply_updates(state["params"], updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            params, opt_state, rest = keep(params, state["params"]), keep(opt_state, state["opt_state"]), \
                keep(rest, state["rest"])
        if aux["moe_load"].shape[0] > 0:
            model = nnx.merge(graphdef, params, rest)
            apply_balancing(model, aux)
            rest = nnx.state(model, nnx.Not(nnx.Param)).to_pure_dict()
        metrics = {"loss": loss, "ce_loss": sums["nll"] / num_tokens, "z_loss": sums["z"] / num_tokens,
                   "aux_loss": aux["aux_loss"], "accuracy": sums["correct"] / num_tokens,
                   "grad_norm": grad_norm, "param_norm": optax.global_norm(params),
                   "lr": lr * schedule(step - 1), "finite": finite, "moe_load": aux["moe_load"]}
        return {"params": params, "rest": rest, "opt_state": opt_state}, metrics
    return train_step


def xla_options(text: str) -> dict:
    """"xla_allow_excess_precision=false,xla_foo=3" -> {name: value} (true/false, ints and floats
    parsed, anything else kept as a string) for `jax.jit(compiler_options=)`; XLA rejects unknown
    names when the step compiles."""
    out = {}
    for item in filter(None, (s.strip() for s in str(text or "").split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("xla_"):
            raise ValueError(f"xla_options entry {item!r}: expected xla_<name>=<value>")
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[name] = lowered == "true"
            continue
        for kind in (int, float):
            try:
                out[name] = kind(value)
                break
            except ValueError:
                pass
        else:
            out[name] = value
    return out


def jit_train_step(config, graphdef, tx, schedule, state_sharding, mesh):
    """train.py's jitted train step: donates the old state, returns it in `state_sharding` and
    the metrics replicated over `mesh`, compiled with `config.xla_options`. Call it as
    (state, batch, step, lr)."""
    replicated = NamedSharding(mesh, P())
    return jax.jit(make_train_step(config, graphdef, tx, schedule), donate_argnums=(0,),
                   out_shardings=(state_sharding, replicated),
                   compiler_options=xla_options(config.get("xla_options", "")) or None)


def make_eval_step(config, graphdef):
    """(state, batch) -> {nll, correct, tokens} sums over the trained positions of the batch."""
    dtype = COMPUTE_DTYPES[config.optim.compute_dtype]

    def eval_step(state, batch):
        model = nnx.merge(graphdef, _cast(state["params"], dtype), state["rest"])
        logits = model(batch["inputs"], segment_ids=batch["segment_ids"])
        nll, _, correct = token_losses(logits, batch["targets"])
        mask = batch["loss_mask"].astype(jnp.float32)
        return {"nll": jnp.sum(nll * mask), "correct": jnp.sum(correct * mask), "tokens": jnp.sum(mask)}
    return eval_step


def global_batch(local_batch: dict, mesh) -> dict:
    """This host's rows [b, T] -> global jax.Arrays [B, T] sharded over the batch axes."""
    spec = NamedSharding(mesh, P(sharding.BATCH_AXES))
    return {k: jax.make_array_from_process_local_data(spec, v) for k, v in local_batch.items()}


__all__ = ["abstract_model", "apply_balancing", "build_model", "global_batch", "jit_train_step", "make_eval_step",
           "has_dropout", "make_init", "make_loss_fn", "make_train_step", "maybe_initialize_distributed", "param_names",
           "path_name", "remat_policy", "seed_array", "state_shardings", "token_losses"]

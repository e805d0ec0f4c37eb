"""Optimizers from `config.optim`: AdamW or Muon with warmup + cosine/WSD schedules, global-norm
clipping and decoupled weight decay behind a mask.

The transformation is built for a peak learning rate of 1.0 (the schedule's shape only): every
update it returns is linear in the learning rate (Adam's and Muon's steps, Muon's Adam-group ratio
and the decoupled weight decay all scale with it, clipping acts on the gradients before), so the
train step multiplies the updates by `optim.lr` given as a runtime argument. Runs that differ only
in the learning rate then compile the same program (one persistent-cache entry for a sweep's lrs).

Parameters are pure dicts (`nnx.State.to_pure_dict()`); the logical axis names of each parameter
(a dict `{path: names}`, see `param_info`) decide the decay mask and Muon's matrix axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# Parameters whose name contains one of these never get weight decay (norm scales, biases, the
# KDA/Mamba decay parameters).
NO_DECAY_NAMES = ("norm", "bias", "a_log", "dt_bias", "scale")
# Logical axis names that mark an embedding table or an output head.
EMBEDDING_AXES = ("vocab",)
# Leading axes Muon treats as batch (independent matrices).
BATCH_AXES = ("experts", "layers")


def path_name(path) -> str:
    """"layers/0/mlp/kernel" for a jax key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def make_schedule(optim, total_steps: int, peak: float | None = None):
    """Learning rate per step: linear warmup, then cosine to `min_lr_ratio * lr`, or WSD (constant,
    then a linear decay over the last `decay_fraction` of the steps), or constant. `peak` replaces
    `optim.lr` (1.0: the shape that the runtime learning rate scales)."""
    lr, warmup = float(optim.lr if peak is None else peak), int(optim.warmup_steps)
    final = lr * float(optim.min_lr_ratio)
    rest = max(int(total_steps) - warmup, 1)
    if optim.schedule == "cosine":
        tail = optax.cosine_decay_schedule(lr, rest, alpha=final / lr if lr else 0.0)
    elif optim.schedule == "wsd":
        n_decay = max(int(round(rest * float(optim.decay_fraction))), 1)
        tail = optax.join_schedules(
            [optax.constant_schedule(lr), optax.linear_schedule(lr, final, n_decay)], [rest - n_decay])
    elif optim.schedule == "constant":
        tail = optax.constant_schedule(lr)
    else:
        raise ValueError(f"Unknown optim.schedule={optim.schedule!r}; expected one of cosine, wsd, constant")
    if warmup <= 0:
        return tail
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), tail], [warmup])


def decay_mask(params, names: dict, decay_embeddings: bool):
    """True where weight decay applies: matrices that are not norms, biases, A_log/dt_bias, and
    (unless `decay_embeddings`) not embedding tables."""
    def one(path, x):
        key = path_name(path)
        leaf = key.lower().split("/")
        if x.ndim < 2 or any(n in part for part in leaf for n in NO_DECAY_NAMES):
            return False
        is_embedding = any(a in (names.get(key) or ()) for a in EMBEDDING_AXES)
        return decay_embeddings or not is_embedding
    return jax.tree_util.tree_map_with_path(one, params)


def muon_dimension_numbers(params, names: dict):
    """Muon's reduction/output axes per parameter from its logical names; None sends a parameter
    to Adam (vectors, embedding tables, output heads)."""
    from optax.contrib import MuonDimensionNumbers

    def one(path, x):
        axes = tuple(names.get(path_name(path)) or (None,) * x.ndim)
        if x.ndim < 2 or any(a in axes for a in EMBEDDING_AXES):
            return None
        batch = [i for i, a in enumerate(axes) if a in BATCH_AXES]
        matrix = [i for i in range(x.ndim) if i not in batch]
        if len(matrix) < 2:
            return None
        if axes[matrix[-1]] == "embed":  # [..., heads, head_dim, embed]: reduce all but the last
            reduction, output = matrix[:-1], matrix[-1:]
        else:
            reduction, output = matrix[:1], matrix[1:]
        unwrap = lambda t: t[0] if len(t) == 1 else tuple(t)  # noqa: E731
        return MuonDimensionNumbers(reduction_axis=unwrap(reduction), output_axis=unwrap(output))
    return jax.tree_util.tree_map_with_path(one, params)


def decoupled_weight_decay(rate: float, schedule, mask) -> optax.GradientTransformation:
    """Adds `-schedule(t) * rate * param` where `mask` is True (AdamW-style decoupled decay)."""
    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params):
        lr = schedule(state.count)
        m = mask(params) if callable(mask) else mask
        updates = jax.tree.map(lambda u, p, on: u - lr * rate * p.astype(u.dtype) if on else u, updates, params, m)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))
    return optax.GradientTransformation(init, update)


def make_optimizer(optim, total_steps: int, names: dict, peak_lr: float = 1.0):
    """(optax transformation, schedule) for `config.optim` at peak learning rate `peak_lr`; `names`
    maps parameter paths to logical axis names. With the default 1.0 the updates are those of
    `optim.lr` divided by it and `schedule` is the shape: scale both by the learning rate (see
    `train_lib.make_train_step`)."""
    schedule = make_schedule(optim, total_steps, peak=float(peak_lr))
    if optim.name == "adamw":
        core = optax.chain(optax.scale_by_adam(optim.b1, optim.b2, optim.eps),
                           optax.scale_by_learning_rate(schedule))
    elif optim.name == "muon":
        ratio = float(optim.muon_adam_lr_ratio)
        core = optax.contrib.muon(
            schedule, beta=optim.muon_beta, eps=optim.eps, adam_b1=optim.b1, adam_b2=optim.b2,
            adam_learning_rate=lambda t: ratio * schedule(t),
            muon_weight_dimension_numbers=lambda p: muon_dimension_numbers(p, names))
    else:
        raise ValueError(f"Unknown optim.name={optim.name!r}; expected one of adamw, muon")
    parts = []
    if optim.clip_norm and optim.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_norm))
    parts.append(core)
    if optim.weight_decay:
        mask = lambda p: decay_mask(p, names, optim.decay_embeddings)  # noqa: E731
        parts.append(decoupled_weight_decay(float(optim.weight_decay), schedule, mask))
    return optax.chain(*parts), schedule

"""Train a model from a config file: `python train.py --config configs/tiny.py --workdir DIR`.

Override keys with `--config.optim.lr=3e-4`. The run resumes from the latest checkpoint in
DIR/checkpoints on its own, writes DIR/metrics.jsonl and TensorBoard files under DIR/tensorboard.
Several hosts: run the same command on each (see README); `jax.distributed` is initialised from
the environment or from --coordinator_address/--num_processes/--process_id.
"""

from __future__ import annotations

import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from jax.experimental import multihost_utils
from ml_collections import config_flags

from kimi_jax import checkpoint, data, kernel_settings, logging_utils, optim, sharding, train_lib


def define_flags() -> None:
    """Command-line flags (defined only when run as a program, so tests can import this file
    next to eval.py)."""
    config_flags.DEFINE_config_file("config", None, "Config file (configs/<name>.py[:arg]).", lock_config=True)
    flags.DEFINE_string("workdir", None, "Where checkpoints and logs go.")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host without SLURM/TPU).")
    flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
    flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")


class NonFiniteError(RuntimeError):
    """The loss or gradients became non-finite and `skip_nonfinite_updates` is off."""


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


def train_and_evaluate(config, workdir: str) -> dict:
    """Run (or resume) training; returns the last logged metrics. The steps are traced with
    `config.kernel_settings` in place (`kimi_jax.kernel_settings`)."""
    settings = kernel_settings.parse(config.get("kernel_settings", ""))
    if settings:
        _log(f"kernel settings: {settings}")
    with kernel_settings.applied(settings):
        return _train_and_evaluate(config, workdir)


def _train_and_evaluate(config, workdir: str) -> dict:
    for key in ("log_every_steps", "checkpoint_every_steps"):
        if int(config[key]) < 1:
            raise ValueError(f"config.{key}={config[key]} must be >= 1 (eval_every_steps=0 turns evaluation off)")
    # ----------------------------------------------------------------------------------------------
    # Mesh
    # ----------------------------------------------------------------------------------------------
    mesh = sharding.make_mesh(config.mesh)
    _log(f"mesh {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].device_kind} device(s), "
         f"{jax.process_count()} process(es)")

    # ----------------------------------------------------------------------------------------------
    # Input pipeline
    # ----------------------------------------------------------------------------------------------
    seq_len = data.sequence_length(config)
    batch_devices = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))
    if config.data.batch_size % batch_devices:
        raise ValueError(f"data.batch_size={config.data.batch_size} is not divisible by the "
                         f"{batch_devices} devices of the batch axes {sharding.BATCH_AXES}")
    if data.data_vocab_size(config) > config.model.vocab_size:
        raise ValueError(f"The data has {data.data_vocab_size(config)} token ids but config.model.vocab_size is "
                         f"{config.model.vocab_size}")
    train_iter = data.make_iterator(config, "train")
    tokens_per_step = config.data.batch_size * seq_len

    # ----------------------------------------------------------------------------------------------
    # Abstract model, optimizer and shardings
    # ----------------------------------------------------------------------------------------------
    graphdef, abstract_params, abstract_rest = train_lib.abstract_model(config)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
    tx, schedule = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(abstract_params))
    state_sharding = train_lib.state_shardings(tx, abstract_params, abstract_rest, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    _log(f"model: {num_params:,} parameters; {tokens_per_step:,} tokens per step")

    # ----------------------------------------------------------------------------------------------
    # Train and eval steps (jitted; the train step donates the old state). The peak learning rate
    # is an argument, not a constant: runs that differ only in it share one compiled step.
    # ----------------------------------------------------------------------------------------------
    peak_lr = jnp.asarray(config.optim.lr, jnp.float32)
    train_step = train_lib.jit_train_step(config, graphdef, tx, schedule, state_sharding, mesh)
    eval_step = jax.jit(train_lib.make_eval_step(config, graphdef), out_shardings=replicated)

    # ----------------------------------------------------------------------------------------------
    # Restore the latest checkpoint, or initialise straight into the shardings
    # ----------------------------------------------------------------------------------------------
    ckpt = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
    start_step = ckpt.latest_step() or 0
    carried = []  # the open log window of a run stopped between two logs (see `save`)
    # (outside the mesh context: the model's parameters get their shardings from out_shardings)
    if start_step:
        abstract = jax.eval_shape(train_lib.make_init(config, tx))
        restored = ckpt.restore(start_step, checkpoint.abstract_with_shardings(abstract, state_sharding))
        state = {k: restored[k] for k in checkpoint.ITEMS}
        hosts = restored["data"]["hosts"]
        if len(hosts) != jax.process_count():
            raise ValueError(f"checkpoint step {start_step} was written by {len(hosts)} process(es); this run has "
                             f"{jax.process_count()}: the data positions cannot be resumed exactly")
        train_iter.set_state(hosts[jax.process_index()])
        carried = [{k: np.asarray(v) for k, v in m.items()} for m in restored["data"].get("window", [])]
        _log(f"resumed from step {start_step} ({checkpoint.checkpoint_dir(workdir)})")
    else:
        t0 = time.time()
        _log("initialising the train state (jitted straight into its shardings)")
        state = jax.jit(train_lib.make_init(config, tx), out_shardings=state_sharding)(
            train_lib.seed_array(config.seed))
        _log(f"train state initialised in {time.time() - t0:.1f} s")
    last_good = start_step or None

    def save(step: int, force: bool = False) -> None:
        """Checkpoint the state with every host's data position and, for a save between two logs
        (SIGTERM), the open log window, so the resumed run logs the same averages."""
        hosts = [train_iter.get_state()]
        if jax.process_count() > 1:  # every host's position, so each resumes its own share
            local = np.array([hosts[0]["doc"], hosts[0]["offset"]], np.int32)
            hosts = [{"doc": int(d), "offset": int(o)}
                     for d, o in np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 2)]
        extra = {"window": [{k: logging_utils.json_value(v) for k, v in m.items()} for m in window]} if window else {}
        ckpt.save(step, state, {"hosts": hosts, **extra}, force=force)

    def evaluate(step: int) -> dict:
        """Held-out loss and accuracy on the eval split, plus `kimi_jax.evaluators.run_all`."""
        eval_iter, sums = data.make_iterator(config, "eval"), None
        for _ in range(config.data.eval_batches):
            out = eval_step(state, train_lib.global_batch(next(eval_iter), mesh))
            sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
        sums = jax.device_get(sums)
        tokens = max(float(sums["tokens"]), 1.0)
        results = {"eval_loss": float(sums["nll"]) / tokens, "eval_accuracy": float(sums["correct"]) / tokens}
        if config.get("evals") is not None and config.evals.get("train_tasks"):  # eval.py's evaluators
            from kimi_jax import evaluators

            results.update(evaluators.run_all(config, nnx.merge(graphdef, state["params"], state["rest"]), step))
        return results

    # ----------------------------------------------------------------------------------------------
    # Train loop
    # ----------------------------------------------------------------------------------------------
    peak = logging_utils.peak_flops_per_device(config.peak_flops)
    flops_token = logging_utils.flops_per_token(config, seq_len, num_params)
    logger = logging_utils.MetricsLogger(workdir, config.total_steps, resume_step=start_step)
    stop = {"signal": None}
    previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    profile = tuple(config.profile_steps)
    window, pending, last_metrics = carried, None, {}
    clock = {"start": time.time(), "steps": 0, "first": None}

    def check(step: int, metrics) -> None:
        """Fetch a step's metrics (one step behind the device) and stop on non-finite values."""
        metrics = jax.device_get(metrics)
        if not bool(metrics["finite"]):
            msg = (f"non-finite loss or gradient at step {step} (loss={float(metrics['loss'])}, "
                   f"grad_norm={float(metrics['grad_norm'])})")
            if not config.skip_nonfinite_updates:
                raise NonFiniteError(f"{msg}; stopping. Last good checkpoint: "
                                     f"{f'step {last_good}' if last_good else 'none'} in "
                                     f"{checkpoint.checkpoint_dir(workdir)}")
            _log(f"{msg}; update skipped")
        window.append(metrics)

    def timing() -> dict:
        per_step = (time.time() - clock["start"]) / clock["steps"] if clock["steps"] else clock["first"]
        out = {"tokens_per_sec": tokens_per_step / per_step, "step_time_ms": 1000 * per_step}
        if peak:
            out["mfu"] = flops_token * tokens_per_step / per_step / (peak * jax.device_count())
        return out

    def summarize_profile(batch, step: int, steps) -> None:
        """Device time of the traced steps by model part (kimi_jax.profile_summary): the step's
        optimized HLO comes from the compilation cache (lower + compile of the same arguments)."""
        from kimi_jax import profile_summary

        with jax.set_mesh(mesh):
            hlo = train_step.lower(state, batch, jnp.asarray(step, jnp.int32), peak_lr).compile().as_text()
        folder = f"{workdir}/profile"
        summary = profile_summary.write_profile(folder, hlo, steps[-1] - steps[0] + 1)
        _log(f"profile of steps {steps[0]}-{steps[-1]} in {folder} (summary.json):\n{profile_summary.markdown(summary)}")

    step = start_step
    try:
        while step < config.total_steps:
            step += 1
            if profile and step == profile[0]:
                jax.profiler.start_trace(f"{workdir}/profile")
            with jax.set_mesh(mesh):
                batch = train_lib.global_batch(next(train_iter), mesh)
                state, metrics = train_step(state, batch, jnp.asarray(step, jnp.int32), peak_lr)
            if profile and step == profile[-1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                if jax.process_index() == 0:
                    summarize_profile(batch, step, profile)
            if pending is not None:
                check(*pending)
            pending = (step, metrics)
            if clock["first"] is None:  # the first step compiles: time the steps after it
                jax.block_until_ready(metrics)
                clock.update(first=time.time() - clock["start"], start=time.time())
            else:
                clock["steps"] += 1
            preempted = stop["signal"] is not None
            if jax.process_count() > 1:
                preempted = bool(np.asarray(multihost_utils.process_allgather(np.array(preempted))).any())
            do_eval = bool(config.eval_every_steps) and (
                step % config.eval_every_steps == 0 or step == config.total_steps)
            do_save = step % config.checkpoint_every_steps == 0 or step == config.total_steps
            do_log = do_eval or do_save or step % config.log_every_steps == 0
            if do_log or preempted:
                check(*pending)
                pending = None
            if do_log:
                last_metrics = {k: float(np.mean([float(m[k]) for m in window])) for k in train_lib.SCALARS}
                last_metrics.update(timing())
                last_metrics.update(logging_utils.moe_load_metrics(window[-1]["moe_load"]))
                if do_eval:
                    with jax.set_mesh(mesh):
                        last_metrics.update(evaluate(step))
                logger.write(step, last_metrics)
                window.clear()
            if do_save or preempted:  # a preempted save keeps the open window (see `save`)
                save(step, force=True)
                last_good = step
            if not window:  # a window ended: time the next one from here (after eval and save)
                clock.update(start=time.time(), steps=0)
            if preempted:
                _log(f"signal {stop['signal']}: saved step {step}; exiting")
                break
        if pending is not None:
            check(*pending)
    finally:
        ckpt.wait()
        ckpt.close()
        logger.close()
        signal.signal(signal.SIGTERM, previous_handler)
    return last_metrics


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    logging_utils.quiet_library_logs(FLAGS["verbosity"].present)
    if FLAGS.config.distributed or FLAGS.coordinator_address:
        train_lib.maybe_initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except NonFiniteError as e:
        _log(f"error: {e}")
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)

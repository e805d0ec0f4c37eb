"""Where a train step's time goes: forward + backward of each piece of the 1.3B K3 dense model
(configs/k3_1b3_dense.py) at the benchmark shape, each jitted and timed alone on one device.

    python benchmarks/train_parts.py --batch_size 4 --seq_len 4096 --out parts.json

Pieces, in this order (a run cut short keeps the first): MLA's attention core alone through
`kimi_jax.attention.core.attention` (the float32-logit XLA path; cuDNN's MLA form, q/k 192 and
v 128; cuDNN with packed documents, one per row and 16 per row, where v is zero-padded to 192,
and once without that padding), the KDA
(per --kda_impls too) and MLA mixers (pre-norm included) and the MLP under the config's remat
policy, the head + cross-entropy and the optimizer update, then the layer pieces under the
other --policies. Each piece returns its value and gradients, so
its forward runs as in the model and the backward recomputes what the policy drops. The sum over
the model's layers estimates the step. The JSON is rewritten after every piece.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import environment  # noqa: E402
from benchmarks.train import load_config, log  # noqa: E402
from kimi_jax import optim, train_lib  # noqa: E402
from kimi_jax.attention.core import attention, cudnn_attention  # noqa: E402
from kimi_jax.config import ModelConfig  # noqa: E402
from kimi_jax.ffn import MLP  # noqa: E402
from kimi_jax.layers import Linear, RMSNorm  # noqa: E402
from kimi_jax.attention import build_mixer  # noqa: E402
from kimi_jax.remat import POLICIES, make_policy  # noqa: E402


def timed(fn, *args, iters: int = 10) -> dict:
    """Compile `fn(*args)`, then the median of `iters` synchronous calls, in ms."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(1000 * (time.perf_counter() - t0))
    return {"ms": statistics.median(times), "ms_min": min(times), "compile_s": compile_s}


def fwd_bwd(module_fn, module, x, policy: str):
    """(params, x) -> (sum(module_fn(module, x)), grads) under remat `policy`."""
    graphdef, params = nnx.split(module)

    def loss(params, x):
        y = module_fn(nnx.merge(graphdef, params), x)
        return jnp.sum(y.astype(jnp.float32))
    if POLICIES[policy] is not None:
        loss = jax.checkpoint(loss, policy=make_policy(policy, x.shape[0] * x.shape[1]))
    return jax.value_and_grad(loss, argnums=(0, 1)), params, x


class PreNormMixer(nnx.Module):
    def __init__(self, cfg: ModelConfig, name: str, kw):
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
        self.mixer = build_mixer(name, cfg.settings(name), cfg.d_model, **kw)

    def __call__(self, x, segment_ids):
        return self.mixer(self.norm(x), segment_ids=segment_ids)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/k3_1b3_dense.py")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--kda_impls", default="", help="KDA impls to time the KDA mixer with besides the config's")
    parser.add_argument("--policies", default="none,dots16,dots_all", help="remat policies timed besides the config's")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    cfg = ModelConfig.from_config_dict(config.model)
    policy = train_lib.remat_policy(config)
    B, T, D = args.batch_size, args.seq_len, cfg.d_model
    dtype = train_lib.COMPUTE_DTYPES[config.optim.compute_dtype]
    kw = dict(dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (B, T, D), jnp.float32).astype(dtype)
    seg = jnp.ones((B, T), jnp.int32)
    results = {"env": environment(), "config": args.config, "device": jax.devices()[0].device_kind, "batch": B,
               "seq_len": T, "policy": policy, "parts": {}}
    jobs = []  # (name, () -> (fn, *args)), run in order of interest; the JSON is rewritten after each

    mla = cfg.settings("mla")
    H, dqk, dv = mla["num_heads"], mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], mla["v_head_dim"]
    ks = jax.random.split(jax.random.key(2), 3)
    q, k = (jax.random.normal(kk, (B, T, H, dqk), dtype) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, dv), dtype)
    docs16 = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // max(T // 16, 1), (B, T))
    core = lambda impl, seg: lambda q, k, v: attention(  # noqa: E731
        q, k, v, seg, scale=dqk**-0.5, impl=impl, max_segments=mla.get("max_segments", 64))
    cores = {"xla f32 logits": core("xla", None),
             "cudnn mla (q/k 192, v 128)": core("cudnn", None),
             "cudnn, segment_ids of 1 document per row (plain causal kernel)": core("cudnn", seg),
             "cudnn ragged layout, 1 document per row": lambda q, k, v: cudnn_attention(
                 q, k, v, seg, dqk**-0.5, mla.get("max_segments", 64)),
             "cudnn packed, 16 documents per row": core("cudnn", docs16)}
    for name, fn in cores.items():
        grad = jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        jobs.append((f"mla attention core {name} fwd+bwd", lambda grad=grad: (grad, q, k, v)))

    pieces = {f"mixer {name}": PreNormMixer(cfg, name, kw) for name in sorted(set(cfg.layer_mixers))}
    for impl in [i for i in args.kda_impls.split(",") if i and "kda" in cfg.layer_mixers]:
        model = config.model.to_dict()
        model["mixers"]["kda"]["impl"] = impl
        pieces[f"mixer kda impl={impl}"] = PreNormMixer(ModelConfig.from_config_dict(model), "kda", kw)
    pieces["mlp"] = MLP(D, cfg.dense_hidden, activation=cfg.activation, situ_beta=cfg.situ_beta,
                        situ_linear_beta=cfg.situ_linear_beta, **kw)
    policies = list(dict.fromkeys([policy] + [p for p in args.policies.split(",") if p]))
    later = []  # the other policies run after the head and the optimizer (the step estimate first)
    for pol in policies:
        for name, module in pieces.items():
            call = (lambda m, x: m(x, seg)) if name.startswith("mixer") else (lambda m, x: m(x))
            (jobs if pol == policy else later).append(
                (f"{name} fwd+bwd remat={pol}", lambda call=call, module=module, pol=pol: fwd_bwd(call, module, x, pol)))

    head = Linear(D, cfg.vocab_size, axes=("embed", "vocab"), **kw)
    targets = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    jobs.append(("head + cross-entropy fwd+bwd", lambda: fwd_bwd(
        lambda m, x: train_lib.token_losses(m(x).astype(jnp.float32), targets)[0], head, x, "none")))

    def update_job():
        graphdef, params, rest = train_lib.abstract_model(config)
        tx, _ = optim.make_optimizer(config.optim, config.total_steps, train_lib.param_names(params))
        state = train_lib.make_init(config, tx)()  # op by op: a jitted 1.3B init compiles for minutes
        grads = jax.tree.map(jnp.ones_like, state["params"])

        def update(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        return update, state["params"], state["opt_state"], grads
    jobs.append(("optimizer update (all params)", update_job))
    jobs += later

    for name, make in jobs:
        try:
            r = results["parts"][name] = timed(*make(), iters=args.iters)
            log(f"{name}: {r['ms']:.2f} ms (compile {r['compile_s']:.1f} s)")
        except Exception as e:  # noqa: BLE001 - OOM, cuDNN absent, unsupported shape: go on
            results["parts"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            log(f"{name}: {results['parts'][name]['error']}")
        gc.collect()
        estimate(results, cfg, policy)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    if "estimated_step_ms" in results:
        log(f"estimated step (sum of pieces, remat={policy}): {results['estimated_step_ms']:.1f} ms")
    return results


def estimate(results: dict, cfg: ModelConfig, policy: str) -> None:
    """Sum of the pieces over the model's layers, once every piece has a time."""
    parts = {k: v["ms"] for k, v in results["parts"].items() if "ms" in v}
    count = {name: cfg.layer_mixers.count(name) for name in set(cfg.layer_mixers)}
    try:
        est = sum(n * parts[f"mixer {m} fwd+bwd remat={policy}"] for m, n in count.items())
        est += cfg.num_layers * parts[f"mlp fwd+bwd remat={policy}"]
        est += parts["head + cross-entropy fwd+bwd"] + parts["optimizer update (all params)"]
    except KeyError:
        return
    results["estimated_step_ms"] = est


if __name__ == "__main__":
    main()

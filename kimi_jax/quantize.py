"""MXFP4 routed experts for inference, and the checkpoint converter.

    python -m kimi_jax.quantize --config configs/tiny.py --workdir DIR [--out DIR/mxfp4]

reads the latest checkpoint of a train.py run in DIR, quantises every MoE layer's routed-expert
weights to MXFP4 (OCP MX v1.0 via `kernels.mxfp4`: blocks of 32 along each matmul's contraction,
4.25 bits per parameter) and writes a checkpoint of the quantised model (step kept) to --out.
Load it with `load_model(quantized_config(config), out)`. Everything else (attention, KDA,
shared experts, router, latent projections, embeddings) keeps its dtype, as in K3's release.

The quantised model is `config.model.moe.experts_dtype = "mxfp4"`: its MoE layers hold
`MXFP4Experts` (packed bytes in non-trainable `PackedWeight` variables) and compute through
`kernels.mxfp4.gmm`, which reads the packed weights (Pallas on Hopper, dequantise + ragged_dot
elsewhere); that needs a grouped-matmul dispatch ("gmm" or "expert_parallel").
"""

from __future__ import annotations

import argparse
import copy
import os

import jax.numpy as jnp
from flax import nnx

from kernels import mxfp4
from kimi_jax.moe_dispatch import ExpertWeights

EXPERTS_DTYPES = (None, "mxfp4")
PACKED_DISPATCH = ("gmm", "expert_parallel", "auto")  # "auto" picks one of the other two for MXFP4


class PackedWeight(nnx.Variable):
    """MXFP4 bytes (packed elements or E8M0 scales) of a quantised weight: not trainable."""


class MXFP4Experts(nnx.Module):
    """E experts with gate/up [E, width, hidden], down [E, hidden, width] stored as MXFP4 along
    each contraction axis (packed [E, out, in/2] + scales [E, out, in/32]). Built empty (zero
    bytes); `load_dense` fills it from float weights."""

    def __init__(self, num_experts: int, width: int, hidden: int, *, in_axis: str,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        del in_axis, param_dtype, rngs  # no float parameters, nothing random
        for name, n in (("width", width), ("hidden", hidden)):
            if n % mxfp4.BLOCK:
                raise ValueError(f"MXFP4 experts need {name}={n} to be a multiple of "
                                 f"{mxfp4.BLOCK} (the block size along the contraction)")
        shapes = {"gate": (hidden, width), "up": (hidden, width), "down": (width, hidden)}
        names = ("experts", None, None)
        for name, (out, k) in shapes.items():
            for suffix, width in (("packed", k // 2), ("scales", k // mxfp4.BLOCK)):
                setattr(self, f"{name}_{suffix}", PackedWeight(
                    jnp.zeros((num_experts, out, width), jnp.uint8), out_sharding=names,
                    eager_sharding=False))

    def _weight(self, name) -> mxfp4.MXFP4Weight:
        return mxfp4.MXFP4Weight(getattr(self, f"{name}_packed")[...],
                                 getattr(self, f"{name}_scales")[...])

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self._weight("gate"), self._weight("up"), self._weight("down"))

    def load_dense(self, dense: ExpertWeights) -> None:
        """Quantise float gate/up [E, width, hidden] and down [E, hidden, width] into self."""
        for name, w in zip(("gate", "up", "down"), dense):
            q = mxfp4.MXFP4Weight.from_dense(jnp.asarray(w, jnp.float32))
            if q.packed.shape != getattr(self, f"{name}_packed").shape:
                raise ValueError(f"{name}: weight {w.shape} does not fit {self._weight(name).shape}")
            getattr(self, f"{name}_packed")[...] = q.packed
            getattr(self, f"{name}_scales")[...] = q.scales


def check_experts_dtype(experts_dtype, dispatch: str) -> None:
    """Config check (called by MoEConfig): a known dtype and a dispatch that reads packed weights."""
    if experts_dtype not in EXPERTS_DTYPES:
        raise ValueError(f"Unknown moe.experts_dtype={experts_dtype!r}; expected one of "
                         f"{list(EXPERTS_DTYPES)}")
    if experts_dtype == "mxfp4" and dispatch not in PACKED_DISPATCH:
        raise ValueError(f"moe.experts_dtype='mxfp4' needs moe.dispatch in {list(PACKED_DISPATCH)}"
                         f", got {dispatch!r}")


def logical_size(path, var) -> int:
    """Parameters a state entry stands for: 2 per packed MXFP4 byte, 0 for scales, else its size."""
    size = int(var.get_value().size)
    if isinstance(var, PackedWeight):
        return 2 * size if str(path[-1]).endswith("_packed") else 0
    return size


def storage(model) -> tuple[int, int]:
    """(routed-expert parameters held as MXFP4, their bytes incl. scales) over the model."""
    params = nbytes = 0
    for path, var in nnx.to_flat_state(nnx.state(model, PackedWeight)):
        nbytes += int(var.get_value().size)
        params += logical_size(path, var)
    return params, nbytes


def storage_line(model) -> str | None:
    """The summary line for quantised experts (None when the model has none)."""
    params, nbytes = storage(model)
    if not params:
        return None
    return (f"routed experts in mxfp4: {params:,} params in {nbytes:,} bytes = "
            f"{8 * nbytes / params:.2f} bits per parameter")


def quantized_config(config):
    """A copy of the full config whose MoE experts are MXFP4 (dispatch "gmm" unless it already
    reads packed weights, as "auto" does)."""
    config = copy.deepcopy(config)
    moe = config.model.moe
    if moe is None:
        raise ValueError("quantized_config: config.model.moe is None (no routed experts)")
    moe.experts_dtype = "mxfp4"
    from kimi_jax.config import MoEConfig  # (config imports this module) the default of a config without the key

    if moe.get("dispatch", MoEConfig.dispatch) not in PACKED_DISPATCH:
        moe.dispatch = "gmm"
    return config


def quantize_model(model, config):
    """The MXFP4 model of `quantized_config(config)` with `model`'s weights (experts quantised)."""
    from kimi_jax import build_model

    qmodel = nnx.eval_shape(lambda: build_model(quantized_config(config), rngs=nnx.Rngs(0)))
    src = nnx.to_flat_state(nnx.state(model))
    src = {tuple(str(p) for p in path): var for path, var in src}
    dst_state = nnx.state(qmodel)
    for path, var in nnx.to_flat_state(dst_state):
        key = tuple(str(p) for p in path)
        if key in src:
            var.set_value(src[key].get_value())
        elif not isinstance(var, PackedWeight):
            raise ValueError(f"quantize_model: no source for {'/'.join(key)}")
        else:
            var.set_value(jnp.zeros(var.get_value().shape, var.get_value().dtype))
    nnx.update(qmodel, dst_state)
    for float_moe, q_moe in zip(model.moe_layers(), qmodel.moe_layers()):
        q_moe.experts.load_dense(float_moe.experts.weights())
    return qmodel


def save(model, workdir: str, step: int) -> None:
    """Write `model` as checkpoint `step` of `workdir` in train.py's layout (no optimizer state)."""
    from kimi_jax.checkpoint import Checkpointer

    params, rest = nnx.state(model, nnx.Param, ...)
    ckpt = Checkpointer(workdir, async_save=False)
    ckpt.save(step, {"params": params.to_pure_dict(), "rest": rest.to_pure_dict(),
                     "opt_state": {}}, {}, force=True)
    ckpt.wait()
    ckpt.close()


def main(argv=None):
    from kimi_jax.checkpoint import Checkpointer, load_model
    from kimi_jax.summary import load_config

    parser = argparse.ArgumentParser(description="Quantise a checkpoint's routed experts to MXFP4.")
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--workdir", required=True, help="train.py workdir with checkpoints")
    parser.add_argument("--out", default=None, help="output workdir (default WORKDIR/mxfp4)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    step = Checkpointer(args.workdir, async_save=False).latest_step()
    model = load_model(config, args.workdir, step)
    qmodel = quantize_model(model, config)
    out = args.out or os.path.join(args.workdir, "mxfp4")
    save(qmodel, out, step)
    print(f"quantised step {step} of {args.workdir} -> {out}")
    print(storage_line(qmodel))
    return out


if __name__ == "__main__":
    main()

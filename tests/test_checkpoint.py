"""Orbax checkpoints: round trip into new shardings, keeping the last N, a save killed midway
never being loaded, and `load_model`."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax import checkpoint, sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(value: float):
    return {"params": {"w": jnp.full((8, 4), value), "layers": {"0": {"b": jnp.arange(4.0) + value}}},
            "rest": {}, "opt_state": (jnp.asarray(3, jnp.int32), {"mu": jnp.full((8, 4), -value)})}


def test_round_trip_into_new_shardings_and_keep_last(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(float(step)), {"hosts": [{"doc": step, "offset": 0}]})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    mesh = sharding.make_mesh({"fsdp": 8})
    shard = jax.tree.map(lambda x: NamedSharding(mesh, P("fsdp") if x.ndim == 2 else P()), _state(0.0))
    target = checkpoint.abstract_with_shardings(_state(0.0), shard)
    restored = ckpt.restore(3, target)
    ckpt.close()
    np.testing.assert_array_equal(restored["params"]["w"], np.full((8, 4), 3.0))
    np.testing.assert_array_equal(restored["opt_state"][1]["mu"], np.full((8, 4), -3.0))
    assert int(restored["opt_state"][0]) == 3 and restored["rest"] == {}
    assert restored["params"]["w"].sharding.spec == P("fsdp")
    assert restored["data"] == {"hosts": [{"doc": 3, "offset": 0}]}


def test_a_save_killed_midway_is_never_loaded(tmp_path):
    """A process saves step 1, starts the asynchronous save of step 2 and dies once that save has
    made its temporary folder."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        import jax.numpy as jnp
        from kimi_jax import checkpoint
        ckpt = checkpoint.Checkpointer({str(tmp_path)!r})
        small = {{"params": {{"w": jnp.ones((4,))}}, "rest": {{}}, "opt_state": {{"c": jnp.zeros(())}}}}
        ckpt.save(1, small, {{"step": 1}})
        ckpt.wait()
        big = {{"params": {{"w": jnp.full((32, 1024, 1024), 7.0)}}, "rest": {{}}, "opt_state": {{"c": jnp.zeros(())}}}}
        ckpt.save(2, big, {{"step": 2}})
        root = checkpoint.checkpoint_dir({str(tmp_path)!r})
        for _ in range(20000):  # killed mid-save: once its temporary folder exists (made in the background)
            if any(e.startswith("2.") for e in os.listdir(root)):
                break
            time.sleep(0.0005)
        os._exit(0)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    entries = os.listdir(checkpoint.checkpoint_dir(str(tmp_path)))
    assert "1" in entries and "2" not in entries, entries
    assert any(e.startswith("2.") for e in entries), entries  # the unfinished temporary folder
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    assert ckpt.latest_step() == 1
    target = {"params": {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, "rest": {},
              "opt_state": {"c": jax.ShapeDtypeStruct((), jnp.float32)}}
    restored = ckpt.restore(1, target)
    np.testing.assert_array_equal(restored["params"]["w"], np.ones(4))
    # a new run saves over the debris without trouble
    ckpt.save(2, {"params": {"w": jnp.zeros((4,))}, "rest": {}, "opt_state": {"c": jnp.zeros(())}}, {"step": 2})
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()


def test_load_model_is_exported_and_needs_a_checkpoint(tmp_path):
    import pytest

    import kimi_jax
    from tests.toy_lm import toy_config

    assert kimi_jax.load_model is checkpoint.load_model
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        checkpoint.load_model(toy_config(), str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()  # looking leaves the workdir as it was
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="No checkpoint"):  # a folder without a step
        checkpoint.load_model(toy_config(), str(tmp_path))


def test_small_replicated_arrays_are_saved_whole(tmp_path, monkeypatch):
    """On a data x fsdp mesh every shard has replicas. Arrays whose per-replica piece would be
    under MIN_REPLICA_SLICE_BYTES are written whole by one replica (no slice op per piece); a large
    one is still split among its replicas. The saved values round-trip either way."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp")))  # replicated over "data"
    small = put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16))
    rows = 4 * 2 * checkpoint.MIN_REPLICA_SLICE_BYTES // (256 * 4)  # per replica: exactly the threshold
    large = put(jnp.ones((rows, 256), jnp.float32))
    slices = []
    real = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(1) or real(*a, **k))
    for step, params in ((1, {"w": small}), (2, {"w": large})):
        ckpt = checkpoint.Checkpointer(str(tmp_path / str(step)), async_save=False)
        before = len(slices)
        ckpt.save(step, {"params": params, "rest": {}, "opt_state": {}}, {"step": step})
        ckpt.wait()
        assert (len(slices) > before) == (step == 2), (step, len(slices) - before)
        back = ckpt.restore(step, checkpoint.abstract_with_shardings(
            {"params": params, "rest": {}, "opt_state": {}}, {"params": {"w": params["w"].sharding}, "rest": {},
                                                               "opt_state": {}}))
        np.testing.assert_array_equal(np.asarray(back["params"]["w"]), np.asarray(params["w"]))
        ckpt.close()

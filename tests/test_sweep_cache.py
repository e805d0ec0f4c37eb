"""sweep.py's shared compilation cache: the environment handed to trials, the run order that puts
the trials of one grid point apart, and a real two-trial sweep on CPU whose second trial loads
programs the first one compiled."""

import glob
import os
import subprocess
import sys

import sweep as sw
from tests.cpu_env import one_cpu_process_env
from configs.sweeps import mqar
from tests.test_sweep import ROOT, _sweep


def test_compile_cache_env(tmp_path):
    assert sw.compile_cache_env("") == {} and sw.compile_cache_env("off") == {}
    env = sw.compile_cache_env(str(tmp_path / "cache"), 0.5)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.5"
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"
    runner = sw.SubprocessRunner(share=2, extra_env=env)
    assert runner.env("1")["JAX_COMPILATION_CACHE_DIR"] == env["JAX_COMPILATION_CACHE_DIR"]
    assert runner.env("1")["CUDA_VISIBLE_DEVICES"] == "1"
    alone = sw.SubprocessRunner().env("0")
    assert alone.get("JAX_COMPILATION_CACHE_DIR") == os.environ.get("JAX_COMPILATION_CACHE_DIR")


def test_run_order_puts_the_trials_of_a_point_apart():
    """mixer x setting x lr (2 x 2 x 2): the four points at their first lr, then at their second."""
    trials = sw.make_trials(_sweep(), "/nonexistent")
    order = sw.run_order(trials, "lr")
    assert sorted(t.name for t in order) == sorted(t.name for t in trials)
    point = lambda t: (t.point["mixer"], t.point["seq_len"])  # noqa: E731
    assert len({point(t) for t in order[:4]}) == 4 and {t.point["lr"] for t in order[:4]} == {1e-3}
    assert [point(t) for t in order[4:]] == [point(t) for t in order[:4]]
    assert {t.point["lr"] for t in order[4:]} == {1e-2}
    # Without a repeated point the order is kept.
    assert sw.run_order(trials, "mixer") != trials and sw.run_order(trials[:1], "lr") == trials[:1]


def test_second_trial_loads_the_first_ones_programs(tmp_path):
    """mqar.py:tiny one trial at a time: the second trial (another lr) loads every program the
    first compiled from DIR/xla_cache, the train step included (the lr is an argument of it)."""
    env = one_cpu_process_env(JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    out = subprocess.run([sys.executable, "sweep.py", "--config", "configs/sweeps/mqar.py:tiny",
                          "--workdir", str(tmp_path), "--parallel", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert f"compilation cache {tmp_path / 'xla_cache'}" in out.stdout
    assert glob.glob(str(tmp_path / "xla_cache" / "jit_init-*"))
    trials = sw.run_order(sw.make_trials(mqar.get_config("tiny"), str(tmp_path)), "lr")
    logs = {name: open(os.path.join(trials[1].workdir, f"{name}.log")).read() for name in ("train", "eval")}
    assert "Persistent compilation cache hit for 'jit_init'" in logs["train"]
    assert "Persistent compilation cache hit for 'jit_train_step'" in logs["train"]
    assert "Persistent compilation cache hit" in logs["eval"] and "CACHE MISS" not in logs["eval"]

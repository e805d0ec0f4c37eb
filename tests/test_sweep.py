"""sweep.py: grid expansion, trial commands, best-lr selection, restart skipping, device handout
with a fake trial runner; then a real two-trial sweep (train.py + eval.py) on CPU."""

import json
import os
import subprocess
import sys
import threading
import time

import ml_collections
import pytest

import sweep as sw
from tests.cpu_env import one_cpu_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep():
    s = ml_collections.ConfigDict()
    s.trial_config = "configs/x.py"
    s.trial_arg = "trial,mixer={mixer},seq_len={seq_len}"
    s.axes = ml_collections.ConfigDict()
    s.axes.mixer = ["a", "b"]
    s.axes.setting = [dict(seq_len=16, num_kv_pairs=2), dict(seq_len=32, num_kv_pairs=4)]
    s.axes.lr = [1e-3, 1e-2]
    s.overrides = [("optim.lr", "{lr}"), ("data.batch_size", "8")]
    s.eval_tasks = "train_task"
    s.score_task = "mqar"
    s.score_setting = "L{seq_len}_K{num_kv_pairs}"
    s.select_over = "lr"
    s.plot = dict(x="seq_len", line="mixer", panel="setting")
    return s


def fake_score(point):
    """b beats a; lr 1e-2 is best for a, lr 1e-3 for b; longer is harder."""
    base = {"a": 0.5, "b": 0.8}[point["mixer"]] - point["seq_len"] / 200
    good = (point["mixer"] == "a") == (point["lr"] == 1e-2)
    return round(base + (0.1 if good else 0.0), 4)


class FakeRunner:
    def __init__(self, fail=()):
        self.fail, self.calls, self.active, self.lock, self.clash = set(fail), [], set(), threading.Lock(), False

    def __call__(self, trial, device):
        with self.lock:
            self.clash |= device in self.active
            self.active.add(device)
            self.calls.append((trial.name, device))
        time.sleep(0.02)
        with self.lock:
            self.active.discard(device)
        if trial.name in self.fail:
            return False
        os.makedirs(os.path.join(trial.workdir, "eval"), exist_ok=True)
        with open(os.path.join(trial.workdir, "eval", "results.json"), "w") as f:
            json.dump({"mqar": {f"L{trial.point['seq_len']}_K{trial.point['num_kv_pairs']}":
                                fake_score(trial.point)}}, f)
        return True


def test_grid_and_commands(tmp_path):
    trials = sw.make_trials(_sweep(), str(tmp_path))
    assert len(trials) == 8 and len({t.name for t in trials}) == 8
    t = next(t for t in trials if t.point["mixer"] == "b" and t.point["seq_len"] == 32 and t.point["lr"] == 1e-3)
    assert t.point["num_kv_pairs"] == 4 and t.score_key == ("mqar", "L32_K4")
    train, ev = t.commands("py")
    assert train[:2] == ["py", os.path.join(sw.REPO, "train.py")] and os.path.isabs(train[1])
    assert train[2:4] == ["--config", "configs/x.py:trial,mixer=b,seq_len=32"]  # no such file: kept as given
    assert train[4:6] == ["--workdir", t.workdir] and t.workdir.startswith(str(tmp_path / "trials"))
    assert train[6:] == ["--config.optim.lr=0.001", "--config.data.batch_size=8"]
    assert ev[1] == os.path.join(sw.REPO, "eval.py") and ev[-2:] == ["--tasks", "train_task"]


def test_launcher_wrapping():
    cmd = ["python", "train.py", "--workdir", "a b"]
    assert sw.SubprocessRunner("srun -N 2").wrap(cmd) == ["srun", "-N", "2", *cmd]
    wrapped = sw.SubprocessRunner("ssh pod --command '{cmd}'").wrap(cmd)
    assert wrapped[:2] == ["bash", "-c"] and "python train.py --workdir 'a b'" in wrapped[2]
    assert sw.SubprocessRunner("").wrap(cmd) == cmd


def test_best_lr_restart_and_devices(tmp_path):
    sweep = _sweep()
    trials = sw.make_trials(sweep, str(tmp_path))
    failing = trials[3].name
    runner = FakeRunner(fail={failing})
    status = sw.run_trials(trials, runner, parallel=2, devices=["0", "1"])
    assert not runner.clash and {d for _, d in runner.calls} == {"0", "1"}
    assert status[failing] == "failed" and list(status.values()).count("done") == 7
    # Restart: finished trials are skipped, the failed one runs again.
    runner2 = FakeRunner()
    status = sw.run_trials(trials, runner2, parallel=1)
    assert [n for n, _ in runner2.calls] == [failing] and status[failing] == "done"
    assert list(status.values()).count("skipped") == 7
    rows = sw.summarize(sweep, trials)
    assert len(rows) == 4
    for r in rows:
        point = dict(mixer=r["mixer"], seq_len=r["seq_len"])
        want_lr = 1e-2 if r["mixer"] == "a" else 1e-3
        assert r["lr"] == want_lr and r["score"] == fake_score({**point, "lr": want_lr}) and r["trials"] == 2
    sw.write_summary(sweep, rows, str(tmp_path))
    assert json.load(open(tmp_path / "summary.json")) == rows
    md = (tmp_path / "summary.md").read_text()
    assert "| best lr | score |" in md and md.count("\n") == 2 + 4
    assert (tmp_path / "summary.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="exceeds"):
        sw.run_trials(trials[:1], FakeRunner(), parallel=3, devices=["0"])


def test_tiny_sweep_end_to_end(tmp_path):
    """configs/sweeps/mqar.py:tiny: a run cut by its deadline (summary marked partial), then two
    real trials (train.py + eval.py) on CPU in parallel, then restarts that run only the trials
    not done."""
    env = one_cpu_process_env()
    cmd = [sys.executable, "sweep.py", "--config", "configs/sweeps/mqar.py:tiny", "--workdir", str(tmp_path)]
    cut = subprocess.run(cmd + ["--parallel", "1", "--deadline_s", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert cut.returncode == 1, cut.stdout[-2000:] + cut.stderr[-4000:]
    assert (tmp_path / "summary.md").read_text().startswith("Partial: 0 of 2 trials finished")
    assert [r["finished"] for r in json.load(open(tmp_path / "summary.json"))] == [0]
    assert {r["status"] for r in json.load(open(tmp_path / "status.json")).values()} <= {"stopped", "not_run"}
    assert (tmp_path / "summary.png").exists()
    out = subprocess.run(cmd + ["--parallel", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert not (tmp_path / "summary.md").read_text().startswith("Partial")
    rows = json.load(open(tmp_path / "summary.json"))
    assert len(rows) == 1 and rows[0]["trials"] == 2 and 0.0 <= rows[0]["score"] <= 1.0
    assert rows[0]["lr"] in (1e-3, 1e-2)
    trial_dirs = sorted(os.listdir(tmp_path / "trials"))
    assert len(trial_dirs) == 2
    for d in trial_dirs:
        res = json.load(open(tmp_path / "trials" / d / "eval" / "results.json"))
        assert list(res) == ["mqar"] and list(res["mqar"]) == ["L16_K2"]
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and "'skipped': 2" in again.stdout
    # A trial whose DONE is missing (as after a deadline) runs again, alone.
    kept, redo = (tmp_path / "trials" / d for d in trial_dirs)
    (redo / "DONE").unlink()
    kept_log = (kept / "train.log").stat().st_mtime_ns
    # ... from another directory, with a relative workdir: the trials find train.py, eval.py and
    # their config in the repo.
    elsewhere = [sys.executable, os.path.join(ROOT, "sweep.py"), "--config",
                 os.path.join(ROOT, "configs/sweeps/mqar.py") + ":tiny", "--workdir", "."]
    third = subprocess.run(elsewhere, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-4000:]
    assert "{'done': 1, 'skipped': 1," in third.stdout and "1/1 (done 1) at" in third.stdout
    assert (redo / "DONE").exists() and (kept / "train.log").stat().st_mtime_ns == kept_log


@pytest.mark.parametrize("name,variant,count", [("mqar", None, 6 * 3 * 4 * 4), ("mqar", "gpu", 6 * 2 * 2 * 2),
                                                ("mqar", "gpu_small", 6 * 2 * 2), ("mqar", "gpu_hard", 6 * 2 * 2),
                                                ("mqar", "cpu", 6 * 2),
                                                ("mqar", "gpu,hi_lr,mixers=softmax+linear", 2 * 2 * 2 * 3),
                                                ("kimi", None, 3 * 4 * 4 * 4)])
def test_every_trial_of_the_sweep_configs_builds(name, variant, count):
    """Every trial's config: its task and its model (e.g. the 3:1 hybrid needs 4 layers)."""
    import importlib

    from kimi_jax.config import ModelConfig
    from kimi_jax.tasks import make_task

    module = importlib.import_module(f"configs.sweeps.{name}")
    sweep = module.get_config(variant)
    trials = sw.make_trials(sweep, "/nonexistent")
    assert len(trials) == count
    seen = set()
    for t in trials:
        arg = t.config.split(":", 1)[1]
        if arg in seen:  # lr is an override, not part of the config arg
            continue
        seen.add(arg)
        config = module.get_config(arg)
        task = make_task(config.data.task, **config.data.task_kwargs)
        assert task.vocab_size <= config.model.vocab_size and config.total_steps > 0
        ModelConfig.from_config_dict(config.model)
        assert t.score_key[0] == task.name
        assert t.score_key[1] in ("", task.setting)


def test_summary_of_a_partial_sweep_is_marked(tmp_path):
    """Trials stopped by a deadline: the best lr over the finished ones, marked (k/n)."""
    sweep = _sweep()
    trials = sw.make_trials(sweep, str(tmp_path))
    stop = threading.Event()
    runner = FakeRunner()

    def stop_after_three(trial, device):
        ok = runner(trial, device)
        if len(runner.calls) == 3:
            stop.set()
        return ok
    status = sw.run_trials(sw.run_order(trials, "lr"), stop_after_three, parallel=1, stop=stop)
    assert list(status.values()).count("done") == 3 and list(status.values()).count("not_run") == 5
    rows = sw.summarize(sweep, trials)
    assert sorted(r["finished"] for r in rows) == [0, 1, 1, 1] and all(r["trials"] == 2 for r in rows)
    sw.write_summary(sweep, rows, str(tmp_path), sw.trial_records(trials, status))
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[0].startswith("Partial: 3 of 8 trials finished")
    assert sum(line.endswith("(1/2) |") for line in md) == 3 and sum(line.endswith("| - (0/2) |") for line in md) == 1
    assert "Not finished (5; logs in status.json):" in md
    assert (tmp_path / "summary.png").stat().st_size > 1000


def test_score_of_the_only_setting(tmp_path):
    sweep = _sweep()
    sweep.score_setting = ""
    t = sw.make_trials(sweep, str(tmp_path))[0]
    os.makedirs(os.path.join(t.workdir, "eval"))
    path = os.path.join(t.workdir, "eval", "results.json")
    json.dump({"mqar": {"L16_K2": 0.25}}, open(path, "w"))
    assert t.score() == 0.25
    json.dump({"mqar": {"L16_K2": 0.25, "L32_K4": 0.5}}, open(path, "w"))
    with pytest.raises(ValueError, match="several settings"):
        t.score()


def test_mqar_gpu_variant_trials():
    """The gpu grid's trials: half Zoology's batch, 4000 steps, no in-training eval, one final
    checkpoint; gpu_small is its d_model 64 half (the same trial names, so a gpu_small workdir
    continues as a gpu one); keys given in the arg win over the variant's values."""
    from configs.sweeps import mqar

    sweep = mqar.get_config("gpu")
    trials = sw.make_trials(sweep, "/nonexistent")
    by_len = {}
    for t in trials:
        config = mqar.get_config(t.config.split(":", 1)[1])
        by_len[config.data.task_kwargs.seq_len] = config.data.batch_size
        assert config.total_steps == 4000 and config.eval_every_steps == 0
        assert config.checkpoint_every_steps == 4000 and config.keep_checkpoints == 1
        assert config.evals.decode_lengths == () and config.evals.num_examples == 1000
    assert by_len == {64: 256, 256: 128}
    small = sw.make_trials(mqar.get_config("gpu_small"), "/nonexistent")
    assert {t.name for t in small} == {t.name for t in trials if t.point["d_model"] == 64}
    assert {t.config for t in small} == {t.config for t in trials if t.point["d_model"] == 64}
    # The two lrs of a grid point run 12 trials apart (all first lrs, then all second ones).
    order = sw.run_order(small, "lr")
    assert [t.point["lr"] for t in order] == [1e-3] * 12 + [3e-3] * 12
    assert [t.config for t in order[:12]] == [t.config for t in order[12:]]
    short = mqar.get_config("gpu,steps=4")
    t = sw.make_trials(short, "/nonexistent")[0]
    assert mqar.get_config(t.config.split(":", 1)[1]).total_steps == 4
    assert mqar.get_config("cpu,steps=8,trial").total_steps == 8


def test_mqar_mixer_subset_keeps_the_grid_names_and_rejects_unknown_mixers():
    from configs.sweeps import mqar

    full = {t.name for t in sw.make_trials(mqar.get_config("gpu_small"), "/w")}
    sub = sw.make_trials(mqar.get_config("gpu_small,mixers=kda+softmax"), "/w")
    assert {t.point["mixer"] for t in sub} == {"kda", "softmax"} and len(sub) == 2 * 2 * 2
    assert {t.name for t in sub} <= full
    with pytest.raises(ValueError, match="Unknown mixers"):
        mqar.get_config("gpu_small,mixers=kda+mamba")


def test_host_warning_when_trials_get_under_two_cores_each():
    assert sw.host_warning(16, 32) == "" and sw.host_warning(1, 1) == ""
    warning = sw.host_warning(24, 32)
    assert "24 trials at once on 32 host cores" in warning and "--trials_per_device" in warning

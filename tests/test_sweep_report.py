"""benchmarks/mqar_sweep_report.py on the mqar:gpu grid with scripted trial results: the JSON
record (grid, schedule, statuses, environment) and the markdown table beside Zoology's figures."""

import json
import os

import sweep as sw
from benchmarks import mqar_sweep_report as report
from configs.sweeps import mqar


def _score(point):
    return round(0.9 - 0.001 * point["seq_len"] + (0.05 if point["lr"] == 3e-3 else 0.0) - 0.01 * len(point["mixer"]), 4)


def test_report_of_the_gpu_grid(tmp_path):
    sweep = mqar.get_config("gpu")
    root = str(tmp_path / "sweep")
    trials = sw.make_trials(sweep, root)
    failing = trials[5].name

    def runner(trial, device):
        if trial.name == failing:
            os.makedirs(trial.workdir, exist_ok=True)
            json.dump({"reason": "train.py exited 1", "stopped": False, "tail": "RESOURCE_EXHAUSTED\n"},
                      open(trial.failed_file, "w"))
            return False
        os.makedirs(os.path.join(trial.workdir, "eval"), exist_ok=True)
        p = trial.point
        json.dump({"mqar": {f"L{p['seq_len']}_K{p['num_kv_pairs']}": _score(p)}},
                  open(os.path.join(trial.workdir, "eval", "results.json"), "w"))
        json.dump({"train.py": 30.0, "eval.py": 10.0}, open(os.path.join(trial.workdir, "times.json"), "w"))
        with open(os.path.join(trial.workdir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 1000, "loss": 0.5, "accuracy": 0.9, "step_time_ms": 4.0}) + "\n")
        return True

    status = sw.run_trials(trials, runner, parallel=4, log=lambda *a, **k: None)
    rows = sw.summarize(sweep, trials)
    sw.write_summary(sweep, rows, root, sw.trial_records(trials, status))
    out = tmp_path / "results"
    record = report.main(["--sweep_dir", root, "--config", "configs/sweeps/mqar.py:gpu",
                          "--out_dir", str(out), "--name", "mqar_sweep_test"])
    saved = json.load(open(out / "mqar_sweep_test.json"))
    assert saved["trials_total"] == 48 and saved["trials_finished"] == 47
    assert saved["sweep"]["steps"] == 4000 and saved["sweep"]["batch_size"] == {"L64_K4": 256, "L256_K16": 128}
    assert saved["sweep"]["axes"]["lr"] == [1e-3, 3e-3] and len(saved["sweep"]["axes"]["mixer"]) == 6
    assert saved["env"]["device"] == record["env"]["device"] and saved["env"]["versions"]["jax"]
    assert saved["trials"][failing]["status"] == "failed" and "tail" not in saved["trials"][failing]
    assert saved["trial_costs"]["train.py"] == {"median_s": 30.0, "max_s": 30.0}
    assert saved["trials"][trials[0].name]["last_train"]["step_time_ms"] == 4.0
    md = (out / "mqar_sweep_test.md").read_text().splitlines()
    assert md[0] == "| model | source | L=64 K=4 d=64 | L=64 K=4 d=128 | L=256 K=16 d=64 | L=256 K=16 d=128 |"
    kda = next(line for line in md if line.startswith("| KDA |")).split(" | ")
    want = _score({"seq_len": 256, "lr": 3e-3, "mixer": "kda"})
    assert kda[-1] == f"{want:.2f} |" and kda[2] == f"{_score({'seq_len': 64, 'lr': 3e-3, 'mixer': 'kda'}):.2f}"
    assert sum(line.startswith("| ") and "ours (" in line for line in md) == 6
    h3 = next(line for line in md if line.startswith("| H3 |"))
    assert h3.endswith("| ≈0.91 | ≈0.97 | ≈0.06 | ≈0.63 |")
    assert (out / "mqar_sweep_test.png").stat().st_size > 1000


def test_report_splits_rows_by_the_extra_axes(tmp_path):
    """softmax_forms' form and steps axes get a table row each (not collapsed into one mixer row)."""
    sweep = mqar.get_config("softmax_forms")
    root = str(tmp_path / "sweep")
    trials = sw.make_trials(sweep, root)
    score = lambda p: round(0.1 * p["rope"] + 0.2 * p["mlp"] + p["steps"] / 1e5 + p["lr"], 4)

    def runner(trial, device):
        os.makedirs(os.path.join(trial.workdir, "eval"), exist_ok=True)
        json.dump({"mqar": {"L256_K16": score(trial.point)}}, open(os.path.join(trial.workdir, "eval", "results.json"), "w"))
        return True

    sw.run_trials(trials, runner, parallel=2, log=lambda *a, **k: None)
    rows = sw.summarize(sweep, trials)
    sw.write_summary(sweep, rows, root)
    report.main(["--sweep_dir", root, "--config", "configs/sweeps/mqar.py:softmax_forms",
                 "--out_dir", str(tmp_path / "out"), "--name", "forms"])
    md = (tmp_path / "out" / "forms.md").read_text().splitlines()
    ours = [line for line in md if "ours (" in line]
    assert len(ours) == 8 and all(", steps " not in line.split(" | ")[1] for line in ours)
    row = next(line for line in ours if "form ropeFalse_mlpTrue, steps 12000" in line)
    assert row.split(" | ")[-1] == f"{score(dict(rope=False, mlp=True, steps=12000, lr=3e-3)):.2f} |"
    assert "[4000, 12000] steps" in "\n".join(md)

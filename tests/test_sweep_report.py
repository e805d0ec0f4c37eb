"""benchmarks/mqar_sweep_report.py on the mqar:gpu grid with scripted trial results: the JSON
record (grid, schedule, statuses, environment) and the markdown table beside Zoology's figures."""

import json
import os

import pytest

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
        times = {"train.py": 30.0, "eval.py": 10.0}
        if trial.name == trials[0].name:  # resumed: 500 s in a first attempt, 30 s more in the second
            times["earlier"] = [{"train.py": 500.0}]
        json.dump(times, open(os.path.join(trial.workdir, "times.json"), "w"))
        with open(os.path.join(trial.workdir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 1000, "loss": 0.5, "accuracy": 0.9, "step_time_ms": 4.0}) + "\n")
        with open(os.path.join(trial.workdir, "train.log"), "w") as f:  # as train.py logs it on the GPU machine
            f.write("I1202 xla_bridge.py] Unable to initialize backend 'tpu'\n"
                    "mesh {'data': 1, 'fsdp': 1, 'tensor': 1, 'expert': 1} over 1 NVIDIA H200 device(s), 1 process(es)\n")
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
    # The trials' device (from their logs), not this machine's, names the rows; this machine is kept aside.
    assert saved["env"]["device"] == "NVIDIA H200" and saved["env"]["platform"] == "gpu"
    assert saved["env"]["report_machine"]["platform"] == "cpu"
    assert saved["trials"][failing]["status"] == "failed" and "tail" not in saved["trials"][failing]
    assert saved["trial_costs"]["train.py"] == {"median_s": 30.0, "max_s": 530.0}  # over both attempts
    assert saved["trials"][trials[0].name]["total_times"] == {"train.py": 530.0, "eval.py": 10.0}
    assert saved["trials"][trials[0].name]["last_train"]["step_time_ms"] == 4.0
    md = (out / "mqar_sweep_test.md").read_text().splitlines()
    assert md[0] == "| model | source | L=64 K=4 d=64 | L=64 K=4 d=128 | L=256 K=16 d=64 | L=256 K=16 d=128 |"
    kda = next(line for line in md if line.startswith("| KDA |")).split(" | ")
    want = _score({"seq_len": 256, "lr": 3e-3, "mixer": "kda"})
    assert kda[-1] == f"{want:.2f} |" and kda[2] == f"{_score({'seq_len': 64, 'lr': 3e-3, 'mixer': 'kda'}):.2f}"
    assert sum(line.startswith("| ") and "ours (NVIDIA H200, 4000 steps)" in line for line in md) == 6
    h3 = next(line for line in md if line.startswith("| H3 |"))
    assert h3.endswith("| ≈0.91 | ≈0.97 | ≈0.06 | ≈0.63 |")
    assert (out / "mqar_sweep_test.png").stat().st_size > 1000


def test_trial_devices_must_agree(tmp_path):
    for name, kind in (("a", "NVIDIA H200"), ("b", "NVIDIA H100"), ("c", None)):
        os.makedirs(tmp_path / "trials" / name)
        if kind:
            (tmp_path / "trials" / name / "train.log").write_text(
                f"mesh {{'data': 2}} over 2 {kind} device(s), 1 process(es)\nstep 1\n")
    assert report.trial_devices(str(tmp_path), ["a", "c"]) == ("NVIDIA H200", 2)
    assert report.trial_devices(str(tmp_path), ["c"]) is None
    with pytest.raises(ValueError, match="different devices"):
        report.trial_devices(str(tmp_path), ["a", "b"])


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


def _record(date, rows, steps=12000, batch=None, device="NVIDIA H200"):
    return {"env": {"date": date, "device": device}, "published": {"source": "x"},
            "sweep": {"config": "configs/sweeps/mqar.py:gpu_long", "axes": {"d_model": sorted({r[1] for r in rows}),
                      "lr": [3e-3], "mixer": sorted({r[0] for r in rows}), "setting": []},
                      "steps": steps, "batch_size": batch or {"L64_K4": 256}, "eval_examples": 1000, "select_over": "lr"},
            "rows": [{"mixer": m, "d_model": d, "seq_len": L, "num_kv_pairs": K, "setting": f"seq_len{L}_num_kv_pairs{K}",
                      "score": s, "lr": 3e-3, "trials": 1, "finished": int(s is not None)} for m, d, L, K, s in rows],
            "trials_total": len(rows), "trials_finished": sum(r[4] is not None for r in rows)}


def test_merge_keeps_the_latest_scored_cell(tmp_path):
    old = _record("2026-11-30T10:00:00+00:00", [("kda", 64, 64, 4, 0.50), ("softmax", 64, 64, 4, 0.90)])
    new = _record("2026-11-30T12:00:00+00:00", [("kda", 64, 64, 4, 0.75), ("softmax", 64, 64, 4, None),
                                                ("kda", 128, 128, 8, 0.25)], batch={"L64_K4": 256, "L128_K8": 256})
    paths = []
    for name, rec in (("new.json", new), ("old.json", old)):  # given out of date order
        (tmp_path / name).write_text(json.dumps(rec))
        paths.append(str(tmp_path / name))
    record = report.main(["--merge", *paths, "--out_dir", str(tmp_path / "out"), "--name", "m"])
    cells = {(r["mixer"], r["d_model"], r["seq_len"]): (r["score"], r["source"]) for r in record["rows"]}
    # the later run's score wins; its unfinished cell keeps the earlier run's score
    assert cells == {("kda", 64, 64): (0.75, "new.json"), ("softmax", 64, 64): (0.90, "old.json"),
                     ("kda", 128, 128): (0.25, "new.json")}
    assert record["sweep"]["batch_size"] == {"L64_K4": 256, "L128_K8": 256} and record["trials_total"] == 5
    md = (tmp_path / "out" / "m.md").read_text().splitlines()
    assert md[0] == "| model | source | L=64 K=4 d=64 | L=64 K=4 d=128 | L=128 K=8 d=64 | L=128 K=8 d=128 |"
    assert next(line for line in md if line.startswith("| KDA |")).endswith("| 0.75 | - | - | 0.25 |")
    assert "Merged from 2 runs: new.json, old.json." in "\n".join(md)
    assert (tmp_path / "out" / "m.png").stat().st_size > 1000


def test_merge_refuses_records_of_different_budgets(tmp_path):
    a = _record("2026-11-30T10:00:00+00:00", [("kda", 64, 64, 4, 0.5)])
    for name, other in (("steps", _record("2026-11-30T11:00:00+00:00", [("kda", 64, 64, 4, 0.5)], steps=4000)),
                        ("batch", _record("2026-11-30T11:00:00+00:00", [("kda", 64, 64, 4, 0.5)], batch={"L64_K4": 64}))):
        (tmp_path / "a.json").write_text(json.dumps(a))
        (tmp_path / "b.json").write_text(json.dumps(other))
        with pytest.raises(ValueError, match="cannot merge b.json"):
            report.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def test_published_lines_and_plot_references(tmp_path):
    """Zoology's Fig. 2 as plot references for the settings present (attention's "0.97-1.0" at
    0.985), drawn beside ours: the legend has our mixers and the five published models."""
    rows = _record("2026-11-30T10:00:00+00:00", [("kda", 64, 64, 4, 0.5), ("kda", 128, 64, 4, 0.7),
                                                 ("softmax", 64, 512, 64, 0.1)])["rows"]
    lines = dict(report.published_lines(rows))
    assert list(lines) == [f"{m} (Zoology Fig. 2)" for m in ("attention", "BaseConv", "H3", "RWKV", "Hyena")]
    assert lines["attention (Zoology Fig. 2)"]["seq_len64_num_kv_pairs4"] == {64: 0.985, 128: 0.985, 256: 0.985}
    assert lines["H3 (Zoology Fig. 2)"] == {"seq_len64_num_kv_pairs4": {64: 0.91, 128: 0.97, 256: 0.97},
                                           "seq_len512_num_kv_pairs64": {64: 0.02, 128: 0.03, 256: 0.03}}
    record = _record("2026-11-30T10:00:00+00:00", [("kda", 64, 64, 4, 0.5), ("kda", 128, 64, 4, 0.7)])
    labels = report._plot(record, str(tmp_path / "p.png"))
    assert labels == ["kda"] + list(lines)
    assert (tmp_path / "p.png").stat().st_size > 1000


def _lr_record(date, rows):
    rec = _record(date, [r[:5] for r in rows])
    for row, r in zip(rec["rows"], rows):
        row["lr"] = r[5]
    rec["sweep"]["axes"]["lr"] = sorted({r[5] for r in rows})
    return rec


def test_merge_keeps_the_best_lr_over_runs(tmp_path):
    """Pieces at other learning rates: a higher score at another lr wins, a lower one does not;
    a re-run at the cell's own lr replaces it even when lower; the lr axis is the union."""
    a = _lr_record("2026-11-30T10:00:00+00:00", [("kda", 64, 64, 4, 0.50, 3e-3), ("softmax", 64, 64, 4, 0.90, 3e-3),
                                                 ("deltanet", 64, 64, 4, 0.70, 3e-3)])
    b = _lr_record("2026-11-30T11:00:00+00:00", [("kda", 64, 64, 4, 0.80, 1e-2), ("softmax", 64, 64, 4, 0.20, 1e-2),
                                                 ("deltanet", 64, 64, 4, 0.60, 3e-3)])
    paths = []
    for name, rec in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(rec))
        paths.append(str(tmp_path / name))
    record = report.main(["--merge", *paths, "--out_dir", str(tmp_path / "out"), "--name", "lrs"])
    cells = {r["mixer"]: (r["score"], r["lr"], r["source"]) for r in record["rows"]}
    assert cells == {"kda": (0.80, 1e-2, "b.json"), "softmax": (0.90, 3e-3, "a.json"),
                     "deltanet": (0.60, 3e-3, "b.json")}
    assert record["sweep"]["axes"]["lr"] == [3e-3, 1e-2]
    # Which lrs each cell ran at: the table's note names the cells beyond the common set.
    assert {r["mixer"]: r["lr_tried"] for r in record["rows"]} == {
        "kda": [3e-3, 1e-2], "softmax": [3e-3, 1e-2], "deltanet": [3e-3]}
    note = next(line for line in (tmp_path / "out" / "lrs.md").read_text().splitlines() if line.startswith("Ours:"))
    assert note.startswith("Ours: best of lr [0.003, 0.01] per cell, except DeltaNet L=64 K=4 d=64: best of [0.003] (0.003),")


def test_lrs_replaces_the_lr_axis():
    sweep = mqar.get_config("gpu_long,settings=512x64,lrs=1e-2+1e-4+4.6e-4")
    assert sweep.axes.lr == [1e-4, 4.6e-4, 1e-2]
    with pytest.raises(ValueError, match="joined by"):
        mqar.get_config("gpu_long,lrs=fast")
    with pytest.raises(ValueError, match="positive"):
        mqar.get_config("gpu_long,lrs=0+1e-3")


def test_records_name_the_config_relative_to_the_checkout():
    """A report run from another copy of the tree records `configs/...`, never that copy's path."""
    spec = "configs/sweeps/mqar.py:gpu_long,widths=64,settings=512x64"
    assert report.portable_spec(spec) == spec
    assert report.portable_spec(os.path.join(report.ROOT, spec)) == spec
    assert report.portable_spec("/x/configs/y/configs/sweeps/mqar.py:gpu") == "configs/sweeps/mqar.py:gpu"
    assert report.sweep_description(os.path.join(report.ROOT, spec))["config"] == spec
    with pytest.raises(ValueError, match="relative to the repository root"):
        report.portable_spec("/elsewhere/mqar.py:gpu")

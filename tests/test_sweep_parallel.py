"""sweep.py: several trials sharing a device, failed trials recorded with their log tail, the
deadline that stops running trials and starts no more, and the status written beside the summary.
Trials run short Python scripts in place of train.py / eval.py."""

import json
import os
import sys
import threading
import time

import pytest

import sweep as sw
from tests.test_sweep import _sweep

SCRIPT = """import json, os, sys, time
mode = sys.argv[1]
if mode == "fail":
    print("loading"); print("boom: out of memory", flush=True); sys.exit(3)
if mode == "hang":
    time.sleep(60)
if sys.argv[2] == "eval":
    os.makedirs(os.path.join(sys.argv[3], "eval"), exist_ok=True)
    json.dump({"mqar": {sys.argv[4]: 0.5}}, open(os.path.join(sys.argv[3], "eval", "results.json"), "w"))
print(os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
"""


def _script_trials(tmp_path, modes: dict):
    """The sweep's trials, each running SCRIPT in `modes[name]` ("ok" unless listed)."""
    script = tmp_path / "trial.py"
    script.write_text(SCRIPT)
    trials = sw.make_trials(_sweep(), str(tmp_path / "sweep"))
    for t in trials:
        mode, setting = modes.get(t.name, "ok"), t.score_key[1]
        t.commands = lambda python=sys.executable, m=mode, t=t, s=setting: [
            [python, str(script), m, "train", t.workdir, s], [python, str(script), "ok", "eval", t.workdir, s]]
    return trials


def test_device_slots_and_shared_env():
    assert sw.device_slots(["0", "1"], 3) == ["0", "1"] * 3
    assert sw.device_slots(["0"], 0) == ["0"]
    env = sw.SubprocessRunner(share=4).env("1")
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == 0.225
    assert sw.SubprocessRunner(share=2, mem_fraction=0.3).env(None)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3000"
    alone = sw.SubprocessRunner().env("0")
    assert alone.get("XLA_PYTHON_CLIENT_PREALLOCATE") == os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")


def test_trials_share_each_device(tmp_path):
    """Two slots per device: at most two trials hold a device at once, and two do at some point."""
    trials = sw.make_trials(_sweep(), str(tmp_path))
    lock, held, peak = threading.Lock(), {}, {}

    def runner(trial, device):
        with lock:
            held[device] = held.get(device, 0) + 1
            peak[device] = max(peak.get(device, 0), held[device])
        time.sleep(0.1)
        with lock:
            held[device] -= 1
        return True

    lines = []
    status = sw.run_trials(trials, runner, parallel=4, devices=sw.device_slots(["0", "1"], 2),
                           log=lambda msg, **kw: lines.append(msg))
    assert list(status.values()).count("done") == 8 and peak == {"0": 2, "1": 2}
    assert len(lines) == 8 and lines[-1].startswith("[sweep] 8/8 (done 8)")


def test_failed_trial_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep = _sweep()
    probe = sw.make_trials(sweep, str(tmp_path / "sweep"))
    failing = probe[2].name
    trials = _script_trials(tmp_path, {failing: "fail"})
    runner = sw.SubprocessRunner(share=2)
    status = sw.run_trials(trials, runner, parallel=4, devices=sw.device_slots(["0", "1"], 2),
                           log=lambda *a, **k: None)
    assert status[failing] == "failed" and list(status.values()).count("done") == 7
    records = sw.trial_records(trials, status)
    bad = records[failing]
    assert bad["reason"].endswith("exited 3") and "boom: out of memory" in bad["tail"] and bad["score"] is None
    assert set(bad["times"]) == {"trial.py"}
    good = next(r for n, r in records.items() if n != failing)
    assert good["status"] == "done" and good["score"] == 0.5 and good["device"] in ("0", "1")
    log = open(os.path.join(trials[0].workdir, "train.log")).read().split()
    assert log[0] in ("0", "1") and float(log[1]) == 0.45
    root = str(tmp_path / "sweep")
    sw.write_summary(sweep, sw.summarize(sweep, trials), root, records)
    assert json.load(open(os.path.join(root, "status.json")))[failing]["status"] == "failed"
    md = open(os.path.join(root, "summary.md")).read()
    assert f"- {failing}: failed" in md and "boom: out of memory" in md
    # The failure is cleared when a rerun succeeds.
    trials = _script_trials(tmp_path, {})
    status = sw.run_trials(trials, sw.SubprocessRunner(), parallel=2, log=lambda *a, **k: None)
    assert status[failing] == "done" and not os.path.exists(trials[2].failed_file)
    # The rerun keeps the failed attempt's log and time beside its own.
    workdir = trials[2].workdir
    assert "boom: out of memory" in open(os.path.join(workdir, "train.log.1")).read()
    assert "boom" not in open(os.path.join(workdir, "train.log")).read()
    times = json.load(open(os.path.join(workdir, "times.json")))
    assert len(times["earlier"]) == 1 and set(times["earlier"][0]) == set(times) - {"earlier"} == {"trial.py"}
    rec = sw.trial_records(trials, status)[failing]
    assert rec["total_times"]["trial.py"] == pytest.approx(times["trial.py"] + times["earlier"][0]["trial.py"], abs=0.11)
    assert "total_times" not in sw.trial_records(trials, status)[trials[0].name]
    assert "earlier" not in json.load(open(os.path.join(trials[0].workdir, "times.json")))


def test_stop_ends_running_trials_and_starts_no_more(tmp_path):
    trials = _script_trials(tmp_path, {t.name: "hang" for t in sw.make_trials(_sweep(), str(tmp_path / "sweep"))})
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    start = time.time()
    status = sw.run_trials(trials, sw.SubprocessRunner(stop=stop, grace_s=2.0), parallel=2, stop=stop,
                           log=lambda *a, **k: None)
    assert time.time() - start < 20
    assert list(status.values()).count("stopped") == 2 and list(status.values()).count("not_run") == 6
    records = sw.trial_records(trials, status)
    stopped = [r for r in records.values() if r["status"] == "stopped"]
    assert all(r["reason"] == "trial.py stopped" for r in stopped)
    assert all(r["score"] is None and "times" not in r for r in records.values() if r["status"] == "not_run")


def test_slot_pool_spreads_trials_by_cost():
    """Heavy and light trials alternating in step with two devices: assigned round-robin, every
    heavy one would land on device 1 (the aliasing of a grid whose last axis has two values);
    by cost (greedy, in arrival order) the devices' loads differ by at most one trial's cost."""
    pool = sw.SlotPool(sw.device_slots(["0", "1"], 6))
    costs = [1.0, 2.0] * 6
    taken = [pool.take(c) for c in costs]
    load = {d: sum(c for c, t in zip(costs, taken) if t == d) for d in ("0", "1")}
    assert taken.count("0") == taken.count("1") == 6 and sum(load.values()) == 18.0
    assert abs(load["0"] - load["1"]) <= max(costs)  # round-robin: 6.0 against 12.0
    pool.give(taken[1], costs[1])  # a heavy trial on its device finishes: the next goes there
    assert pool.take(1.0) == taken[1]


def test_run_trials_passes_each_point_to_cost(tmp_path):
    trials = sw.make_trials(_sweep(), str(tmp_path))
    seen = []
    status = sw.run_trials(trials, lambda trial, device: True, parallel=2, devices=["0", "1"],
                           log=lambda msg, **kw: None, cost=lambda point: seen.append(point) or 1.0)
    assert list(status.values()).count("done") == len(trials)
    assert sorted(map(str, seen)) == sorted(str(t.point) for t in trials)


def test_mqar_sweep_cost_is_tokens_times_layers():
    from configs.sweeps import mqar

    s = mqar.get_config("gpu_long,widths=64,settings=64x4+128x8")
    cost = {(p["mixer"], p["seq_len"]): s.cost(p) for p in sw.expand(s.axes)}
    assert cost[("kda", 128)] == 2 * cost[("kda", 64)] == 128 * 256 * 12000 * 2  # batch 256 at L <= 128
    assert cost[("hybrid", 64)] == 2 * cost[("kda", 64)]  # 4 layers against 2


def test_wave_devices_places_the_heaviest_first():
    """The d_model 128 MQAR piece of one H200 run: 12 trials start at once on 2 x 6 slots with the
    3:1 hybrids (heaviest) late in start order. Greedy in start order put both hybrids on one GPU
    in that run (costs 262144 against 425984; three of its trials missed the deadline), and in
    this order leaves three light trials' cost between the devices; placed longest first, one."""
    costs = [32768.0] * 5 + [65536.0] + [65536.0] * 5 + [131072.0]  # (64,4) x 5, hybrid, (256,16) x 5, hybrid
    slots = sw.device_slots(["0", "1"], 6)
    placed = sw.wave_devices(slots, costs)
    load = {d: sum(c for c, p in zip(costs, placed) if p == d) for d in ("0", "1")}
    assert placed.count("0") == placed.count("1") == 6
    # Half the total (344064) is 10.5 light trials: one light trial's cost apart is the best split.
    assert sorted(load.values()) == [327680.0, 360448.0]
    assert placed[5] != placed[11]  # the two hybrids apart
    pool = sw.SlotPool(slots)
    greedy = [pool.take(c) for c in costs]
    greedy_load = {d: sum(c for c, p in zip(costs, greedy) if p == d) for d in ("0", "1")}
    assert abs(greedy_load["0"] - greedy_load["1"]) == 3 * 32768  # greedy in start order, this order


def test_run_trials_starts_the_first_wave_on_planned_devices(tmp_path):
    trials = sw.make_trials(_sweep(), str(tmp_path))
    heavy = trials[-1].name  # last in start order
    cost = lambda point: 10.0 if point == trials[-1].point else 1.0
    seen = {}
    barrier = threading.Barrier(len(trials))

    def runner(trial, device):
        seen[trial.name] = device
        barrier.wait(timeout=10)  # every trial holds its slot until all have started: one wave
        return True

    slots = sw.device_slots(["0", "1"], -(-len(trials) // 2))
    status = sw.run_trials(trials, runner, parallel=len(trials), devices=slots, log=lambda *a, **k: None, cost=cost)
    assert list(status.values()).count("done") == len(trials)
    costs = [cost(t.point) for t in trials]
    assert [seen[t.name] for t in trials] == sw.wave_devices(slots, costs)
    assert seen[heavy] == "0"  # the heaviest is placed first, on the first device

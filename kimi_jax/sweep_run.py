"""Running a sweep's trials on this machine: each trial's commands as subprocesses with their
logs and wall times (`SubprocessRunner`), device slots handed out by cost (`SlotPool`), and the
pool of trials running at once with progress lines and a stop event (`run_trials`).
`sweep.py` holds the grid, the trials and the summary."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

LOG_TAIL_LINES = 30


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log (what a failed trial reports)."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def device_slots(devices, per_device: int = 1) -> list[str]:
    """Each device id `per_device` times, interleaved (0,1,0,1,...) so that a partly filled
    sweep spreads over the devices."""
    return [d for _ in range(max(per_device, 1)) for d in devices]


class SubprocessRunner:
    """Runs a trial's commands, logging to <workdir>/{train,eval}.log, their wall times to
    <workdir>/times.json; returns success. A failure leaves <workdir>/FAILED: the reason and the
    log's tail. A trial run again (resumed after a stop, retried after a failure) keeps what the
    earlier attempts left: their logs as {train,eval}.log.1, .2, ... and their times in
    times.json's "earlier" list, oldest first (`total_times` sums them). Setting `stop` ends the
    running command (SIGTERM to its process group, SIGKILL after `grace_s`): train.py then saves
    a checkpoint, so a restarted sweep resumes the trial.
    `share` > 1 trials per device run without preallocation, each with `mem_fraction` (default
    0.9 / share) of the device memory. `extra_env` (e.g. `compile_cache_env`) is set for every
    command."""

    def __init__(self, launcher: str = "", device_env: str = "CUDA_VISIBLE_DEVICES", *, share: int = 1,
                 mem_fraction: float = 0.0, stop: threading.Event | None = None, grace_s: float = 10.0,
                 extra_env: dict | None = None):
        self.launcher, self.device_env, self.extra_env = launcher, device_env, dict(extra_env or {})
        self.share, self.mem_fraction, self.grace_s = share, mem_fraction, grace_s
        self.stop = stop or threading.Event()

    def wrap(self, cmd: list[str]) -> list[str]:
        if not self.launcher:
            return cmd
        if "{cmd}" in self.launcher:
            return ["bash", "-c", self.launcher.format(cmd=shlex.join(cmd))]
        return [*shlex.split(self.launcher), *cmd]

    def env(self, device: str | None) -> dict:
        env = {**os.environ, **self.extra_env}
        if device is not None:
            env[self.device_env] = device
        if self.share > 1:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.mem_fraction or 0.9 / self.share:.4f}"
        return env

    def _run(self, cmd: list[str], log: str, env: dict) -> int | None:
        """The command's exit status, or None when `stop` ended it."""
        with open(log, "w") as f:
            proc = subprocess.Popen(self.wrap(cmd), stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            while True:
                try:
                    return proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    if self.stop.is_set():
                        break
            for sig, wait in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
            proc.wait()
            return None

    def __call__(self, trial, device: str | None) -> bool:
        os.makedirs(trial.workdir, exist_ok=True)
        if os.path.exists(trial.failed_file):
            os.remove(trial.failed_file)
        env, times_path = self.env(device), os.path.join(trial.workdir, "times.json")
        times = {"earlier": _recorded_attempts(times_path)}
        for name in ("train.log", "eval.log"):
            _keep_earlier_log(os.path.join(trial.workdir, name))
        for cmd, name in zip(trial.commands(), ("train.log", "eval.log")):
            log, start = os.path.join(trial.workdir, name), time.time()
            rc = self._run(cmd, log, env)
            program = os.path.basename(cmd[1])
            times[program] = round(time.time() - start, 1)
            with open(times_path, "w") as f:
                json.dump({k: v for k, v in times.items() if k != "earlier" or v}, f)
            if rc != 0:
                reason = f"{program} stopped" if rc is None else f"{program} exited {rc}"
                with open(trial.failed_file, "w") as f:
                    json.dump({"reason": reason, "stopped": rc is None, "log": log, "tail": log_tail(log)}, f)
                return False
        return True


def attempts(times: dict) -> list[dict]:
    """The attempts a times.json's content records ({program: seconds} each), oldest first."""
    last = {k: v for k, v in times.items() if k != "earlier"}
    return times.get("earlier", []) + ([last] if last else [])


def total_times(times: dict) -> dict:
    """{program: wall seconds summed over a times.json's attempts}."""
    total: dict = {}
    for attempt in attempts(times):
        for program, seconds in attempt.items():
            total[program] = round(total.get(program, 0.0) + seconds, 1)
    return total


def _recorded_attempts(times_path: str) -> list[dict]:
    if not os.path.exists(times_path):
        return []
    with open(times_path) as f:
        return attempts(json.load(f))


def _keep_earlier_log(log: str) -> None:
    """Move an earlier attempt's log to the first free `log`.N."""
    if not os.path.exists(log):
        return
    n = 1
    while os.path.exists(f"{log}.{n}"):
        n += 1
    os.replace(log, f"{log}.{n}")


class SlotPool:
    """Device slots (an id repeated for trials sharing it) handed to trials by cost: a trial takes
    a free slot of the device whose running trials cost least in sum, so that trials of unequal
    cost that start together (e.g. a grid whose heavy and light points alternate in step with
    the devices) spread evenly instead of piling the heavy ones on one device."""

    def __init__(self, slots):
        self._free = list(slots)
        self._load: dict = {}
        self._cond = threading.Condition()

    def take(self, cost: float, device=None):
        """A free slot (of `device`, if given: a slot planned by `wave_devices`), waiting for one."""
        with self._cond:
            while not self._free or (device is not None and device not in self._free):
                self._cond.wait()
            if device is not None:
                i = self._free.index(device)
            else:
                i = min(range(len(self._free)), key=lambda j: (self._load.get(self._free[j], 0.0), j))
            device = self._free.pop(i)
            self._load[device] = self._load.get(device, 0.0) + cost
            return device

    def give(self, device, cost: float) -> None:
        with self._cond:
            self._load[device] -= cost
            self._free.append(device)
            self._cond.notify()


def wave_devices(slots, costs: list[float]) -> list:
    """Devices for trials that start together (`costs` in start order), placed longest first, each
    on the device with the least cost so far among those with a free slot (LPT). Taking them in
    start order instead leaves the last trials of the wave no choice: a grid whose heaviest points
    come last (the 3:1 hybrid, the longest setting) piled them on one device."""
    free, load, out = {}, {}, [None] * len(costs)
    for d in slots:
        free[d] = free.get(d, 0) + 1
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        d = min((d for d in free if free[d] > 0), key=lambda d: load.get(d, 0.0))
        free[d] -= 1
        load[d] = load.get(d, 0.0) + costs[i]
        out[i] = d
    return out


def run_trials(trials: list, runner, *, parallel: int = 1, devices=(), stop=None,
               log=print, cost=None) -> dict:
    """Run the trials not yet done, `parallel` at a time, each holding one slot of `devices` (an
    id repeated for trials sharing it; `SlotPool` picks it by `cost(point)`, default 1 per trial)
    while it runs, with a progress line per finished trial. Once `stop` is set no trial starts.
    Returns {name: "done" | "skipped" | "failed" | "stopped" | "not_run"} ("stopped": ended by
    `stop` while running)."""
    stop = stop or threading.Event()
    status = {t.name: "skipped" for t in trials if t.done()}
    todo = [t for t in trials if not t.done()]
    if devices and parallel > len(devices):
        raise ValueError(f"--parallel {parallel} exceeds the {len(devices)} device slots given")
    slot_ids = list(devices or [None] * parallel)
    slots = SlotPool(slot_ids)
    lock, start, finished = threading.Lock(), time.time(), []
    weights = {t.name: float(cost(t.point)) if cost is not None else 1.0 for t in todo}
    wave = todo[:max(parallel, 1)]  # the trials that start at once take the slots `wave_devices` plans
    planned = dict(zip((t.name for t in wave), wave_devices(slot_ids, [weights[t.name] for t in wave])))

    def one(trial) -> tuple[str, str]:
        weight = weights[trial.name]
        device = slots.take(weight, planned.get(trial.name))
        try:
            if stop.is_set():
                return trial.name, "not_run"
            begin = time.time()
            ok = runner(trial, device)
            if ok:
                os.makedirs(trial.workdir, exist_ok=True)
                with open(trial.done_file, "w") as f:
                    json.dump({"point": trial.point, "seconds": time.time() - begin, "device": device}, f)
            state = "done" if ok else "stopped" if trial.failure().get("stopped") else "failed"
            with lock:
                finished.append(state)
                counts = ", ".join(f"{s} {finished.count(s)}" for s in ("done", "failed", "stopped") if s in finished)
                extra = f"score={trial.score()}" if ok else trial.failure().get("reason", "")
                log(f"[sweep] {len(finished)}/{len(todo)} ({counts}) at {time.time() - start:.0f}s: "
                    f"{trial.name} {state} in {time.time() - begin:.0f}s on {device}: {extra}", flush=True)
            return trial.name, state
        finally:
            slots.give(device, weight)

    with ThreadPoolExecutor(max_workers=max(parallel, 1)) as pool:
        for name, state in pool.map(one, todo):
            status[name] = state
    return status

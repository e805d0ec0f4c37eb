"""eval.py end to end on a checkpoint written by train.py: the results.json contract, the
metrics, results.md and plots, and the comparison of two workdirs."""

import json
import os
import shutil
import subprocess
import sys

from tests.cpu_env import one_cpu_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ("configs/sweeps/mqar.py:trial,tiny,mixer=softmax,d_model=16,num_layers=1,seq_len=16,"
          "num_kv_pairs=2")
ENV = one_cpu_process_env()


def _run(*args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_eval_on_a_trained_checkpoint(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _run("train.py", "--config", CONFIG, "--workdir", a)
    tasks = "train_task,induction_heads"
    _run("eval.py", "--config", CONFIG, "--workdir", a, "--tasks", tasks,
         "--config.evals.decode_lengths=(8,16)", "--config.evals.decode_steps=2")
    results = json.load(open(os.path.join(a, "eval", "results.json")))
    assert set(results) == {"mqar", "induction_heads"}
    assert list(results["mqar"]) == ["L16_K2"]
    assert set(results["induction_heads"]) == {"L256", "L512"}        # cpu preset: 256 and 512
    assert all(0.0 <= v <= 1.0 for per in results.values() for v in per.values())
    metrics = json.load(open(os.path.join(a, "eval", "metrics.json")))
    m = metrics["tasks"]["mqar"]["L16_K2"]
    assert m["loss"] > 0 and m["num_examples"] == 16 and m["seq_len"] == 16
    assert metrics["step"] == 4 and metrics["decode"]["context_len"] == [8, 16]
    assert metrics["memory"]["allocated_bytes"][1] > metrics["memory"]["allocated_bytes"][0]
    assert metrics["memory"]["bytes_per_token"] > 0                     # kimi_jax.summary
    md = open(os.path.join(a, "eval", "results.md")).read()
    assert "| mqar | L16_K2 |" in md and "ms / token" in md
    for png in ("accuracy_vs_length", "accuracy_vs_state", "loss_vs_length", "decode_time"):
        assert os.path.getsize(os.path.join(a, "eval", png + ".png")) > 1000

    # Two workdirs: a reuses its results, b (same checkpoint) is evaluated; one line per model.
    shutil.copytree(os.path.join(a, "checkpoints"), os.path.join(b, "checkpoints"))
    cmp_dir = str(tmp_path / "cmp")
    _run("eval.py", "--config", CONFIG, "--workdir", f"{a},{b}", "--tasks", tasks, "--reuse",
         "--outdir", cmp_dir, "--config.evals.decode_lengths=(8,16)", "--config.evals.decode_steps=2")
    assert json.load(open(os.path.join(b, "eval", "results.json"))) == results  # same weights
    md = open(os.path.join(cmp_dir, "results.md")).read()
    assert "| task | setting | a | b |" in md
    assert os.path.getsize(os.path.join(cmp_dir, "accuracy_vs_length.png")) > 1000

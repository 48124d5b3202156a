"""`entr-megatron study run | report` end to end: a 2-method x 2-lag x 1-seed study of 4 steps per
cell (fixed_lag, a shared SFT warm-up), killed mid-way with SIGKILL, rerun on a local Ray cluster
(`--launcher ray`: finished cells are skipped, the interrupted one resumes from its checkpoint in a
Ray task, no step trained twice), reported
(table, plots), and rerun once more when finished (seconds, nothing run)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from entr_megatron.utils.run_log import read_metrics

ARCH = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
        "tie_word_embeddings": True}
BASE = {
    "model": {"architecture": ARCH, "max_prompt_len": 16, "max_seq_len": 32},
    "algorithm": {"correction": "entr", "tau": 0.5},
    "learner": {"optim": {"lr": 2.0e-4}},
    "rollout": {"prompts_per_step": 4, "dtype": "bfloat16", "sampling": {"max_new_tokens": 6, "n": 4},
                "embedded": {"num_threads": 1, "max_batch_size": 32}},
    "controller": {"mode": "fixed_lag", "train_steps": 4, "checkpoint_interval": 1, "keep_last_checkpoints": 1},
    "task": {"name": "arithmetic", "eval_size": 16, "arithmetic": {"digits": 1, "operations": ["+"], "format_reward": 0.2}},
    "sft": {"steps": 30, "lr": 3.0e-3, "batch_size": 32},
    "launcher": {"cpu_threads_per_rank": 1},
    "logging": {"run_dir": "unused", "progress_bar": False, "log_interval": 1, "tensorboard": False},
}
SPEC = {"name": "tiny", "base": "base.yaml",
        "grid": {"algorithm.correction": ["none", "entr"], "controller.inter_lag": [0, 2]},
        "warmup": {},
        "report": {"method": "algorithm.correction", "lag": "controller.inter_lag",
                   "reference": {"controller.inter_lag": 0}}}


def study(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "study", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def status(cell_dir: Path) -> dict:
    try:
        return json.loads((cell_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_study_runs_resumes_after_kill_and_reports(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "out"
    cells = out / "cells"

    # 1. run until one cell is done and the next has a checkpoint, then kill the whole study
    proc = study("run", str(tmp_path / "spec.yaml"), "--out", str(out), "--jobs", "2")  # two cells at a time
    deadline, victim = time.time() + 600, None
    while time.time() < deadline and victim is None:
        assert proc.poll() is None, proc.communicate()
        dirs = sorted(cells.iterdir()) if cells.exists() else []
        done = [d for d in dirs if status(d).get("state") == "done"]
        for d in dirs:  # a cell with a checkpoint that has not logged its third of 4 steps (2 cells run at once)
            if done and status(d).get("state") == "running" and (d / "checkpoints" / "latest").exists() \
                    and (d / "metrics.jsonl").exists() and len(read_metrics(d / "metrics.jsonl")) < 3:
                victim = d
        time.sleep(0.05)
    assert victim is not None, "no cell reached its first checkpoint in time"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed_steps = [r["step"] for r in read_metrics(victim / "metrics.jsonl")]
    assert killed_steps and killed_steps[-1] < 3, killed_steps  # killed mid-way
    first_done = {d.name: status(d)["attempts"] for d in cells.iterdir() if status(d).get("state") == "done"}

    # 2. rerun, as Ray tasks on a local Ray cluster: finished cells skipped, the killed one resumed,
    # every cell done, no step twice
    launcher = ["--launcher", "ray"] if importlib.util.find_spec("ray") else []
    proc = study("run", str(tmp_path / "spec.yaml"), "--out", str(out), "--jobs", "2", *launcher)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["skipped"] == len(first_done) and summary["done"] == 4 - len(first_done) and not summary["failed"]
    for d in cells.iterdir():
        st = status(d)
        assert st["state"] == "done", (d.name, st)
        assert [r["step"] for r in read_metrics(d / "metrics.jsonl")] == [0, 1, 2, 3], d.name
        if d.name in first_done:
            assert st["attempts"] == first_done[d.name]
            assert st["ran_on"]["launcher"] == "local"
        elif launcher:  # run by a Ray worker process, not by the study's own
            assert st["ran_on"]["launcher"] == "ray" and st["ran_on"]["pid"] != proc.pid, st["ran_on"]
    assert status(victim)["attempts"] == 2
    assert "resum" in (victim / "train.log").read_text().lower()
    lag2 = next(d for d in cells.iterdir() if "inter_lag=2" in d.name)
    assert [r["policy_lag/max"] for r in read_metrics(lag2 / "metrics.jsonl")] == [0, 1, 2, 2]

    # 3. report: one row per cell x step with the axes as columns, plots linked from report.md
    proc = study("report", str(out))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    report = out / "report" / "report.md"
    table = pd.read_parquet(out / "report" / "results.parquet")
    assert len(table) == 4 * 4 and set(table["algorithm.correction"]) == {"none", "entr"}
    assert sorted(set(table["controller.inter_lag"])) == [0, 2]
    assert len(pd.read_csv(out / "report" / "results.csv")) == 16
    text = report.read_text()
    pngs = [line.split("](")[1].split(")")[0] for line in text.splitlines() if line.startswith("![")]
    assert pngs and all((report.parent / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)

    # 4. a finished study reruns in seconds and runs nothing
    t0 = time.time()
    proc = study("run", str(tmp_path / "spec.yaml"), "--out", str(out))
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and json.loads(stdout.strip().splitlines()[-1])["skipped"] == 4
    assert time.time() - t0 < 30

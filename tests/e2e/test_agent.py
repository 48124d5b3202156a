"""`entr-megatron train` on the multi-turn tool tasks, as a user runs it: whole episodes reach the learner.

Two jobs at the same time (each: a short SFT on the task's expert tool traces, then a few RL steps):
- calculator, sync: the engine and the learner hold the same fp32 weights at every step, so the
  learner's log-probs of the policy's tokens equal the engine's to rounding (mismatch/k3 ~ 0):
  the observation tokens sit where the engine put them and are left out of the loss; the
  calculator was called and its outputs are in the sequences;
- search (BM25 tool over the generated corpus), fixed_lag with intra_lag 1: every episode's policy
  tokens carry the two prescribed versions (the switch falls inside the first tool call), and the
  learner trains on them; tool calls (after so short a warm-up, many malformed) became observations.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entr_megatron.utils.run_log import read_metrics

pytest.importorskip("bm25s")

ARCH = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "tie_word_embeddings": True}


def config(run_dir: Path, task: dict, controller: dict, max_new: int, max_response: int, max_prompt: int) -> dict:
    return {
        "model": {"architecture": ARCH, "max_prompt_len": max_prompt, "max_seq_len": max_prompt + max_response},
        "algorithm": {"correction": "entr", "tau": 0.5},
        "learner": {"optim": {"lr": 2.0e-4}},
        "rollout": {"prompts_per_step": 2, "sampling": {"max_new_tokens": max_new, "n": 4},
                    "embedded": {"num_threads": 1, "max_batch_size": 32},
                    "agent": {"max_turns": 4, "max_response_tokens": max_response}},
        "controller": {"train_steps": 3, "max_policy_lag": 2, "checkpoint_interval": 0, **controller},
        "task": {"eval_size": 0, **task},  # no held-out passes: this test is about what reaches the learner
        "sft": {"steps": 40, "lr": 3.0e-3, "batch_size": 16, "eval_interval": 40, "eval_size": 8},
        "launcher": {"cpu_threads_per_rank": 1},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "log_interval": 1},
    }


def test_tool_episodes_train_end_to_end(tmp_path):
    jobs = {
        "calculator": config(tmp_path / "calculator", {"name": "calculator", "calculator": {"digits": 2}},
                             {"mode": "sync"}, max_new=32, max_response=64, max_prompt=16),
        "search": config(tmp_path / "search", {"name": "search", "search": {"num_entities": 16}},
                         {"mode": "fixed_lag", "inter_lag": 0, "intra_lag": 1, "intra_lag_stride": 8},
                         max_new=112, max_response=200, max_prompt=40),
    }
    procs = {}
    for name, cfg in jobs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = (tmp_path / f"{name}.log").open("w")
        procs[name] = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(path)],
                                       stdout=subprocess.DEVNULL, stderr=log, text=True)
    for name, proc in procs.items():
        assert proc.wait(timeout=900) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]

    calc = read_metrics(tmp_path / "calculator" / "metrics.jsonl")
    assert [r["step"] for r in calc] == [0, 1, 2]
    for r in calc:
        assert 0.0 <= r["mismatch/k3"] <= 1e-6 and r["entr/mask_fraction"] == 0.0, r["mismatch/k3"]
        assert r["agent/tool_calls/calculator"] > 0 and r["agent/observation_token_frac"] > 0
        assert r["agent/turns_mean"] > 1 and r["policy_lag/max"] == 0
        assert r["loss/count"] > 0  # the policy tokens entered the loss (a gradient needs unequal rewards in a
        # group, which so short a warm-up may not give; observation tokens get none: tests/unit/test_episodes.py)

    search = read_metrics(tmp_path / "search" / "metrics.jsonl")
    assert [r["step"] for r in search] == [0, 1, 2]
    for r in search:
        v = r["policy_version"]
        # after so short a warm-up many calls are malformed ("invalid"): error observations, the run goes on
        assert sum(x for k, x in r.items() if k.startswith("agent/tool_calls/")) > 0 and r["agent/turns_mean"] >= 1
        # step v trains segment 0 from version max(0, v - 1) and segment 1 from version v
        assert r["policy_lag/max"] == min(v, 1) and r["policy_lag/min"] == 0
        assert r["agent/versions_spanned_max"] == (2 if v >= 1 else 1) and r["loss/count"] > 0
    assert any(r["agent/turns_mean"] > 1 for r in search)  # episodes went on after a tool response
    for name in jobs:
        assert (tmp_path / name / "final_model" / "config.json").exists()

"""On-policy consistency across learner layouts: `train` in sync mode, step 1.

Engine and learner start from the same fp32 weights (the run's random init), so the
behaviour log-probs the embedded engine (HF transformers) reports and the learner's
log-probs of the same tokens (Megatron, vocab-parallel) must agree to fp32 rounding:
mismatch/k3 ~ delta^2 / 2 <= 1e-6 and ENTR masks nothing. The vocabulary has 59 rows
(the tokenizer's 58 plus one), not divisible by 2: Megatron pads it to the TP size, and a
padded column that entered the learner's softmax would bias every delta by about log(60 / 59)
(k3 ~ 1e-4), so the check also covers the true-vocabulary handling. The MoE layout replays the
engine's routes (R3) and scores the learner's own routing as well (measure_unreplayed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entr_megatron.utils.run_log import read_metrics

ARCH = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
        "tie_word_embeddings": True, "vocab_size": 59}
MOE_ARCH = {**ARCH, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": []}

R3 = {"routing_replay": "r3", "measure_unreplayed": True}

# (name, parallel section, learner ranks, architecture, algorithm fields)
# TP=1: test_train.py's sync-mode run asserts the same bound at every step. TP=4 and the other
# layouts of the learner alone: tests/distributed (test_learner_step, test_megatron_model).
LAYOUTS = [
    ("tp2_pp2", {"tp": 2, "pp": 2}, 4, ARCH, {}),
    ("ep2_moe_r3", {"ep": 2}, 2, MOE_ARCH, R3),
]
K3_BOUND = 1e-6


def consistency_config(run_dir: Path, parallel: dict, ranks: int, arch: dict, algorithm: dict) -> dict:
    return {
        "model": {"architecture": arch, "max_prompt_len": 16, "max_seq_len": 32},
        "parallel": parallel,
        "algorithm": {"correction": "entr", "tau": 0.5, **algorithm},
        "learner": {"optim": {"lr": 1.0e-4}},
        "rollout": {"prompts_per_step": 2, "sampling": {"max_new_tokens": 6, "n": 4},
                    "embedded": {"num_threads": 1, "max_batch_size": 32}},
        "controller": {"mode": "sync", "train_steps": 1, "checkpoint_interval": 0},
        "task": {"name": "arithmetic", "eval_size": 0, "arithmetic": {"digits": 1, "operations": ["+"]}},
        "launcher": {"nproc_per_node": ranks, "cpu_threads_per_rank": 1},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "log_interval": 1, "tensorboard": False},
    }


def train(config: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("name, parallel, ranks, arch, algorithm", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_sync_step_one_is_on_policy(tmp_path, name, parallel, ranks, arch, algorithm):
    run_dir = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(consistency_config(run_dir, parallel, ranks, arch, algorithm)))
    train(config)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "mismatch/k3" in r]
    assert rows, f"{name}: no training step in metrics.jsonl"
    first = rows[0]
    print(f"{name}: k3 {first['mismatch/k3']:.3g}, mean |delta| {first['mismatch/mean_abs_delta']:.3g}, "
          f"mask fraction {first['entr/mask_fraction']}, tokens {first['mismatch/tokens']:.0f}")
    assert first["mismatch/tokens"] > 0
    assert 0.0 <= first["mismatch/k3"] <= K3_BOUND, f"{name}: k3 {first['mismatch/k3']} at step 1"
    assert first["entr/mask_fraction"] == 0.0, f"{name}: ENTR masked on-policy tokens"
    if algorithm.get("measure_unreplayed"):  # the learner's own routing scored too, same tokens
        assert first["mismatch_unreplayed/tokens"] == first["mismatch/tokens"]
        assert 0.0 <= first["mismatch_unreplayed/k3"] and "routing/disagree_frac" in first, first

"""`entr-megatron train` on the countdown task (long responses, every token labelled), as the fair-test
study runs it (examples/studies/countdown/base.yaml: fixed_lag, a bfloat16 engine with FP8 weights and
activations, two mini-batches, ENTR on the engine's entropy), scaled down: a tiny model, a short SFT, a
few RL steps. Checked from metrics.jsonl: the per-label statistics (token_label/<label>/...), whose
counts cover every response token (countdown labels all of them), so their shares sum to 1, and the
mask diagnostics the study's report reads."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entr_megatron.types import TOKEN_LABELS
from entr_megatron.utils.run_log import read_metrics

pytestmark = pytest.mark.slow

RL_STEPS = 6  # >= 5: the planner fits the learner cost from a run's steps after its first 2


def countdown_config(run_dir: Path) -> dict:
    return {
        "model": {"architecture": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "head_dim": 16, "max_position_embeddings": 96, "tie_word_embeddings": True},
                  "max_prompt_len": 24, "max_seq_len": 88},
        "algorithm": {"correction": "entr", "tau": 1.0, "entropy_source": "rollout"},
        "learner": {"mini_batches": 2, "optim": {"lr": 3.0e-5}},
        "rollout": {"dtype": "bfloat16", "quantize": "fp8", "quantize_activations": True, "prompts_per_step": 4,
                    "sampling": {"max_new_tokens": 64, "n": 4}, "embedded": {"num_threads": 1, "max_batch_size": 16}},
        "controller": {"mode": "fixed_lag", "inter_lag": 1, "train_steps": RL_STEPS, "checkpoint_interval": 0},
        "task": {"name": "countdown", "eval_size": 8, "countdown": {"operations": ["+", "-"]}},
        "sft": {"steps": 40, "lr": 3.0e-3, "batch_size": 32, "eval_interval": 40, "eval_size": 8},
        "launcher": {"cpu_threads_per_rank": 1},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "log_interval": 1, "tensorboard": False},
    }


def test_countdown_train_logs_token_label_shares_that_sum_to_one(tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "countdown.yaml"
    config.write_text(yaml.safe_dump(countdown_config(run_dir)))
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "mismatch/tokens" in r]
    assert len(rows) == RL_STEPS
    sequences = 4 * 4  # prompts_per_step x n
    for row in rows:
        # per-step values are means over the two mini-batches (half of the step's sequences each)
        tokens = row["mismatch/tokens"]
        assert tokens > 0
        assert 2 * tokens == pytest.approx(sequences * row["rollout/response_len_mean"], abs=1e-6)
        counts = {label: row.get(f"token_label/{label}/count", 0.0) for label in TOKEN_LABELS}
        # every response token carries one of the four labels: the counts partition the step's tokens
        assert sum(counts.values()) == pytest.approx(tokens, abs=1e-6), (counts, tokens)
        shares = {label: row[f"token_label/{label}/share"] for label in TOKEN_LABELS
                  if f"token_label/{label}/share" in row}
        assert shares and sum(shares.values()) == pytest.approx(1.0, abs=1e-6), shares
        for label, share in shares.items():
            # a mean over mini-batches of count_m / tokens_m: between 0 and 1, 0 exactly when the count is
            assert 0 <= share <= 1 and (share == 0) == (counts[label] == 0), (label, share, counts[label])
            for stat in ("mean_abs_delta", "mask_fraction", "low_prob_share"):
                value = row[f"token_label/{label}/{stat}"]
                assert math.isfinite(value) and value >= 0, (label, stat, value)
            assert row[f"token_label/{label}/mask_fraction"] <= 1
        # the diagnostics the fair test's report reads are there
        assert 0 <= row["mask/effective_fraction"] <= row["mask/fraction"] + 1e-6
        assert "counterfactual/entr/mask_fraction" in row and "counterfactual/icepop/mask_fraction" in row
        assert any(key.startswith("entropy_bin_mu/") for key in row)
    # countdown responses are long: most of a response is forced, restated text (docs/tasks.md)
    assert rows[-1]["rollout/response_len_mean"] > 10

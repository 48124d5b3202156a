"""`entr-megatron score` at --tp 2 on a tiny random HF model: HF's own log-probs and entropy,
the mismatch summary for lines with rollout_logprobs, and errors that name the bad line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import hf_scores

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 128


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random Qwen2 (qkv bias) saved as an HF directory, and the model itself."""
    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=VOCAB, initializer_range=0.3)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    return str(path), model


def score(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "score", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_score_matches_hf_and_summarises_mismatch(hf_model, tmp_path):
    path, model = hf_model
    g = torch.Generator().manual_seed(3)
    lines = []
    for n in (7, 2, 15, 4, 11):
        lines.append({"id": f"seq{n}", "input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()})
    # Rollout log-probs for the last 5 response tokens: HF's own, perturbed (a "mismatched engine").
    lp, _ = hf_scores(model, lines[2]["input_ids"])
    lines[2]["rollout_logprobs"] = (lp[-5:] + 0.05 * torch.randn(5, generator=g, dtype=torch.float64)).tolist()
    lines[4]["rollout_logprobs"] = hf_scores(model, lines[4]["input_ids"])[0][-3:].tolist()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    text = [json.dumps(x) + "\n" for x in lines]
    inp.write_text("".join(text[:2]) + "\n" + "".join(text[2:]))  # a blank line is skipped

    proc = score("--model", path, "--tp", "2", "--input", str(inp), "--output", str(out), "--batch-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(lines)
    for want, row in zip(lines, got):
        assert list(row)[: len(want)] == list(want) and all(row[k] == want[k] for k in want)  # fields kept, in order
        ref_lp, ref_ent = hf_scores(model, want["input_ids"])
        assert len(row["logprobs"]) == len(row["entropy"]) == len(want["input_ids"]) - 1
        torch.testing.assert_close(torch.tensor(row["logprobs"], dtype=torch.float64), ref_lp, rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.tensor(row["entropy"], dtype=torch.float64), ref_ent, rtol=0, atol=ATOL)
        assert ("mismatch" in row) == ("rollout_logprobs" in want)
    assert got[4]["mismatch"]["mean_abs_delta"] < ATOL and got[4]["mismatch"]["entr_mask_fraction"] == 0.0
    assert 0.0 < got[2]["mismatch"]["mean_abs_delta"] < 0.2
    assert "mismatch vs rollout_logprobs: 2 lines, 8 response tokens" in proc.stdout, proc.stdout
    for label in ("k1 = mean(-delta)", "k3 =", "mean |delta|", "ENTR mask fraction", "entropy bin"):
        assert label in proc.stdout, proc.stdout
    assert "scoring 5 sequences" in proc.stderr


def test_bad_input_line_is_named_and_nothing_is_written(hf_model, tmp_path):
    path, _ = hf_model
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n\n{"input_ids": [1, 2\n')
    proc = score("--model", path, "--tp", "2", "--input", str(inp), "--output", str(out))
    assert proc.returncode != 0
    assert "in.jsonl:3: not valid JSON" in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


# The same checks in-process (they run before any rank is started): seconds instead of a launch each.


def score_in_process(capsys, *args):
    from entr_megatron.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["score", *args])
    return str(e.value.code) + capsys.readouterr().err


@pytest.mark.parametrize("bad_line, message", [
    ('["input_ids"]', r"in\.jsonl:3: expected a JSON object, got list"),
    ('{"tokens": [1, 2]}', r'in\.jsonl:3: missing "input_ids"'),
    ('{"input_ids": []}', r'in\.jsonl:3: "input_ids" must be a non-empty list'),
    ('{"input_ids": [1, 2.5]}', r"in\.jsonl:3: input_ids\[1\]=2\.5 is not an integer token id"),
    (f'{{"input_ids": [1, {VOCAB}]}}', rf"in\.jsonl:3: input_ids\[1\]={VOCAB} is outside the model's vocabulary \[0, {VOCAB}\)"),
    ('{"input_ids": [1, 2, 3], "rollout_logprobs": [-1, -1, -1]}', r'in\.jsonl:3: "rollout_logprobs" must be a list of 1 to'),
    ('{"input_ids": [1, 2, 3], "rollout_logprobs": [-1, NaN]}', r"in\.jsonl:3: rollout_logprobs\[1\]=nan is not a finite"),
])
def test_invalid_lines_are_named(hf_model, tmp_path, capsys, bad_line, message):
    import re

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n\n' + bad_line + "\n")
    err = score_in_process(capsys, "--model", hf_model[0], "--tp", "2", "--input", str(inp), "--output", str(out))
    assert re.search(message, err), err
    assert not out.exists()


def test_unknown_model_dir_or_unsplittable_layout_is_refused(hf_model, tmp_path, capsys):
    path, _ = hf_model
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "o.jsonl")
    inp.write_text('{"input_ids": [1, 2, 3]}\n')
    not_a_model = tmp_path / "not_a_model"  # beside the input and output: never write into a --model
    not_a_model.mkdir()
    err = score_in_process(capsys, "--model", str(not_a_model), "--input", str(inp), "--output", out)
    assert "neither an HF model directory" in err and "learner checkpoint root" in err, err
    err = score_in_process(capsys, "--model", path, "--tp", "3", "--input", str(inp), "--output", out)
    assert "--tp 3 does not divide the model's num_attention_heads=4" in err, err
    err = score_in_process(capsys, "--model", path, "--input", str(tmp_path / "missing.jsonl"), "--output", out)
    assert "cannot read" in err and "missing.jsonl" in err, err

"""`entr-megatron generate` on a tiny random Llama with a locally built tokenizer: greedy equals HF
generate (with HF's T=1 log-probs and entropies), sampled log-probs and entropies equal HF's, seeded
runs reproduce, the output feeds `score` (no mismatch at fp32), errors name the bad line, and the
SGLang path against the mock."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 96
BOS, EOS = 1, 2
LOGPROB_ATOL = 1e-5
FLOATS = ("rollout_logprobs", "rollout_entropy")
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS,
            # Logits of a few units keep fp32 noise ~1e-6 (under LOGPROB_ATOL, and no greedy near-ties).
            initializer_range=0.1)
LINES = [
    {"id": "ids", "input_ids": [5, 17, 3]},
    {"id": "text", "prompt": "w5 w9 w33 w70"},
    {"id": "long", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "extra": {"kept": True}},
]


def build_tokenizer(path):
    """A word-level tokenizer over the model's 96 ids ("w3".."w95" and 3 special tokens) that adds BOS."""
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(model dir with tokenizer, the fp32 model, the same dir without a tokenizer)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval()
    model.save_pretrained(path)
    bare = tmp_path_factory.mktemp("no_tokenizer")
    for f in os.listdir(path):
        os.symlink(path / f, bare / f)
    build_tokenizer(path)
    return str(path), model, str(bare)


def write_lines(path, lines, blank_after=0):
    text = [json.dumps(x) + "\n" for x in lines]
    path.write_text("".join(text[: blank_after + 1]) + "\n" + "".join(text[blank_after + 1:]))


def read_lines(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def generate_in_process(capsys, *args):
    """main(["generate", ...]); returns (exit code, stdout, stderr)."""
    from entr_megatron.cli.main import main

    try:
        code = main(["generate", *args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def prompt_ids(line):
    return line["input_ids"] if "input_ids" in line else [BOS] + [int(w[1:]) for w in line["prompt"].split()]


@torch.no_grad()
def hf_logprobs_entropy(model, ids, n_prompt):
    """log softmax(logits) of ids[n_prompt:] and the entropy of those distributions (float64)."""
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)[n_prompt - 1: -1]
    return logp.gather(-1, torch.tensor(ids[n_prompt:])[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def test_greedy_equals_hf_generate_via_the_cli(hf_model, tmp_path):
    path, model, _ = hf_model
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, LINES)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "entr_megatron.cli.main", "generate", "--model", path, "--input", str(inp),
         "--output", str(out), "--temperature", "0", "--max-new-tokens", "12", "--seed", "0"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "generating 3 samples (3 prompts x n=1" in proc.stderr and "generated 3 samples" in proc.stdout
    tok = transformers.AutoTokenizer.from_pretrained(path)
    got = read_lines(out)
    assert [g["id"] for g in got] == [x["id"] for x in LINES]
    for line, row in zip(LINES, got):
        assert all(row[k] == v for k, v in line.items()) and list(row)[: len(line)] == list(line)
        ids = prompt_ids(line)
        assert row.get("prompt_ids", ids) == ids and ("prompt_ids" in row) == ("prompt" in line)
        want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=12, pad_token_id=0)[0, len(ids):].tolist()
        assert row["output_ids"] == want
        assert row["finish_reason"] == ("stop" if want[-1] == EOS else "length")
        # Greedy reports the model's T=1 log-softmax (as SGLang does), not the point mass's 0.
        ref_lp, ref_ent = hf_logprobs_entropy(model, ids + want, len(ids))
        torch.testing.assert_close(torch.tensor(row["rollout_logprobs"], dtype=torch.float64), ref_lp,
                                   rtol=0, atol=LOGPROB_ATOL)
        torch.testing.assert_close(torch.tensor(row["entropy"], dtype=torch.float64), ref_ent,
                                   rtol=0, atol=LOGPROB_ATOL)
        assert (ref_ent > 1e-3).all() and (ref_lp < 0).any()  # far from the point mass's 0 and 0
        assert row["output_text"] == tok.decode(want, skip_special_tokens=True)
        assert row["sample_index"] == 0 and row["weight_version"] == 0 and row["weight_versions"] == [0] * len(want)


@pytest.fixture(scope="module")
def sampled(hf_model, tmp_path_factory):
    """One seeded run at temperature 1, n=2, as score input: (input path, output path, args)."""
    path = hf_model[0]
    tmp = tmp_path_factory.mktemp("sampled")
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    write_lines(inp, LINES, blank_after=1)
    args = ["--model", path, "--input", str(inp), "--temperature", "1", "--n", "2", "--seed", "7",
            "--max-new-tokens", "10", "--emit-score-input"]
    from entr_megatron.cli.main import main

    assert main(["generate", *args, "--output", str(out)]) == 0
    return inp, out, args


def test_sampled_logprobs_and_entropy_equal_hf(hf_model, sampled):
    _, model, _ = hf_model
    got = read_lines(sampled[1])
    assert [(g["id"], g["sample_index"]) for g in got] == [(x["id"], s) for x in LINES for s in (0, 1)]
    for k, row in enumerate(got):
        ids, out = prompt_ids(LINES[k // 2]), row["output_ids"]
        assert row["prompt_ids"] == ids and row["input_ids"] == ids + out  # what score reads
        assert "entropy" not in row and len(row["rollout_entropy"]) == len(row["rollout_logprobs"]) == len(out) > 0
        ref_lp, ref_ent = hf_logprobs_entropy(model, row["input_ids"], len(ids))
        torch.testing.assert_close(torch.tensor(row["rollout_logprobs"], dtype=torch.float64), ref_lp,
                                   rtol=0, atol=LOGPROB_ATOL)
        torch.testing.assert_close(torch.tensor(row["rollout_entropy"], dtype=torch.float64), ref_ent,
                                   rtol=0, atol=LOGPROB_ATOL)
    assert got[0]["output_ids"] != got[1]["output_ids"]  # two samples of one prompt differ


def test_same_seed_reproduces_whatever_the_batching(sampled, tmp_path, capsys):
    _, first, args = sampled
    again = tmp_path / "again.jsonl"
    # One sample decoded at a time instead of all six together: only the seed decides the tokens.
    code, _, err = generate_in_process(capsys, *args, "--output", str(again), "--max-batch-size", "1")
    assert code == 0, err
    want, got = read_lines(first), read_lines(again)
    assert [{k: v for k, v in r.items() if k not in FLOATS} for r in got] == \
           [{k: v for k, v in r.items() if k not in FLOATS} for r in want]
    for k in FLOATS:  # the batch shape changes fp32 rounding, not the tokens
        flat = [torch.tensor(sum((r[k] for r in rows), [])) for rows in (got, want)]
        torch.testing.assert_close(*flat, rtol=0, atol=LOGPROB_ATOL)


def test_generate_output_feeds_score_without_mismatch(hf_model, sampled, tmp_path):
    scored = tmp_path / "scored.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "score", "--model", hf_model[0],
                           "--input", str(sampled[1]), "--output", str(scored), "--temperature", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = read_lines(scored)
    assert len(rows) == 2 * len(LINES)
    for row in rows:
        assert row["mismatch"]["mean_abs_delta"] < LOGPROB_ATOL and row["mismatch"]["entr_mask_fraction"] == 0.0
        torch.testing.assert_close(torch.tensor(row["entropy"][-len(row["output_ids"]):]),
                                   torch.tensor(row["rollout_entropy"]), rtol=0, atol=LOGPROB_ATOL)
    k3 = float(re.search(r"k3 = mean\(e\^delta - 1 - delta\)\s+(\S+)", proc.stdout).group(1))
    assert abs(k3) < 1e-8, proc.stdout
    assert f"mismatch vs rollout_logprobs: {len(rows)} lines" in proc.stdout


# --- errors: all found before any engine starts ------------------------------------------------


@pytest.mark.parametrize("bad_line, message", [
    ('{"input_ids": [1, 2', r"in\.jsonl:3: not valid JSON"),
    ('["input_ids"]', r"in\.jsonl:3: expected a JSON object, got list"),
    ('{"text": "w5"}', r'in\.jsonl:3: needs "input_ids" \(token ids\) or "prompt" \(text\)'),
    ('{"input_ids": []}', r'in\.jsonl:3: "input_ids" must be a non-empty list'),
    ('{"input_ids": [1, 2.5]}', r"in\.jsonl:3: input_ids\[1\]=2\.5 is not an integer token id"),
    (f'{{"input_ids": [1, {VOCAB}]}}', rf"in\.jsonl:3: input_ids\[1\]={VOCAB} is outside the model's vocabulary"),
    ('{"prompt": ""}', r'in\.jsonl:3: "prompt" must be a non-empty string'),
    ('{"input_ids": ' + json.dumps([5] * 256) + "}",
     r"in\.jsonl:3: the prompt has 256 tokens; the model's context is 256"),
])
def test_bad_lines_are_named_and_nothing_is_written(hf_model, tmp_path, capsys, bad_line, message):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n\n' + bad_line + "\n")
    code, _, err = generate_in_process(capsys, "--model", hf_model[0], "--input", str(inp), "--output", str(out))
    assert code != 0 and re.search(message, str(code) + err), str(code) + err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0"),
    (["--n", "0"], r"--n must be >= 1, got 0"),
    (["--temperature", "-1"], r"--temperature must be >= 0 \(0 = greedy\)"),
    (["--top-k", "-2"], r"--top-k must be -1 or 0 \(off\) or >= 1"),
    (["--max-new-tokens", "0"], r"--max-new-tokens must be >= 1"),
    (["--stop-token-ids", "2", str(VOCAB)], rf"--stop-token-ids: {VOCAB} is outside the model's vocabulary"),
    (["--tp", "2"], r"--tp applies to --engine sglang only"),
    (["--engine", "sglang", "--sglang-url", "http://127.0.0.1:1", "--port", "3"], r"--port shapes a server"),
])
def test_bad_flags_are_named(hf_model, tmp_path, capsys, flags, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n')
    code, _, err = generate_in_process(capsys, "--model", hf_model[0], "--input", str(inp),
                                       "--output", str(tmp_path / "o.jsonl"), *flags)
    assert code != 0 and re.search(message, str(code) + err), str(code) + err


def test_prompt_without_tokenizer_and_missing_model(hf_model, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "o.jsonl")
    inp.write_text('{"input_ids": [1, 2, 3]}\n{"prompt": "w5 w6"}\n')
    code, _, err = generate_in_process(capsys, "--model", hf_model[2], "--input", str(inp), "--output", out)
    msg = str(code) + err
    assert 'in.jsonl:2: "prompt" needs the model\'s tokenizer' in msg and "has no tokenizer" in msg, msg
    not_a_model = tmp_path / "not_a_model"  # beside the input and output: never write into a --model
    not_a_model.mkdir()
    code, _, err = generate_in_process(capsys, "--model", str(not_a_model), "--input", str(inp), "--output", out)
    assert "is not an HF model directory (no config.json)" in str(code) + err


# --- SGLang: a running server (the protocol mock of tests/unit) ---------------------------------


def test_sglang_url_against_the_protocol_mock(tmp_path, capsys):
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "unit"))
    try:
        from sglang_mock import MockSGLangServer, mock_logprob
    finally:
        sys.path.pop(0)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"input_ids": [5, 6, 7]}, {"input_ids": [9]}])
    with MockSGLangServer(vocab_size=50) as server:
        code, _, err = generate_in_process(capsys, "--engine", "sglang", "--sglang-url", server.url,
                                           "--input", str(inp), "--output", str(out),
                                           "--n", "2", "--seed", "1", "--max-new-tokens", "4")
        assert code == 0, err
        bodies = server.calls_to("/generate")
    rows = read_lines(out)
    assert [(r["input_ids"], r["sample_index"]) for r in rows] == [([5, 6, 7], 0), ([5, 6, 7], 1), ([9], 0), ([9], 1)]
    for r in rows:  # no entropy and no text (no tokenizer without --model); log-probs as the server reported
        assert "entropy" not in r and "output_text" not in r and len(r["output_ids"]) == 4
        assert r["rollout_logprobs"] == [mock_logprob(t, 1.0) for t in r["output_ids"]]
    assert len(bodies) == 2 and all(b["return_logprob"] for b in bodies)

"""`entr-megatron score --model CKPT_ROOT`: a learner checkpoint saved at TP=2 scored at TP=1.

One 2-rank gloo launch loads a tiny random HF Llama into a TP=2 learner, perturbs
its weights, saves checkpoint step 5 with ``model_config`` and exports the same
weights as an HF directory, perturbs again, saves step 7 and exports again. Then
``score --tp 1`` of the checkpoint root (step 5 via --step, and the latest, 7) must
give HF transformers' log-probs and entropy of the matching export: the model is
built from ``model_config.json`` alone and the weights resharded TP=2 -> TP=1.
The refusals (no model_config.json, unknown step, an iter_ directory, --step with
an HF directory, a token outside the config's vocabulary) are checked in-process,
before any rank starts.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from entr_megatron.utils.spawn import run_gloo
from helpers import hf_scores

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 128


def _perturb(chunks, seed: int) -> None:
    # The noise of a parameter depends on its name only: replicated (non-TP) parameters stay equal on all ranks.
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _save(rank, world, hf_dir, ckpt, exports):
    from entr_megatron.checkpoint.directory import read_model_config
    from entr_megatron.checkpoint.io import save_checkpoint
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.learner.hf_export import save_hf_checkpoint
    from entr_megatron.learner.hf_load import read_hf_config
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import destroy, initialize_model_parallel

    enable_cpu_compat()
    groups = initialize_model_parallel(2, 1)
    chunks, spec = build_learner_model_from_hf(hf_dir, groups)
    config = read_hf_config(hf_dir)
    for seed, (step, export) in enumerate(zip((5, 7), exports), start=1):
        _perturb(chunks, seed)
        save_checkpoint(ckpt, step, chunks, model_config=config)
        save_hf_checkpoint(chunks, spec, groups, export, hf_config=config)
    assert read_model_config(ckpt) == config
    destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint root, [HF export of step 5, of step 7], source HF dir)."""
    base = tmp_path_factory.mktemp("score_ckpt")
    hf_dir = base / "hf"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=VOCAB, initializer_range=0.3)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(hf_dir)
    ckpt, exports = base / "ckpt", [str(base / "export5"), str(base / "export7")]
    run_gloo(_save, 2, str(hf_dir), str(ckpt), exports, timeout_s=300)
    return str(ckpt), exports, str(hf_dir)


def _score(capsys, *args):
    """Run the command in this process (it spawns its own ranks); (exit message or None, stderr)."""
    from entr_megatron.cli.main import main

    try:
        main(["score", *args])
        code = None
    except SystemExit as e:
        code = str(e.code)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("step", [5, None])
def test_checkpoint_scores_match_hf_forward_of_its_weights(saved, tmp_path, capsys, step):
    ckpt, exports, hf_dir = saved
    g = torch.Generator().manual_seed(3)
    lines = [{"id": n, "input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in (9, 2, 13)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--model", ckpt, "--tp", "1", "--input", str(inp), "--output", str(out), "--batch-tokens", "16"]
    code, err = _score(capsys, *args, *(["--step", str(step)] if step is not None else []))
    assert code is None, err
    assert f"learner checkpoint {ckpt} (step {step or 7})" in err, err

    ref = transformers.AutoModelForCausalLM.from_pretrained(exports[0 if step == 5 else 1]).eval()
    other = transformers.AutoModelForCausalLM.from_pretrained(exports[1 if step == 5 else 0]).eval()
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [row["id"] for row in got] == [x["id"] for x in lines]
    for want, row in zip(lines, got):
        ref_lp, ref_ent = hf_scores(ref, want["input_ids"])
        lp = torch.tensor(row["logprobs"], dtype=torch.float64)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
        torch.testing.assert_close(torch.tensor(row["entropy"], dtype=torch.float64), ref_ent, rtol=0, atol=ATOL)
        if len(lp) > 4:  # the other step's weights give other scores: the step really was chosen
            assert (lp - hf_scores(other, want["input_ids"])[0]).abs().max() > 100 * ATOL


def test_checkpoint_refusals(saved, tmp_path, capsys):
    ckpt, _, hf_dir = saved
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    inp.write_text('{"input_ids": [1, 2, 3]}\n')
    io = ["--input", str(inp), "--output", out]

    bare = tmp_path / "bare_ckpt"  # a checkpoint root saved without model_config
    bare.mkdir()
    (bare / "latest").write_text("5\n")
    code, _ = _score(capsys, "--model", str(bare), *io)
    assert code is not None and "saved without model_config" in code and str(bare / "model_config.json") in code, code
    assert "save_checkpoint(..., model_config=" in code, code

    code, _ = _score(capsys, "--model", ckpt, "--step", "6", *io)
    assert code is not None and "no checkpoint for step 6" in code and "[5, 7]" in code, code
    code, _ = _score(capsys, "--model", f"{ckpt}/iter_0000005", *io)
    assert code is not None and f"--model {ckpt} --step N" in code, code
    code, _ = _score(capsys, "--model", hf_dir, "--step", "5", *io)
    assert code is not None and "is an HF model directory" in code, code
    neither = tmp_path / "neither"  # beside the input and output: --model may not contain them
    neither.mkdir()
    code, _ = _score(capsys, "--model", str(neither), *io)
    assert code is not None and "neither an HF model directory" in code and "learner checkpoint root" in code, code

    inp.write_text(f'{{"input_ids": [1, {VOCAB}]}}\n')  # the vocabulary comes from model_config.json
    code, _ = _score(capsys, "--model", ckpt, *io)
    assert code is not None and f"outside the model's vocabulary [0, {VOCAB})" in code, code
    assert not (tmp_path / "out.jsonl").exists()

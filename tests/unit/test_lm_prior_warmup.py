"""tools/lm_prior_warmup.py: the soft-target loss against torch's label smoothing and a float64 sum,
its schedule against Megatron's OptimizerParamScheduler, and the padded held-out accuracy against
one unpadded forward per example."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("lm_prior_warmup")


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.float64)
    return logits, targets, mask


def test_uniform_reference_is_torch_label_smoothing(tool):
    logits, targets, mask = _case()
    keep = mask.bool()
    for mix in (0.0, 0.1, 0.37):
        loss, nll = tool.soft_target_loss(logits, torch.zeros_like(logits), targets, mask, mix)
        ref = F.cross_entropy(logits[keep], targets[keep], label_smoothing=mix)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
        assert nll.item() == pytest.approx(F.cross_entropy(logits[keep], targets[keep]).item(), rel=1e-6)


def test_reference_distribution_mixed_into_the_target_by_hand(tool):
    logits, targets, mask = _case(1)
    ref_logits = 3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mix = 0.05
    for temperature in (1.0, 0.5):
        loss, _ = tool.soft_target_loss(logits, ref_logits, targets, mask, mix, temperature)
        total, count = 0.0, 0
        for b in range(3):
            for t in range(5):
                if not mask[b, t]:
                    continue
                logp = logits[b, t] - torch.logsumexp(logits[b, t], 0)
                ref = torch.exp(ref_logits[b, t] / temperature)
                q = mix * ref / ref.sum()
                q[targets[b, t]] += 1 - mix
                total -= float((q * logp).sum())
                count += 1
        assert loss.item() == pytest.approx(total / count, rel=1e-5)
    with pytest.raises(ValueError, match="reference"):
        tool.soft_target_loss(logits, None, targets, mask, mix)


def test_schedule_is_linear_then_cosine_to_a_tenth(tool):
    """The scheduler the tool builds (sft_learner_config through lr_scheduler) against the schedule
    written out: linear from 0 over steps // 10 steps, then cosine from lr to lr / 10 at `steps`."""
    from entr_megatron.config.loader import load_config

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    for steps in (40, 600):
        lr = 1e-3
        cfg = load_config(str(root / "examples/studies/lm_tail/base.yaml"), [f"sft.steps={steps}", f"sft.lr={lr}"])
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched = tool.lr_scheduler(opt, tool.sft_learner_config(cfg).optim)
        warmup = steps // 10
        for step in range(steps):
            done = (step - warmup) / (steps - warmup)
            cosine = lr / 10 + 0.9 * lr * 0.5 * (1 + math.cos(math.pi * done))
            expected = lr * step / warmup if step < warmup else cosine
            assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-15)
            sched.step(1)


def test_padded_expected_accuracy_is_one_unpadded_forward_per_example(tool):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config).eval()
    examples = [([1, 5, 7], [9, 3]), ([2, 4], [8, 8, 6, 3]), ([1, 2, 3, 4, 5], [3])]
    expected = 0.0
    for prompt, target in examples:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + target])).logits[0].double(), -1)
        expected += float(sum(logp[len(prompt) - 1 + i, tok] for i, tok in enumerate(target)).exp())
    expected /= len(examples)
    assert tool.expected_accuracy(model, examples, pad_id=0, batch=2) == pytest.approx(expected, rel=1e-4)
    ids, attn, targets, mask = tool.pack(examples, pad_id=0)
    assert ids.tolist()[0] == [1, 5, 7, 9, 3, 0] and attn.tolist()[0] == [1] * 5 + [0]
    assert mask.tolist()[0] == [0, 0, 1, 1, 0] and targets[0, 2:4].tolist() == [9, 3]
    assert mask.tolist()[1] == [0, 1, 1, 1, 1] and targets[1, 1:5].tolist() == [8, 8, 6, 3]


def test_main_trains_saves_and_logs_the_held_out_checks_of_the_saved_model(tool, tmp_path):
    """Two steps of the warm-up on countdown in a small BPE, from a random model: step 0's loss is
    0.9 NLL + 0.1 H(p) of the starting model (the reference is that model), recomputed one example
    at a time in float64; the saved model is the trained one (its held-out accuracy is the last
    check logged); every step is logged, and a finished warm-up is kept."""
    import csv

    import transformers

    from entr_megatron.tasks.bpe_tokenizer import stdlib_corpus_files, train_bpe_tokenizer

    tok = train_bpe_tokenizer([f for f in stdlib_corpus_files() if f.name == "textwrap.py"], vocab_size=600)
    base = tmp_path / "lm"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )).save_pretrained(base)
    tok.save_pretrained(base)
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    args = ["--config", str(root / "examples/studies/lm_tail/base.yaml"), "--mix", "0.1", "--out", str(tmp_path / "w"),
            f"model.path={base}", "sft.steps=2", "sft.eval_interval=1", "sft.batch_size=4", "sft.eval_size=3"]
    assert tool.main(args) == 0
    out = tmp_path / "w" / "sft"
    rows = list(csv.DictReader(open(out / "eval.csv")))
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["1", "2"] and [m["step"] for m in logged] == [0, 1]
    from entr_megatron.config.loader import load_config
    from entr_megatron.tasks import TASK_BUILDERS

    cfg = load_config(args[1], args[6:])     # the tool's config and overrides
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tok, cfg.model.max_prompt_len)

    def per_token(model, examples, fn):
        values = []
        for prompt, target in examples:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + target])).logits[0].double(), -1)
            values.append([fn(logp[len(prompt) - 1 + i], t) for i, t in enumerate(target)])
        return values

    start = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    from entr_megatron.controller.job.sft import sft_examples
    terms = per_token(start, sft_examples(cfg, task, 0), lambda lp, t: 0.9 * -lp[t] - 0.1 * (lp.exp() * lp).sum())
    flat = [float(v) for seq in terms for v in seq]
    assert logged[0]["sft/loss"] == pytest.approx(sum(flat) / len(flat), rel=1e-4)
    trained = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    logps = per_token(trained, task.sft_examples("test", 3, seed=0), lambda lp, t: lp[t])
    expected = sum(math.exp(float(sum(seq))) for seq in logps) / len(logps)
    assert logged[-1]["sft/expected_accuracy"] == pytest.approx(expected, rel=1e-3)
    before = (out / "model" / "model.safetensors").stat().st_mtime_ns
    assert tool.main(args) == 0 and (out / "model" / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(SystemExit):
        tool.main(args[:3] + ["1.5"] + args[4:])

"""A task warm-up whose targets keep a share of the pretrained LM's next-token distribution.

    python tools/lm_prior_warmup.py --config examples/studies/lm_tail/base.yaml --mix 0.01 \
        --out runs/a/warmup [--ref-temperature 0.5] key=value ...     # writes --out/sft/model

The system's warm-up (`entr-megatron sft`) minimises the NLL of the target tokens, which drives a
sure position's tail toward zero. This one (the long-tail testbed's attempt 25,
docs/studies/lm_tail/README.md) trains on the soft target

    q(v) = (1 - a) [v = y] + a p_LM(v | the same prefix)

where p_LM is the frozen model the warm-up starts from (`model.path`), at temperature 1 or
`--ref-temperature`: the loss is -sum_v q(v) log p(v), that is (1 - a) NLL + a CE(p_LM, p), the
cross-entropy form of knowledge distillation toward the base model. With a uniform p_LM it is label
smoothing (torch's `label_smoothing=a`). A position the model learns to copy then keeps about a of
its mass on the LM's plausible alternatives, each under a, at an entropy of about
a (ln(1/a) + H(p_LM)): the long tail at sure positions that a large LM's pretraining leaves and the
5 M testbed LM loses in a hard-target warm-up.

Everything else is the system's warm-up: the examples of step s (`controller.job.sft.sft_examples`,
the same seeds), `sft.batch_size`, Adam (`learner.optim`'s betas, eps, weight decay, here on every
parameter where Megatron exempts norms and biases, the same at base.yaml's 0, and clipping) with
`sft_learner_config`'s schedule (`sft.lr`, a 10% linear warm-up and a cosine to a tenth over
`sft.steps`, through Megatron's scheduler, `learner.optimizer.lr_scheduler`), token-mean loss, the
held-out expected accuracy (mean p(reference | prompt), teacher forced, on `sft.eval_size` test
problems) every `sft.eval_interval` steps and `sft.target_accuracy` as the stop. It runs in HF
transformers on one process, as tools/lm_testbed.py pretrains the LM. Writes --out/sft/model (HF
directory with the tokenizer, written atomically) and --out/sft/metrics.jsonl (every step) and
--out/sft/eval.csv (the held-out checks: step, loss, nll, expected_accuracy); an existing model is
kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

from entr_megatron.config.loader import load_config  # noqa: E402
from entr_megatron.controller.job.sft import sft_examples  # noqa: E402
from entr_megatron.controller.ranks.learner_worker import sft_learner_config  # noqa: E402
from entr_megatron.learner.optimizer import lr_scheduler  # noqa: E402
from entr_megatron.rollout.hf_model import load_causal_lm  # noqa: E402
from entr_megatron.tasks import TASK_BUILDERS, load_tokenizer  # noqa: E402


def say(msg: str) -> None:
    print(f"[lm_prior_warmup] {msg}", flush=True)


def soft_target_loss(logits: torch.Tensor, ref_logits: torch.Tensor | None, targets: torch.Tensor, mask: torch.Tensor,
                     mix: float, ref_temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-mean of -sum_v q(v) log p(v), q = (1 - mix) onehot(target) + mix softmax(ref_logits / T),
    over the positions `mask` keeps; also returns the token-mean NLL of the targets (detached).
    logits, ref_logits: [B, T, V]; targets, mask: [B, T]. ref_logits None: mix must be 0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    per_token = nll
    if mix:
        if ref_logits is None:
            raise ValueError("mix > 0 needs the reference model's logits")
        ref_p = torch.softmax(ref_logits.float() / ref_temperature, dim=-1)
        per_token = (1 - mix) * nll - mix * (ref_p * logp).sum(-1)
    n = mask.sum().clamp(min=1)
    return (per_token * mask).sum() / n, ((nll * mask).sum() / n).detach()


def pack(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask, next-token targets and the mask of the target
    positions (the positions that predict a target token)."""
    length = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros(len(examples), length - 1)
    for i, (p, t) in enumerate(examples):
        seq = list(p) + list(t)
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        loss_mask[i, len(p) - 1:len(seq) - 1] = 1
    return ids, attn, ids[:, 1:], loss_mask


@torch.no_grad()
def expected_accuracy(model, examples: list[tuple[list[int], list[int]]], pad_id: int, batch: int = 64) -> float:
    """Mean p(target | prompt), teacher forced (the system's sft/expected_accuracy)."""
    total = 0.0
    for i in range(0, len(examples), batch):
        ids, attn, targets, mask = pack(examples[i:i + batch], pad_id)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
        lp = (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum(-1)
        total += lp.exp().sum().item()
    return total / len(examples)


def save_model(model, tokenizer, out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config: model.path, task, sft, learner.optim, seed")
    p.add_argument("--out", required=True, help="run folder (writes sft/model and sft/metrics.jsonl)")
    p.add_argument("--mix", type=float, required=True, help="share a of the LM's distribution in the target, [0, 1)")
    p.add_argument("--ref-temperature", type=float, default=1.0,
                   help="the LM's distribution in the target at this temperature (< 1: on fewer alternatives)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = p.parse_args(argv)
    if not 0 <= a.mix < 1:
        p.error(f"--mix must be in [0, 1), got {a.mix}")
    if not a.ref_temperature > 0:
        p.error(f"--ref-temperature must be > 0, got {a.ref_temperature}")
    if a.threads < 1:
        p.error(f"--threads must be >= 1, got {a.threads}")
    cfg = load_config(a.config, a.overrides)
    if cfg.sft is None or cfg.sft.data_files:
        raise SystemExit("the config needs an `sft` section without sft.data_files (the task generates the data)")
    out = Path(a.out) / "sft" / "model"
    if (out / "config.json").is_file():
        say(f"already done: {out}")
        return 0
    torch.set_num_threads(a.threads)
    torch.manual_seed(cfg.controller.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer, cfg.model.max_prompt_len)
    if not hasattr(task, "sft_examples"):
        raise SystemExit(f"task {cfg.task.name!r} generates no SFT data")
    model = load_causal_lm(cfg.model.path, dtype="float32", init="pretrained").train().requires_grad_(True)
    ref = load_causal_lm(cfg.model.path, dtype="float32", init="pretrained") if a.mix else None
    o = sft_learner_config(cfg).optim    # the system warm-up's optimizer settings and schedule
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)
    scheduler = lr_scheduler(opt, o)
    held_out = task.sft_examples("test", cfg.sft.eval_size, seed=cfg.controller.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    s = cfg.sft
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"{s.steps} steps x {s.batch_size} examples, lr {s.lr:g}, LM share in the target {a.mix:g} at T "
        f"{a.ref_temperature:g}, from {cfg.model.path}")
    t_start = time.time()
    with open(out.parent / "metrics.jsonl", "w") as log, open(out.parent / "eval.csv", "w") as checks:
        checks.write("step,loss,nll,expected_accuracy\n")
        for step in range(s.steps):
            ids, attn, targets, mask = pack(sft_examples(cfg, task, step), pad)
            ref_logits = None
            if ref is not None:
                with torch.no_grad():
                    ref_logits = ref(input_ids=ids, attention_mask=attn).logits[:, :-1]
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            loss, nll = soft_target_loss(logits, ref_logits, targets, mask, a.mix, a.ref_temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad or float("inf"))
            lr = opt.param_groups[0]["lr"]
            if torch.isfinite(norm):      # as optimizer_step: a skipped step does not advance the schedule
                opt.step()
                scheduler.step(1)
            row = {"step": step, "sft/loss": loss.item(), "sft/nll": nll.item(), "grad_norm": norm.item(), "lr": lr}
            reached = False
            if (step + 1) % s.eval_interval == 0 or step + 1 == s.steps:
                model.eval()
                row["sft/expected_accuracy"] = acc = expected_accuracy(model, held_out, pad)
                model.train()
                reached = s.target_accuracy is not None and acc >= s.target_accuracy
                checks.write(f"{step + 1},{row['sft/loss']:.4f},{row['sft/nll']:.4f},{acc:.4f}\n")
                checks.flush()
                say(f"step {step + 1}/{s.steps}: loss {row['sft/loss']:.4f}, nll {row['sft/nll']:.4f}, held-out "
                    f"expected accuracy {acc:.3f} ({time.time() - t_start:.0f} s)")
            log.write(json.dumps(row) + "\n")
            log.flush()
            if reached:
                say(f"reached sft.target_accuracy={s.target_accuracy:g} after {step + 1} steps")
                break
    save_model(model.eval(), tokenizer, out)
    say(f"done: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

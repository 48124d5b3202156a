"""The long-tail testbed's starting model: a 32k byte-level BPE and a small LM pretrained on text.

    python tools/lm_testbed.py --out runs/lm_testbed            # 25-90 min on 2 cores (alone / shared); resumable

Writes, under --out:
  tokenizer/           the BPE (tasks/bpe_tokenizer.py), trained on Python's standard library
  lm/                  the pretrained model, an HF directory (Qwen3, tied embeddings) with the tokenizer:
                       what examples/studies/lm_tail/base.yaml starts every warm-up from
  pretrain.jsonl       loss per logged step, held-out loss per eval
  testbed.json         what was built: corpus digest and size, tokens, sizes, losses, wall time
  state.pt             the last resumable state (model, optimizer, step), written atomically

Why these sizes (docs/studies/lm_tail/README.md): a cell of the grid must run in minutes on 2 cores,
so the body is the countdown testbed's (hidden 128, 4 layers, 4 heads, 2 KV heads); the vocabulary is
a production one (32,768 entries), so the output layer holds 4.2 M of the 5.1 M parameters and a
model that has learnt language spreads its mass over a real tail. Pretraining is next-token
prediction on the same corpus as the tokenizer, packed into 128-token rows, a 1% held-out split:
500 steps of 32 rows (2.0 M tokens, 0.7 epochs), AdamW at 2e-3 with a cosine to a tenth; held-out loss
3.65 (perplexity 39) in the committed build (docs/studies/lm_tail/testbed.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

from entr_megatron.tasks.bpe_tokenizer import (  # noqa: E402
    corpus_digest, iter_corpus_texts, stdlib_corpus_files, train_bpe_tokenizer,
)

HELD_OUT = 0.01
"""Share of the packed rows kept out of training, for the held-out loss."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (resumes what it holds)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per packed row")
    p.add_argument("--batch", type=int, default=32, help="rows per step")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--save-interval", type=int, default=100)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "seq", "batch", "steps", "save_interval",
                 "eval_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads}: hidden must divide "
                "by heads and heads by kv-heads")
    return args


def say(msg: str) -> None:
    print(f"[lm_testbed] {msg}", flush=True)


def tokenizer_and_rows(out: Path, args) -> tuple[transformers.PreTrainedTokenizerFast, torch.Tensor, dict]:
    """The tokenizer (trained once) and the corpus packed into [rows, seq] (files joined by EOS)."""
    files = stdlib_corpus_files()
    digest = corpus_digest(files)
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    else:
        t0 = time.time()
        tok = train_bpe_tokenizer(files, vocab_size=args.vocab)
        tok.save_pretrained(tok_dir.with_name("tokenizer.tmp"))
        os.replace(tok_dir.with_name("tokenizer.tmp"), tok_dir)
        say(f"BPE of {len(tok)} entries trained in {time.time() - t0:.1f} s on {len(files)} files")
    if len(tok) != args.vocab:
        raise SystemExit(f"{tok_dir} has {len(tok)} entries, --vocab is {args.vocab}: use another --out")
    ids: list[int] = []
    for text in iter_corpus_texts(files):
        ids.extend(tok.encode(text, add_special_tokens=False))
        ids.append(tok.eos_token_id)
    n_rows = len(ids) // args.seq
    rows = torch.tensor(ids[:n_rows * args.seq]).view(n_rows, args.seq)
    corpus = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "tokens": len(ids),
              "sha256": digest, "root": os.path.commonpath([str(f) for f in files])}
    return tok, rows, corpus


def build_model(tok, args) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=max(256, args.seq), rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return transformers.Qwen3ForCausalLM(config)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine to a tenth."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    done = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


@torch.no_grad()
def held_out_loss(model, rows: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [model(input_ids=rows[i:i + batch], labels=rows[i:i + batch]).loss.item()
              for i in range(0, len(rows), batch)]
    model.train()
    return sum(losses) / len(losses)


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "lm" / "config.json").is_file():
        say(f"{out / 'lm'} is built already (remove it to build again)")
        return 0
    tok, rows, corpus = tokenizer_and_rows(out, args)
    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    n_val = max(1, int(len(rows) * HELD_OUT))
    val, train = rows[order[:n_val]], rows[order[n_val:]]
    say(f"corpus: {corpus['files']} files, {corpus['bytes'] / 1e6:.1f} MB, {corpus['tokens'] / 1e6:.2f} M tokens "
        f"({len(train)} training rows of {args.seq}, {n_val} held out); sha256 {corpus['sha256'][:16]}")
    model = build_model(tok, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, t_used = 0, 0.0
    if (out / "state.pt").is_file():
        state = torch.load(out / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, t_used = state["step"], state["wall_s"]
        say(f"resumed at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params / 1e6:.2f} M parameters, {args.steps} steps of {args.batch} x {args.seq} tokens "
        f"({args.steps * args.batch * args.seq / len(train) / args.seq:.2f} epochs)")
    log = open(out / "pretrain.jsonl", "a")
    t0 = time.time() - t_used
    model.train()
    while step < args.steps:
        epoch, pos = divmod(step * args.batch, len(train))
        perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        batch = train[perm[pos:pos + args.batch]]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        row = {"step": step, "loss": loss.item(), "lr": lr_at(step - 1, args), "wall_s": time.time() - t0}
        if step % args.eval_interval == 0 or step == args.steps:
            row["held_out_loss"] = held_out_loss(model, val, args.batch)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if step % 20 == 0 or "held_out_loss" in row:
            extra = f", held-out {row['held_out_loss']:.3f}" if "held_out_loss" in row else ""
            say(f"step {step}/{args.steps} loss {row['loss']:.3f}{extra} ({row['wall_s'] / 60:.1f} min)")
        if step % args.save_interval == 0 and step < args.steps:
            save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                         "wall_s": time.time() - t0}, out / "state.pt")
    final = held_out_loss(model, val, args.batch)
    tmp = out / "lm.tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out / "lm")
    info = {"corpus": corpus, "vocab": len(tok), "parameters": n_params, "steps": args.steps, "batch": args.batch,
            "seq": args.seq, "lr": args.lr, "tokens_trained": args.steps * args.batch * args.seq,
            "held_out_loss": final, "held_out_ppl": math.exp(final), "wall_s": time.time() - t0,
            "args": vars(args), "torch": torch.__version__, "transformers": transformers.__version__}
    (out / "testbed.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "state.pt").unlink(missing_ok=True)
    say(f"done: held-out loss {final:.3f} (ppl {math.exp(final):.1f}) in {info['wall_s'] / 60:.1f} min -> {out / 'lm'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

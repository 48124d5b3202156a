"""Where a copy-task model keeps its tail, by entropy bin: teacher forced on held-out copies in the
BPE's tokenization, the share of positions in each H bin, how many of them are tokens of two or more
characters (those a sampled tokenization can cut, task.copy.sft_split_prob), the mass on those
tokens' split pieces (the first token of each proper prefix), and the mass on all tokens under 1e-2;
then, for the tokens of two or more characters by BPE id (the BPE numbers its merges most frequent
first), how often the model is sure (H < 0.1) where it copies them.

    python tools/copy_split_mass.py --config examples/studies/lm_tail/base.yaml \
        --model RUN/warmup/sft/model --prompts 200 --out DIR/split_mass.md  task.name=copy ...

ENTR's precondition counts rare tokens (mu(y) < 1e-2) drawn at positions with H(mu) < 0.1
(tools/tail_precondition.py); this says which positions could hold them: a position's expected
rare draws are its mass under 1e-2, so per 1k positions of a bin the rare draws are 1000 x share x
mean rare mass. Float32, the model's own logits (no engine numerics, no sampling).

With `--target A:T` (repeatable) each --model is read as the pretrained LM and the tables describe
tools/lm_prior_warmup.py's soft target q = (1 - A) [v = y] + A softmax(logits / T) instead: the
distribution a warm-up with --mix A --ref-temperature T trains toward, read before building one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbour tail_precondition, when loaded by path

import torch  # noqa: E402

from entr_megatron.config.loader import load_config  # noqa: E402
from entr_megatron.rollout.hf_model import load_causal_lm  # noqa: E402
from entr_megatron.tasks import TASK_BUILDERS, load_tokenizer  # noqa: E402
from tail_precondition import LOW_H, RARE_P  # noqa: E402  (the precondition's "rare" and "sure")

H_BINS = ((0.0, 0.01), (0.01, 0.1), (0.1, 1.0), (1.0, float("inf")))
ID_BINS = (0, 300, 1000, 2000, 4000, 8000, 16000, None)


def split_pieces(tokenizer, token: int) -> list[int]:
    """The first token of the BPE's encoding of each proper prefix of `token`'s text: the tokens a
    cut of `token` starts with (none for a one-character token)."""
    text = tokenizer.decode([token])
    return sorted({tokenizer.encode(text[:k], add_special_tokens=False)[0] for k in range(1, len(text))})


def position_rows(logp: torch.Tensor, targets: list[int], pieces: list[list[int]]) -> list[tuple]:
    """(H, is a token of two or more characters, mass on its split pieces, mass under 1e-2, token id)
    per position; logp: [positions, vocab] log-probabilities, targets: the token at each position."""
    p = logp.exp()
    H = -(p * logp).sum(-1)
    rare = torch.where(p < RARE_P, p, torch.zeros_like(p)).sum(-1)
    return [(float(H[j]), bool(pieces[j]), float(p[j, pieces[j]].sum()) if pieces[j] else 0.0, float(rare[j]),
             targets[j]) for j in range(len(targets))]


def soft_target(logits: torch.Tensor, targets: list[int], mix: float, temperature: float) -> torch.Tensor:
    """log q, q = (1 - mix) onehot(target) + mix softmax(logits / temperature) (lm_prior_warmup's target);
    logits: [positions, vocab]."""
    q = mix * torch.softmax(logits.double() / temperature, -1)
    q[torch.arange(len(targets)), torch.tensor(targets)] += 1 - mix
    return q.clamp_min(1e-300).log()


def parse_target(text: str) -> tuple[float, float]:
    """`A:T` (or `A`, T = 1) -> (A, T), A in (0, 1), T > 0."""
    a, _, t = text.partition(":")
    try:
        mix, temperature = float(a), float(t or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--target takes MIX[:TEMPERATURE], e.g. 0.01:0.5; got {text!r}") from None
    if not 0 < mix < 1 or temperature <= 0:
        raise argparse.ArgumentTypeError(f"--target {text!r}: MIX must be in (0, 1) and TEMPERATURE > 0")
    return mix, temperature


def summarize(rows: list[tuple]) -> list[dict]:
    """Per H bin: share of positions, share of them that can be cut, mean split mass at those, mean
    mass under 1e-2, and the rare draws it gives per 1k positions (of all bins)."""
    out = []
    for lo, hi in H_BINS:
        g = [r for r in rows if lo <= r[0] < hi]
        cut = [r for r in g if r[1]]
        rare = sum(r[3] for r in g) / len(g) if g else 0.0
        out.append({"H": (lo, hi), "share": len(g) / len(rows), "multi_char": len(cut) / len(g) if g else 0.0,
                    "split_mass": sum(r[2] for r in cut) / len(cut) if cut else 0.0,
                    "rare_mass": rare, "rare_per_1k": 1000 * len(g) / len(rows) * rare})
    return out


def by_id(rows: list[tuple]) -> list[dict]:
    """Tokens of two or more characters by id bin: their positions and the share at H < 0.1."""
    out = []
    for lo, hi in zip(ID_BINS, ID_BINS[1:]):
        g = [r for r in rows if r[1] and r[4] >= lo and (hi is None or r[4] < hi)]
        out.append({"ids": (lo, hi), "positions": len(g), "sure": sum(r[0] < LOW_H for r in g) / len(g) if g else 0.0})
    return out


def id_table(bins: list[dict]) -> str:
    lines = [f"| token ids | positions (tokens of >= 2 characters) | share at H < {LOW_H:g} |", "|---|---|---|"]
    lines += [f"| {b['ids'][0]}-{'' if b['ids'][1] is None else b['ids'][1]} | {b['positions']} | {b['sure']:.2f} |"
              for b in bins]
    return "\n".join(lines)


def table(summary: list[dict]) -> str:
    lines = ["| H bin | share of positions | tokens of >= 2 characters | their split mass | mass under 1e-2 | "
             "rare draws per 1k positions |", "|---|---|---|---|---|---|"]
    for b in summary:
        lo, hi = b["H"]
        lines.append(f"| [{lo:g}, {hi:g}) | {b['share']:.3f} | {b['multi_char']:.2f} | {b['split_mass']:.4f} | "
                     f"{b['rare_mass']:.4f} | {b['rare_per_1k']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the testbed's run config (the copy task's section)")
    ap.add_argument("--model", action="append", required=True,
                    help="HF directory (repeatable; all read with the first one's tokenizer)")
    ap.add_argument("--prompts", type=int, default=200, help="held-out lines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="a .md file for the tables (else printed only)")
    ap.add_argument("--target", action="append", type=parse_target, default=[], metavar="MIX[:T]",
                    help="read --model as the LM and table lm_prior_warmup's target at this mix and temperature "
                         "(repeatable)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = ap.parse_args(argv)
    if a.prompts < 1:
        ap.error(f"--prompts must be >= 1, got {a.prompts}")
    cfg = load_config(a.config, a.overrides)
    if cfg.task.name != "copy":
        raise SystemExit(f"task.name is {cfg.task.name!r}: this tool reads the copy task (task.name=copy)")
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(a.model[0])
    task = TASK_BUILDERS["copy"](cfg.task, tokenizer, cfg.model.max_prompt_len)
    examples = task.sft_examples("test", a.prompts, seed=a.seed)
    cache: dict[int, list[int]] = {}
    parts = [f"# Split mass by entropy bin ({a.prompts} held-out copies, teacher forced, float32)\n",
             "Command: `python tools/copy_split_mass.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`\n"]
    targets = a.target or [None]
    for path in a.model:
        model = load_causal_lm(path, dtype="float32")
        rows: dict = {t: [] for t in targets}
        for prompt, target in examples:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1:-1]
            for t in set(target) - cache.keys():
                cache[t] = [] if t == tokenizer.eos_token_id else split_pieces(tokenizer, t)
            pieces = [cache[t] for t in target]
            for spec in targets:
                logp = torch.log_softmax(logits.double(), -1) if spec is None else soft_target(logits, target, *spec)
                rows[spec] += position_rows(logp, target, pieces)
        for spec, r in rows.items():
            what = path if spec is None else f"{path}: the target at mix {spec[0]:g}, temperature {spec[1]:g}"
            text = (f"## {what}\n\n{len(r)} positions.\n\n{table(summarize(r))}\n\n"
                    f"Tokens of two or more characters by BPE id:\n\n{id_table(by_id(r))}\n")
            print(text)
            parts.append(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""ENTR's precondition on a testbed: rare tokens sampled at low-entropy positions, and how far their
log-ratio moves, by mismatch source (engine numerics, staleness, both).

    python tools/tail_precondition.py --config examples/studies/lm_tail/base.yaml \
        --model RUN/warmup/seed=0/sft/model --stale RUN_AT_K/model --prompts 128 \
        --out docs/studies/lm_tail/precondition

ENTR (docs/ENTR.md) exists for a token y sampled with a small behaviour probability mu(y) at a
position where mu is sure (low entropy H(mu)): its log-ratio delta = log pi(y) - log mu(y) is noise,
and ENTR masks it where |delta| > sqrt(tau (H + eps)). This counts such tokens and their |delta|.

Sources of mismatch, each a (behaviour engine, learner) pair; the learner is always float32:
  numerics   engine = the learner's weights (--model) in each --engine numerics
  staleness  engine = the stale weights (--stale) in float32, learner = --model
  both       engine = the stale weights in each --engine numerics, learner = --model
Responses are sampled by the engine's own decoder (rollout/decoder.BatchDecoder: log mu(y) and H(mu)
as the engine reports them), with the config's sampling, on the task's held-out prompts; the
learner scores each sequence with one full forward (log pi(y), pi(y)).

Printed and written (--out: precondition.md, precondition.json, rare_tokens.csv.gz of the rare tokens):
per 1k response tokens, tokens with mu(y) < 1e-2 at H(mu) < 0.1 ("rare at low entropy"); of them,
the share whose |delta| crosses ENTR's threshold (tau, eps of the config; with H(mu), the paper's),
IcePop's band (pi / mu outside [0.5, 5]) and DPPO's (|pi(y) - mu(y)| > 0.15); the quantiles of their
|delta|; counts and mean |delta| by H(mu) bin x mu(y) bin; where the task labels its tokens (the
countdown's forced / choice / arithmetic / answer), the same counts by label; and the tokens most
often rare at low entropy. The precondition (issue 43) holds when at least 2 tokens per 1k response
tokens are rare at low entropy AND cross ENTR's threshold.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

from entr_megatron.config.loader import load_config  # noqa: E402
from entr_megatron.rollout.decoder import decode_all  # noqa: E402
from entr_megatron.rollout.engine import SamplingParams  # noqa: E402
from entr_megatron.rollout.hf_model import eos_token_ids, load_causal_lm  # noqa: E402
from entr_megatron.rollout.quantize import install_rounding  # noqa: E402
from entr_megatron.tasks import TASK_BUILDERS, load_tokenizer  # noqa: E402
from entr_megatron.types import Sample  # noqa: E402

ENGINES = {  # name: (dtype, quantize, scale, activations)
    "fp32": ("float32", "none", "per_channel", False),
    "bf16": ("bfloat16", "none", "per_channel", False),
    "bf16 + fp8 w8a8": ("bfloat16", "fp8", "per_channel", True),
}
"""Engine numerics: float32 (no numerical mismatch), bfloat16 throughout (output layer and logits
included, as SGLang and vLLM serve), and bf16 with FP8 e4m3 weights and activations in every linear
layer but the output layer (what FP8 rollout recipes quantize, rollout/quantize.py)."""
H_EDGES = (0.0, 1e-3, 1e-2, 0.1, 1.0, math.inf)
P_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0 + 1e-9)
RARE_P, LOW_H = 1e-2, 0.1
"""'Rare at low entropy': mu(y) < RARE_P at a position with H(mu) < LOW_H (issue 43's definition)."""
ICEPOP_BAND = (0.5, 5.0)
DPPO_DELTA = 0.15
PRECONDITION_PER_1K = 2.0
TOP_TOKENS = 12
"""The rare-at-low-H tokens listed by identity, commonest first."""


def sample(model, prompts: list[list[int]], params: SamplingParams, batch: int) -> list[tuple]:
    """(prompt ids, response ids, log mu per token, H(mu) per token) of every sample, in request order."""
    results = decode_all(model, prompts, params, batch, eos_token_ids(model))
    return [(r.prompt_ids, r.output_ids, r.logprobs, r.entropy) for r in results]


@torch.no_grad()
def learner_logprobs(model, samples: list[tuple], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y) and H(pi) at every response token, float64, one forward per sequence (the full
    [tokens, V] log-probs of one sequence at a time: a 32k vocabulary x 10^5 tokens does not fit)."""
    lp, ent = [], []
    for prompt, resp, _, _ in samples:
        logits = model(input_ids=torch.tensor([prompt + resp])).logits[0].double()
        logq = (logits[len(prompt) - 1:len(prompt) + len(resp) - 1] / temperature).log_softmax(-1)
        lp.append(logq.gather(1, torch.tensor(resp)[:, None])[:, 0])
        ent.append(-(logq.exp() * logq).sum(-1))
    return torch.cat(lp), torch.cat(ent)


def response_labels(task, references: list, samples: list[tuple], n: int) -> list[str] | None:
    """The task's label of every response token (sample j answers prompt j // n: decode_all's order), or
    None for a task that labels nothing."""
    if not hasattr(task, "token_labels"):
        return None
    assert len(samples) == len(references) * n, (len(samples), len(references), n)
    return [label for j, (prompt, resp, log_mu, _) in enumerate(samples)
            for label in task.token_labels(Sample(prompt, resp, log_mu, [0] * len(resp)), references[j // n])]


def measure(samples: list[tuple], log_pi: torch.Tensor, h_pi: torch.Tensor, tau: float, eps: float,
            labels: list[str] | None = None) -> dict:
    """The precondition's numbers for one (engine, learner) pair; `labels`: the task's label of each
    response token (`response_labels`), for the counts by label."""
    token = torch.tensor([t for s in samples for t in s[1]], dtype=torch.long)
    log_mu = torch.tensor([v for s in samples for v in s[2]], dtype=torch.float64)
    h_mu = torch.tensor([v for s in samples for v in s[3]], dtype=torch.float64)
    mu, pi = log_mu.exp(), log_pi.exp()
    delta = log_pi - log_mu
    n = delta.numel()
    per_1k = 1000.0 / n
    entr = delta.abs() > torch.sqrt(tau * (h_mu + eps))
    entr_learner = delta.abs() > torch.sqrt(tau * (h_pi + eps))
    icepop = (delta < math.log(ICEPOP_BAND[0])) | (delta > math.log(ICEPOP_BAND[1]))
    dppo = (pi - mu).abs() > DPPO_DELTA
    rare = (mu < RARE_P) & (h_mu < LOW_H)
    d_rare = delta[rare].abs()
    low_h = h_mu < LOW_H

    def q(x, p):
        return float(torch.quantile(x, p)) if x.numel() else float("nan")

    out = {
        "response_tokens": n, "responses": len(samples),
        "mean_abs_delta": float(delta.abs().mean()),
        "rare_low_h_per_1k": float(rare.sum()) * per_1k,
        "low_h_share": float(low_h.double().mean()),
        # Each token w with mu(w) < RARE_P adds -mu(w) log mu(w) > mu(w) log(1/RARE_P) to H(mu), so a
        # position's rare mass, the chance its sampled token is rare, is < H(mu) / log(1/RARE_P):
        # summed over the low-H positions, a ceiling on the expected rare-at-low-H count.
        "rare_low_h_ceiling_per_1k": float(h_mu[low_h].sum()) / math.log(1 / RARE_P) * per_1k,
        "rare_low_h_entr_per_1k": float((rare & entr).sum()) * per_1k,
        "share_of_rare_low_h": {
            "entr (H mu)": float((rare & entr).sum() / max(1, int(rare.sum()))),
            "entr (H pi)": float((rare & entr_learner).sum() / max(1, int(rare.sum()))),
            "icepop band": float((rare & icepop).sum() / max(1, int(rare.sum()))),
            "dppo tv": float((rare & dppo).sum() / max(1, int(rare.sum()))),
        },
        "rare_low_h_abs_delta": {"p50": q(d_rare, 0.5), "p90": q(d_rare, 0.9), "p99": q(d_rare, 0.99),
                                 "max": float(d_rare.max()) if d_rare.numel() else float("nan")},
        "masked_per_1k_all_tokens": {"entr (H mu)": float(entr.sum()) * per_1k,
                                     "entr (H pi)": float(entr_learner.sum()) * per_1k,
                                     "icepop band": float(icepop.sum()) * per_1k, "dppo tv": float(dppo.sum()) * per_1k},
        "bins": [],
    }
    out["holds"] = out["rare_low_h_entr_per_1k"] >= PRECONDITION_PER_1K
    for h_lo, h_hi in zip(H_EDGES, H_EDGES[1:]):
        for p_lo, p_hi in zip(P_EDGES, P_EDGES[1:]):
            m = (h_mu >= h_lo) & (h_mu < h_hi) & (mu >= p_lo) & (mu < p_hi)
            k = int(m.sum())
            out["bins"].append({
                "H": [h_lo, h_hi], "mu": [p_lo, min(p_hi, 1.0)], "tokens": k, "per_1k": k * per_1k,
                "mean_abs_delta": float(delta[m].abs().mean()) if k else None,
                "entr_share": float(entr[m].double().mean()) if k else None,
            })
    if labels is not None:
        assert len(labels) == n, (len(labels), n)
        out["by_label"] = {}
        for name in dict.fromkeys(labels):
            m = torch.tensor([x == name for x in labels])
            out["by_label"][name] = {
                "tokens_per_1k": float(m.sum()) * per_1k, "low_h_share": float(low_h[m].double().mean()),
                "rare_low_h_per_1k": float((rare & m).sum()) * per_1k,
                "rare_low_h_entr_per_1k": float((rare & entr & m).sum()) * per_1k}
    ids, counts = token[rare].unique(return_counts=True)
    out["rare_low_h_tokens"] = [
        {"token_id": i, "per_1k": c * per_1k, "entr_share": float(entr[rare & (token == i)].double().mean())}
        for c, i in sorted(zip(counts.tolist(), ids.tolist()), key=lambda x: (-x[0], x[1]))[:TOP_TOKENS]]
    rows = torch.nonzero(rare)[:, 0].tolist()
    out["_rare_rows"] = [(int(token[i]), labels[i] if labels is not None else "", float(log_mu[i]), float(h_mu[i]),
                          float(log_pi[i]), float(h_pi[i])) for i in rows]
    return out


def _fmt(x, spec=".3f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(report: dict) -> str:
    """The tables of precondition.md."""
    lines = [f"# ENTR's precondition: {report['title']}", "", report["setup"], "",
             "## Per source of mismatch", "",
             "| source | engine | response tokens | positions at low H | rare at low H per 1k | its ceiling "
             "(entropy) | ... crossing ENTR (H mu) per 1k | "
             "holds (>= 2 per 1k) | share crossing ENTR (H mu) | ENTR (H pi) | IcePop band | DPPO TV | "
             "\\|delta\\| p50 | p90 | p99 | max | mean \\|delta\\| all tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        s, d = r["share_of_rare_low_h"], r["rare_low_h_abs_delta"]
        lines.append(f"| {r['source']} | {r['engine']} | {r['response_tokens']} | {_fmt(r.get('low_h_share'))} | "
                     f"{r['rare_low_h_per_1k']:.2f} | {_fmt(r.get('rare_low_h_ceiling_per_1k'), '.2f')} | "
                     f"{r['rare_low_h_entr_per_1k']:.2f} | {'yes' if r['holds'] else 'no'} | "
                     f"{s['entr (H mu)']:.3f} | {s['entr (H pi)']:.3f} | {s['icepop band']:.3f} | {s['dppo tv']:.3f} | "
                     f"{_fmt(d['p50'])} | {_fmt(d['p90'])} | {_fmt(d['p99'])} | {_fmt(d['max'])} | "
                     f"{r['mean_abs_delta']:.2e} |")
    lines += ["", "Tokens masked per 1k response tokens (all tokens, not only the rare ones):", "",
              "| source | engine | ENTR (H mu) | ENTR (H pi) | IcePop band | DPPO TV |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        m = r["masked_per_1k_all_tokens"]
        lines.append(f"| {r['source']} | {r['engine']} | {m['entr (H mu)']:.2f} | {m['entr (H pi)']:.2f} | "
                     f"{m['icepop band']:.2f} | {m['dppo tv']:.2f} |")
    if any("by_label" in r for r in report["rows"]):
        lines += ["", "## By the task's token label", "",
                  "| source | engine | label | tokens per 1k | positions at low H | rare at low H per 1k | "
                  "... crossing ENTR (H mu) per 1k |", "|---|---|---|---|---|---|---|"]
        for r in report["rows"]:
            for name, b in r.get("by_label", {}).items():
                lines.append(f"| {r['source']} | {r['engine']} | {name} | {b['tokens_per_1k']:.1f} | "
                             f"{b['low_h_share']:.3f} | {b['rare_low_h_per_1k']:.2f} | "
                             f"{b['rare_low_h_entr_per_1k']:.2f} |")
    if any(r.get("rare_low_h_tokens") for r in report["rows"]):
        lines += ["", f"## The tokens most often rare at low H (at most {TOP_TOKENS} a row)", "",
                  "| source | engine | token | per 1k | share crossing ENTR (H mu) |", "|---|---|---|---|---|"]
        for r in report["rows"]:
            for t in r.get("rare_low_h_tokens", []):
                shown = json.dumps(t.get("piece", "")).replace("|", "\\|")
                lines.append(f"| {r['source']} | {r['engine']} | {t['token_id']} {shown} | {t['per_1k']:.2f} | "
                             f"{t['entr_share']:.2f} |")
    for r in report["rows"]:
        lines += ["", f"## Tokens by H(mu) x mu(y): {r['source']}, {r['engine']}", "",
                  "Each cell: tokens per 1k response tokens / mean |delta| / share crossing ENTR's threshold.", "",
                  "| H(mu) \\ mu(y) | " + " | ".join(f"[{lo:g}, {min(hi, 1):g})" for lo, hi in zip(P_EDGES, P_EDGES[1:]))
                  + " |", "|---" * len(P_EDGES) + "|"]
        by_h: dict = {}
        for b in r["bins"]:
            by_h.setdefault(tuple(b["H"]), []).append(b)
        for (lo, hi), cells in by_h.items():
            lines.append(f"| [{lo:g}, {hi:g}) | " + " | ".join(
                f"{c['per_1k']:.2f} / {_fmt(c['mean_abs_delta'])} / {_fmt(c['entr_share'], '.2f')}" if c["tokens"]
                else "0" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the testbed's run config (task, sampling, tau, eps)")
    p.add_argument("--model", required=True, help="HF directory: the learner's weights")
    p.add_argument("--stale", default=None, help="HF directory: older weights the engine samples with (staleness)")
    p.add_argument("--engine", action="append", choices=list(ENGINES), default=None,
                   help=f"engine numerics (repeatable; default: all of {list(ENGINES)})")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--title", default="")
    p.add_argument("--out", default=None, help="directory for precondition.md / .json / rare_tokens.csv.gz")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    transformers.logging.disable_progress_bar()
    cfg = load_config(a.config, a.overrides)
    for d in [a.model] + ([a.stale] if a.stale else []):
        if not (Path(d) / "config.json").is_file():
            p.error(f"{d} is not an HF model directory (no config.json)")
    tokenizer = load_tokenizer(a.model)
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer, cfg.model.max_prompt_len)
    prompts, references = map(list, zip(*task.prompts("test", a.prompts, a.seed)))
    s = cfg.rollout.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            max_new_tokens=s.max_new_tokens, n=s.n, seed=a.seed)
    tau, eps = cfg.algorithm.tau, cfg.algorithm.entr_eps
    learner = load_causal_lm(a.model, dtype="float32", init="pretrained")
    engines = a.engine or list(ENGINES)
    pairs = [("numerics", e, a.model) for e in engines if e != "fp32"]
    if a.stale:
        pairs += [("staleness", "fp32", a.stale)] + [("both", e, a.stale) for e in engines if e != "fp32"]
    if not pairs:
        p.error("nothing to measure: give --stale, or an --engine other than fp32")
    rows = []
    for source, engine, weights in pairs:
        t0 = time.time()
        dtype, quantize, scale, act = ENGINES[engine]
        model = load_causal_lm(weights, dtype=dtype, init="pretrained")
        install_rounding(model, quantize, scale, act)
        samples = sample(model, prompts, params, batch=256)
        del model
        log_pi, h_pi = learner_logprobs(learner, samples, params.temperature)
        labels = response_labels(task, references, samples, params.n)
        row = {"source": source, "engine": engine, **measure(samples, log_pi, h_pi, tau, eps, labels)}
        for t in row["rare_low_h_tokens"]:
            t["piece"] = tokenizer.decode([t["token_id"]])
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"[precondition] {source:9s} {engine:16s} {row['response_tokens']:6d} tokens: rare at low H "
              f"{row['rare_low_h_per_1k']:.2f}/1k (ceiling {row['rare_low_h_ceiling_per_1k']:.2f}), crossing ENTR {row['rare_low_h_entr_per_1k']:.2f}/1k "
              f"({'holds' if row['holds'] else 'does not hold'}), |delta| p50 {_fmt(row['rare_low_h_abs_delta']['p50'])} "
              f"p90 {_fmt(row['rare_low_h_abs_delta']['p90'])} ({row['seconds']:.0f} s)", flush=True)
    setup = (f"{len(prompts)} held-out prompts x {params.n} samples at T = {params.temperature}, up to "
             f"{params.max_new_tokens} tokens; learner float32 (`{a.model}`)"
             + (f"; stale weights `{a.stale}`" if a.stale else "") + f"; tau {tau}, eps {eps}; "
             f"vocabulary {len(tokenizer)}. Command: `python tools/tail_precondition.py "
             + " ".join(sys.argv[1:] if argv is None else argv) + "`")
    report = {"title": a.title or cfg.task.name, "setup": setup, "rows": rows}
    print(markdown(report))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "precondition.md").write_text(markdown(report))
        with gzip.open(out / "rare_tokens.csv.gz", "wt", newline="") as f:
            w = csv.writer(f)
            w.writerow(["source", "engine", "token_id", "piece", "label", "log_mu", "h_mu", "log_pi", "h_pi"])
            for r in rows:
                for tid, label, *v in r["_rare_rows"]:
                    w.writerow([r["source"], r["engine"], tid, tokenizer.decode([tid]), label]
                               + [f"{x:.6g}" for x in v])
        clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        (out / "precondition.json").write_text(json.dumps({**report, "rows": clean}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

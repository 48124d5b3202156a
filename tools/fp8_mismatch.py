"""How far an FP8 or bf16 rollout engine's behaviour log-probs sit from the fp32 policy's, by entropy.

    python tools/fp8_mismatch.py --config examples/cpu_demo.yaml --model RUN_DIR/sft/model [--prompts 256]

For each engine variant (bf16; FP8 e4m3 weights per tensor, per output channel, per 128 x 128 block;
per channel with activations rounded too; an fp32 engine as the noise floor), responses are sampled
at the config's temperature from the variant, on the task's held-out prompts, by the engine's own
decoder (`rollout/decoder.BatchDecoder`: log mu and H(mu) per token, as the engine reports them);
each sequence is then scored by one full forward of the fp32 model. Printed per variant: the mean
|log mu - log pi_fp32| over sampled tokens, split by the engine's entropy H(mu) (< 0.1, 0.1-1, > 1 nat),
each bin's share of the tokens, among tokens with pi_fp32 < 0.1 (rare under the policy) the same
mean, and the mean over every position of the bin of |log mu(v) - log pi(v)| over the vocabulary's tail
(pi_fp32(v) < 1e-3, sampled or not; the engine's model scored by a full forward as well). Every variant samples with the same request seeds. `--json PATH` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
import transformers  # noqa: E402

from entr_megatron.config.loader import load_config  # noqa: E402
from entr_megatron.rollout.decoder import decode_all  # noqa: E402
from entr_megatron.rollout.engine import SamplingParams  # noqa: E402
from entr_megatron.rollout.hf_model import eos_token_ids, load_causal_lm  # noqa: E402
from entr_megatron.rollout.quantize import install_rounding  # noqa: E402
from entr_megatron.tasks import TASK_BUILDERS, default_tokenizer, load_tokenizer  # noqa: E402

VARIANTS = {  # name: (dtype, quantize, scale, activations)
    "fp32 (noise floor)": ("float32", "none", "per_channel", False),
    "bf16": ("bfloat16", "none", "per_channel", False),
    "fp8 per_tensor": ("float32", "fp8", "per_tensor", False),
    "fp8 per_channel": ("float32", "fp8", "per_channel", False),
    "fp8 block": ("float32", "fp8", "block", False),
    "fp8 per_channel + act": ("float32", "fp8", "per_channel", True),
    "fp8 per_channel, bf16": ("bfloat16", "fp8", "per_channel", False),
    "fp8 per_channel + act, bf16": ("bfloat16", "fp8", "per_channel", True),
    "fp8 block + act, bf16": ("bfloat16", "fp8", "block", True),
}
H_BINS = ((0.0, 0.1), (0.1, 1.0), (1.0, float("inf")))
RARE = 0.1
"""A sampled token is 'rare' when the fp32 policy gives it less than this probability."""
TAIL = 1e-3
"""Tail tokens of a position (sampled or not): pi_fp32 below this; their mean |log mu - log pi| per position."""


def sample(model, prompts, params: SamplingParams, batch: int):
    """Every sample of every prompt: (prompt ids, response ids, log mu, H(mu)) from the engine's decoder."""
    results = decode_all(model, prompts, params, batch, eos_token_ids(model))
    return [(r.prompt_ids, r.output_ids, r.logprobs, r.entropy) for r in results]


@torch.no_grad()
def response_logprobs(model, samples, temperature: float) -> torch.Tensor:
    """log softmax(z / T) over the vocabulary at every response position, [tokens, V] (one full
    forward per sequence; position j predicts response token j)."""
    out = []
    for prompt, resp, _, _ in samples:
        logits = model(input_ids=torch.tensor([prompt + resp])).logits[0].float()
        out.append((logits[len(prompt) - 1:len(prompt) + len(resp) - 1] / temperature).log_softmax(-1))
    return torch.cat(out).double()


def summarize(samples, ref_lp, engine_lp):
    """ref_lp, engine_lp: [tokens, V] log-probs of the fp32 model and of the engine's model."""
    mu = torch.tensor([v for s in samples for v in s[2]], dtype=torch.float64)
    h = torch.tensor([v for s in samples for v in s[3]], dtype=torch.float64)
    tokens = torch.tensor([t for s in samples for t in s[1]])
    pi = ref_lp.gather(1, tokens[:, None])[:, 0]
    d = (mu - pi).abs()
    tail = ref_lp < math.log(TAIL)
    tail_d = ((engine_lp - ref_lp).abs() * tail).sum(1) / tail.sum(1).clamp(min=1)
    rare = pi.exp() < RARE
    row = {"tokens": int(d.numel()), "mean_abs_delta": float(d.mean()), "bins": []}
    for lo, hi in H_BINS:
        m = (h >= lo) & (h < hi)
        row["bins"].append({
            "H": f"{lo}-{hi}", "share": float(m.double().mean()),
            "mean_abs_delta": float(d[m].mean()) if m.any() else float("nan"),
            "rare_share": float((m & rare).double().sum() / max(int(m.sum()), 1)),
            "rare_mean_abs_delta": float(d[m & rare].mean()) if (m & rare).any() else float("nan"),
            "tail_mean_abs_delta": float(tail_d[m].mean()) if m.any() else float("nan"),
        })
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True, help="HF directory of the policy (e.g. a run's sft/model)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: rollout.sampling.n)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), metavar="NAME",
                   help=f"engines to measure (default: all of {list(VARIANTS)})")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    transformers.logging.disable_progress_bar()
    transformers.logging.disable_progress_bar()
    cfg = load_config(a.config, a.overrides)
    tokenizer = load_tokenizer(a.model) if (Path(a.model) / "tokenizer.json").exists() \
        else default_tokenizer(cfg.task.name)
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer, cfg.model.max_prompt_len)
    prompts = [ids for ids, _ in task.prompts("test", a.prompts, a.seed)]
    s = cfg.rollout.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                            n=a.n or s.n, seed=a.seed)
    reference = load_causal_lm(a.model, dtype="float32", init="pretrained")
    variants = {k: v for k, v in VARIANTS.items() if not a.variants or k in a.variants}
    report = {}
    print(f"{len(prompts)} prompts x {params.n} samples, T={params.temperature}; |log mu - log pi_fp32| of sampled tokens")
    print(f"{'engine':24s} {'tokens':>7s} {'all':>8s} | " + " | ".join(
        f"H {lo:g}-{hi:g}: share  |d|  rare |d|(share)  tail |d|" for lo, hi in H_BINS))
    for name, (dtype, quantize, scale, act) in variants.items():
        t0 = time.time()
        model = load_causal_lm(a.model, dtype=dtype, init="pretrained")
        install_rounding(model, quantize, scale, act)
        samples = sample(model, prompts, params, batch=256)
        row = summarize(samples, response_logprobs(reference, samples, params.temperature),
                        response_logprobs(model, samples, params.temperature))
        row["seconds"] = round(time.time() - t0, 1)
        report[name] = row
        bins = " | ".join(f"{b['share']:.3f} {b['mean_abs_delta']:.2e} {b['rare_mean_abs_delta']:.2e}({b['rare_share']:.3f}) "
                          f"{b['tail_mean_abs_delta']:.2e}" for b in row["bins"])
        print(f"{name:24s} {row['tokens']:7d} {row['mean_abs_delta']:8.2e} | {bins}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

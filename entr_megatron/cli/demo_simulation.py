"""What `entr-megatron demo` runs (the command, its flags and what it shows: cli/demo.py): off-policy
tokens simulated with torch, the corrections `icepop` and `entr` applied to them, the table printed.

    run(build_parser().parse_args(["demo", "--tau", "1"]))   # what `entr-megatron demo --tau 1` does
"""

from __future__ import annotations

import math

import torch

from entr_megatron.algorithm import CORRECTIONS, CorrectionInputs, mismatch_metrics
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.parallel import vocab_parallel_logprobs_entropy

BIN_EDGES = (0.0, 0.01, 0.1, 1.0, 3.0, math.inf)
# The injected noise: a rare token, its behaviour log-prob off by up to +-0.6 nats
# (ratio 0.55..1.8, inside IcePop's [0.5, 5] band).
RARE_PROB = 3e-3
NOISE_LOG_ERROR = 0.6


def simulate(n_positions: int, vocab: int, sigma: float, noise_fraction: float, seed: int):
    """Returns (logprobs, entropy, behaviour_logprobs, is_noise), all [1, N]."""
    gen = torch.Generator().manual_seed(seed)
    # Log-uniform logit scales spread the entropies from ~0 to ~ln(vocab).
    scale = torch.exp(torch.empty(n_positions, 1).uniform_(math.log(0.2), math.log(30.0), generator=gen))
    z = torch.randn(n_positions, vocab, generator=gen) * scale
    mu_logp = torch.log_softmax(z, dim=-1)
    tokens = torch.multinomial(mu_logp.exp(), 1, generator=gen).squeeze(-1)
    learner_logits = z + sigma * torch.randn(n_positions, vocab, generator=gen)
    logprobs, entropy = vocab_parallel_logprobs_entropy(learner_logits, tokens)
    behaviour = mu_logp.gather(1, tokens.unsqueeze(1)).squeeze(1)

    # Noise: at low-entropy positions, a rare token (pi ~ 3e-3) whose behaviour
    # probability the engine's numerics got wrong by a factor within the IcePop band.
    low = torch.nonzero(entropy < 0.05).squeeze(-1)
    n_noise = min(len(low), max(1, int(noise_fraction * n_positions)))
    noisy = low[torch.randperm(len(low), generator=gen)[:n_noise]]
    learner_logp = torch.log_softmax(learner_logits[noisy], -1)
    rare_tok = (learner_logp - math.log(RARE_PROB)).abs().argmin(dim=-1)
    tokens[noisy] = rare_tok
    logprobs[noisy] = learner_logp.gather(1, rare_tok.unsqueeze(1)).squeeze(1)
    behaviour[noisy] = logprobs[noisy] - torch.empty(n_noise).uniform_(-NOISE_LOG_ERROR, NOISE_LOG_ERROR, generator=gen)
    is_noise = torch.zeros(n_positions, dtype=torch.bool)
    is_noise[noisy] = True
    return logprobs[None], entropy[None], behaviour[None], is_noise[None]


def run(args) -> None:
    logprobs, entropy, behaviour, is_noise = simulate(args.positions, args.vocab, args.sigma, args.noise, args.seed)
    valid = torch.ones_like(is_noise)
    cfg = AlgorithmConfig(tau=args.tau)
    kept = {name: CORRECTIONS[name](CorrectionInputs(logprobs, behaviour, entropy, valid), cfg).keep_mask_BT for name in ("icepop", "entr")}
    delta = (logprobs - behaviour).abs()

    print(f"{args.positions} tokens, vocab {args.vocab}, staleness sigma {args.sigma}, "
          f"{int(is_noise.sum())} noise tokens; ENTR tau={cfg.tau} eps={cfg.entr_eps}, IcePop band {cfg.icepop_band}")
    print()
    print(f"{'entropy bin (nats)':>20} {'tokens':>7} {'mean|delta|':>11} {'max|delta|':>10} "
          f"{'icepop masks':>12} {'entr masks':>10} {'noise':>6} {'noise masked i/e':>16}")
    for lo, hi in zip(BIN_EDGES[:-1], BIN_EDGES[1:]):
        sel = (entropy >= lo) & (entropy < hi)
        n = int(sel.sum())
        if n == 0:
            continue
        noise = sel & is_noise
        row = [f"[{lo:g}, {hi:g})", n, f"{delta[sel].mean():.3f}", f"{delta[sel].max():.3f}"]
        row += [f"{(~kept[k][sel]).float().mean():.1%}" for k in ("icepop", "entr")]
        row += [int(noise.sum()), f"{int((noise & ~kept['icepop']).sum())}/{int((noise & ~kept['entr']).sum())}"]
        print(f"{row[0]:>20} {row[1]:>7} {row[2]:>11} {row[3]:>10} {row[4]:>12} {row[5]:>10} {row[6]:>6} {row[7]:>16}")

    metrics = mismatch_metrics(logprobs, behaviour, entropy, valid, keep_mask_BT=kept["entr"])
    print()
    print("step metrics (entr): " + ", ".join(
        f"{k}={float(metrics[k]):.4f}" for k in ("mismatch/k1", "mismatch/k3", "mismatch/mean_abs_delta", "mask/fraction", "is/ess")
    ))
    caught = int((is_noise & ~kept["entr"]).sum()), int((is_noise & ~kept["icepop"]).sum())
    high = entropy >= 1.0
    print(f"noise tokens masked: entr {caught[0]}/{int(is_noise.sum())}, icepop {caught[1]}/{int(is_noise.sum())}; "
          f"high-entropy (H >= 1) tokens kept: entr {float(kept['entr'][high].float().mean()):.1%}, "
          f"icepop {float(kept['icepop'][high].float().mean()):.1%}")


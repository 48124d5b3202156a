"""`entr-megatron demo`: ENTR against a magnitude band on simulated off-policy tokens.

A self-contained look at the rule, in seconds on a CPU (no model, no training):

1. Positions with entropies from ~0 to ~6 nats: logits ``z`` of random scale.
2. The behaviour policy mu samples from ``z`` (the engine); the learner has moved
   since: ``pi = softmax(z + sigma * eta)`` (staleness, ENTR.md's derivation).
3. At a few low-entropy positions the engine sampled a rare token (learner
   probability ~3e-3) whose probability its numerics got wrong by up to a
   factor e^0.6 either way (noise: a ratio a magnitude band accepts).
4. Log-probs and entropy of pi come from the vocab-parallel op; the corrections
   `icepop` and `entr` judge the same tokens; the table shows, per entropy bin,
   how far tokens moved and what each one masks.

ENTR keeps the far-moving high-entropy tokens (exploration) and masks the noise;
the ratio band does the opposite.
"""

from __future__ import annotations

import argparse

from entr_megatron.config.algorithm import AlgorithmConfig

__all__ = ["add_parser"]


def run(args) -> None:
    """The demo: simulated tokens, both corrections, the table (cli/demo_simulation.py)."""
    from entr_megatron.cli.demo_simulation import run as simulate_and_show  # lazy: torch, only when the demo runs

    simulate_and_show(args)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="ENTR vs IcePop on simulated stale and noisy tokens (seconds, CPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", type=int, default=20000)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--sigma", type=float, default=0.6, help="std of the learner's logit drift since sampling")
    p.add_argument("--noise", type=float, default=0.01, help="fraction of positions with an injected noise token")
    p.add_argument("--tau", type=float, default=AlgorithmConfig.tau,
                   help=f"ENTR threshold (default: algorithm.tau's, {AlgorithmConfig.tau:g})")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)

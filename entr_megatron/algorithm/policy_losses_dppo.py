"""DPPO: a trust region on the divergence of the sampled token's probability, not on its ratio.

Divergence PPO ("Rethinking the trust region in LLM reinforcement learning", arXiv:2602.04879;
the authors' code: sail-sg/Stable-RL `compute_policy_loss_with_mask`; verl `core_algos.py`
loss modes `dppo_tv`, `dppo_kl`; prime-rl's default loss is its Binary-TV form). With
p = pi_theta(y), p_a = pi_anchor(y) of the sampled token y and r = p / p_a:

    Binary-TV   drop when A > 0 and p - p_a > delta_high,  or A <= 0 and p - p_a < -delta_low
    Binary-KL   D = KL(Bern(p_a) || Bern(p)), the divergence of "y / any other token";
                drop when A > 0, D > delta_high and p > p_a,  or A <= 0, D > delta_low and p < p_a
    loss        l = -w A sg[min(r, C)] log pi_theta          on the kept tokens, 0 on the dropped

so the gradient of a kept token is PPO's unclipped -w A r grad log pi (r truncated at C =
cfg.dppo_ratio_cap, 10 in the authors' code), and a dropped one has none. Unlike PPO-clip, a
low-probability token whose ratio is 2 but whose probability moved by 0.001 keeps its gradient;
a high-probability token that moved by more than delta is dropped even at a modest ratio.
A = 0 falls on the negative side (verl: `torch.where(advantages > 0, ...)`).

The anchor is the correction's: with `correction: none` it is mu, the authors' default mode
(`dppo_binary_tv`: the mask and the ratio against the rollout policy); with `correction: naive`
it is pi_old, verl's `dppo_*` losses (`old_log_prob`; the authors' `*_recompute` modes). The
thresholds are the clip widths (cfg.clip_range, verl's reuse of clip_ratio_low/high): TV 0.15,
KL 0.05 by default (the authors' verl example). Dropped tokens stay in the denominator (verl's
agg_loss over the response mask).
"""

from __future__ import annotations

import torch
from torch import Tensor

from entr_megatron.algorithm.corrections_divergence import bernoulli_kl
from entr_megatron.algorithm.masked_ops import clamp_log_ratio, masked_fraction, zero_padding
from entr_megatron.algorithm.policy_loss_base import LossInputs, PolicyLossOutput, prepare_loss_inputs, ratio_metrics
from entr_megatron.config.algorithm import AlgorithmConfig


def dppo_keep_mask(logprobs_BT: Tensor, anchor_BT: Tensor, advantages_BT: Tensor, delta_low: float,
                   delta_high: float, divergence: str) -> Tensor:
    """True where DPPO keeps a token (see the module docstring); `divergence` 'tv' or 'kl'.
    Detached, float64 probabilities (a difference of nearby probabilities in fp32 loses digits)."""
    log_p = logprobs_BT.detach().to(torch.float64)
    log_a = anchor_BT.detach().to(torch.float64)
    moved_BT = log_p.exp() - log_a.exp()
    positive_BT = advantages_BT > 0
    if divergence == "tv":
        return torch.where(positive_BT, moved_BT <= delta_high, moved_BT >= -delta_low)
    if divergence != "kl":
        raise ValueError(f"DPPO divergence {divergence!r} must be 'tv' or 'kl'")
    kl_BT = bernoulli_kl(log_a, log_p)  # KL(Bern(p_a) || Bern(p)), verl's binary_kl
    return torch.where(positive_BT, (kl_BT <= delta_high) | (moved_BT <= 0), (kl_BT <= delta_low) | (moved_BT >= 0))


def _dppo_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool, divergence: str, name: str) -> PolicyLossOutput:
    x = prepare_loss_inputs(inputs)
    log_ratio_BT = clamp_log_ratio(x.logprobs_BT - x.anchor_BT)
    ratio_BT = log_ratio_BT.exp()
    coefficient_BT = (x.weight_BT * ratio_BT.clamp(max=cfg.dppo_ratio_cap)).detach()
    if clip:
        delta_low, delta_high = cfg.clip_range(name)
        keep_BT = dppo_keep_mask(x.logprobs_BT, x.anchor_BT, x.advantages_BT, delta_low, delta_high, divergence)
    else:  # M2PO's mask replaces the trust region
        keep_BT = torch.ones_like(x.active_BT)
    keep_BT = keep_BT & x.active_BT
    loss_BT = zero_padding(-coefficient_BT * x.advantages_BT * x.logprobs_BT, keep_BT)
    positive_BT = x.advantages_BT > 0
    metrics = {
        f"{name}/mask_fraction": masked_fraction(~keep_BT, x.active_BT),
        # The sides on which the trust region cut a gradient, as PPO's clip fractions.
        "policy_loss/clip_frac_low": masked_fraction(~keep_BT & ~positive_BT, x.active_BT),
        "policy_loss/clip_frac_high": masked_fraction(~keep_BT & positive_BT, x.active_BT),
        **ratio_metrics(ratio_BT, x.active_BT),
    }
    return PolicyLossOutput(loss_BT, zero_padding(coefficient_BT, x.active_BT), metrics)


def dppo_tv_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """DPPO with the Binary-TV trust region: drop a token whose probability moved by more than delta
    in the direction its advantage pushes (module docstring). Metric `dppo_tv/mask_fraction`."""
    return _dppo_loss(inputs, cfg, clip, "tv", "dppo_tv")


def dppo_kl_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """DPPO with the Binary-KL trust region: drop a token whose Bernoulli KL from the anchor exceeds
    delta in the direction its advantage pushes (module docstring). Metric `dppo_kl/mask_fraction`."""
    return _dppo_loss(inputs, cfg, clip, "kl", "dppo_kl")

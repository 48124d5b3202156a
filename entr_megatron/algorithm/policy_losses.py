"""Per-token policy losses: fn(LossInputs(logprobs_BT, anchor_logprobs_BT, advantages_BT, weight_BT,
keep_mask_BT, response_mask_BT), cfg, clip=True) -> PolicyLossOutput(loss_BT, is_weight_BT, metrics).

loss_BT is 0 where a token is not kept or not valid, and the gradient flows through
`logprobs_BT` only (anchor, advantages and weights are treated as constants). The
ratio is r = exp(logprobs - anchor); the correction chose the anchor and weight, and
whether the trust-region clip applies (`clip=False`: M2PO, whose mask replaces it).
is_weight_BT is the detached factor on each token's grad log pi * A before clipping cuts
it: w r for PPO and REINFORCE, w clip(r) for CISPO, w s_i for GSPO; the effective sample
size is computed from it. Reduction to a scalar is aggregation.py's job.
"""

from __future__ import annotations

import math
import torch

from entr_megatron.algorithm.masked_ops import masked_fraction, masked_max, masked_mean, sequence_mean, zero_padding
from entr_megatron.algorithm.policy_loss_base import (
    LossInputs,
    PolicyLossFn,
    PolicyLossOutput,
    clip_fractions,
    clipped_surrogate,
    prepare_loss_inputs,
    ratio_metrics,
)
from entr_megatron.algorithm.policy_losses_dppo import dppo_kl_loss, dppo_tv_loss
from entr_megatron.algorithm.policy_losses_soft import sapo_loss, vespo_loss
from entr_megatron.config.algorithm import AlgorithmConfig


def ppo_clip_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """PPO-clip with asymmetric clip and dual clip (Schulman et al. 2017; DAPO's clip-higher):
    l = -w min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and for A < 0 at most -w c A
    (c = cfg.dual_clip_c, Ye et al. 2020; None disables). Defaults eps_low 0.2, eps_high 0.28.
    clip=False: the unclipped surrogate l = -w r A (no clip, no dual clip)."""
    x = prepare_loss_inputs(inputs)
    ratio_BT = x.ratio_BT
    is_weight_BT = zero_padding((x.weight_BT * ratio_BT).detach(), x.active_BT)
    if not clip:
        loss_BT = -ratio_BT * x.advantages_BT
        return PolicyLossOutput(zero_padding(x.weight_BT * loss_BT, x.active_BT), is_weight_BT,
                                ratio_metrics(ratio_BT, x.active_BT))
    eps_low, eps_high = cfg.clip_range("ppo_clip")
    loss_BT = clipped_surrogate(ratio_BT, x.advantages_BT, eps_low, eps_high)
    metrics = {**clip_fractions(ratio_BT, x, eps_low, eps_high), **ratio_metrics(ratio_BT, x.active_BT)}
    if cfg.dual_clip_c is not None:
        # A very large ratio on a negative advantage would otherwise give an unbounded loss.
        bound_BT = -cfg.dual_clip_c * x.advantages_BT
        dual_BT = (x.advantages_BT < 0) & (loss_BT > bound_BT)
        loss_BT = torch.where(dual_BT, bound_BT, loss_BT)
        metrics["policy_loss/dual_clip_frac"] = masked_fraction(dual_BT, x.active_BT)
    return PolicyLossOutput(zero_padding(x.weight_BT * loss_BT, x.active_BT), is_weight_BT, metrics)


def reinforce_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """Importance-weighted REINFORCE: l = -sg[w r] A log pi, gradient -w r A grad log pi.
    Never clipped (cfg's clip range and `clip` are unused)."""
    x = prepare_loss_inputs(inputs)
    ratio_BT = x.ratio_BT
    coefficient_BT = (x.weight_BT * ratio_BT).detach()
    loss_BT = -coefficient_BT * x.advantages_BT * x.logprobs_BT
    return PolicyLossOutput(zero_padding(loss_BT, x.active_BT), zero_padding(coefficient_BT, x.active_BT),
                            ratio_metrics(ratio_BT, x.active_BT))


def cispo_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585): l = -sg[w clip(r, 1 - eps_low, 1 + eps_high)] A log pi.

    Clipping truncates the weight but never cuts a token's gradient. Defaults
    (CLIP_RANGE_DEFAULTS["cispo"]): eps_low = 1.0, i.e. lower bound 0 (no lower clip, as
    in the paper), eps_high = 0.28. The clip fractions count truncated tokens.
    clip=False: the weight is w r, untruncated."""
    x = prepare_loss_inputs(inputs)
    eps_low, eps_high = cfg.clip_range("cispo") if clip else (1.0, math.inf)
    ratio_BT = x.ratio_BT
    coefficient_BT = (x.weight_BT * ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)).detach()
    loss_BT = -coefficient_BT * x.advantages_BT * x.logprobs_BT
    metrics = {
        "policy_loss/clip_frac_low": masked_fraction(ratio_BT < 1.0 - eps_low, x.active_BT),
        "policy_loss/clip_frac_high": masked_fraction(ratio_BT > 1.0 + eps_high, x.active_BT),
        **ratio_metrics(ratio_BT, x.active_BT),
    }
    return PolicyLossOutput(zero_padding(loss_BT, x.active_BT), zero_padding(coefficient_BT, x.active_BT), metrics)


def gspo_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """GSPO (arXiv:2507.18071, token form GSPO-token): s_i = exp(mean_t (log pi - anchor)) over the sequence's kept
    tokens, s_it = sg[s_i] exp(log pi_t - sg[log pi_t]) (value s_i, gradient s_i grad log pi_t),
    l = -w min(s_it A, clip(s_it, 1 - eps_low, 1 + eps_high) A).

    Tokens masked by the correction are left out of s_i: a masked token's extreme delta
    would otherwise clip its whole sequence. Defaults (CLIP_RANGE_DEFAULTS["gspo"]):
    eps_low 3e-4, eps_high 4e-4, the GSPO paper's values for a sequence ratio. The paper
    averages per sequence (1/G sum_i 1/|y_i| sum_t): its default aggregation is
    seq-mean-token-mean (DEFAULT_LOSS_AGG_MODES). clip=False: l = -w s_it A."""
    x = prepare_loss_inputs(inputs)
    eps_low, eps_high = cfg.clip_range("gspo") if clip else (1.0, math.inf)
    seq_ratio_B = sequence_mean(x.logprobs_BT - x.anchor_BT, x.active_BT).detach().exp()
    ratio_BT = seq_ratio_B.unsqueeze(-1) * torch.exp(x.logprobs_BT - x.logprobs_BT.detach())
    loss_BT = clipped_surrogate(ratio_BT, x.advantages_BT, eps_low, eps_high)
    nonempty_B = x.active_BT.any(dim=-1)
    metrics = {
        **clip_fractions(ratio_BT.detach(), x, eps_low, eps_high),
        "policy_loss/seq_ratio_mean": masked_mean(seq_ratio_B, nonempty_B),
        "policy_loss/seq_ratio_max": masked_max(seq_ratio_B, nonempty_B),
    }
    is_weight_BT = zero_padding((x.weight_BT * ratio_BT).detach(), x.active_BT)
    return PolicyLossOutput(zero_padding(x.weight_BT * loss_BT, x.active_BT), is_weight_BT, metrics)


def nll_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """Supervised negative log-likelihood l = -log pi on active tokens, for SFT warm-up
    (run with correction "none"). Anchor, advantages, weight and the clip range are
    unused; the gradient is -1 on each active token's log-prob before aggregation."""
    x = prepare_loss_inputs(inputs)
    # Inactive tokens hold the anchor's value (no gradient); zero_padding drops them.
    loss_BT = zero_padding(-x.logprobs_BT, x.active_BT)
    ones_BT = zero_padding(torch.ones_like(loss_BT.detach()), x.active_BT)
    return PolicyLossOutput(loss_BT, ones_BT, {"policy_loss/nll_mean": masked_mean(loss_BT.detach(), x.active_BT)})


# Keys equal entr_megatron.config.algorithm.POLICY_LOSS_NAMES.
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip_loss,
    "reinforce": reinforce_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    "nll": nll_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "sapo": sapo_loss,
    "vespo": vespo_loss,
}

"""Baselines that mask by a divergence rather than a ratio band: kpop and m2po.

kpop judges pi_old against mu and runs AReaL's decoupled PPO against pi_old (weight
pi_old / mu); m2po judges the CURRENT policy against mu, recomputed every mini-batch,
and replaces PPO's clip by its mask. In 'mask_only' mode both keep only their rule,
judged on pi_theta / mu, on clipped PPO against mu.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from entr_megatron.algorithm.correction_base import (
    CorrectionInputs,
    CorrectionOutput,
    baseline_anchor,
    finish,
    judged_log_rho,
    prepare_inputs,
    published,
)
from entr_megatron.algorithm.masked_ops import masked_mean
from entr_megatron.config.algorithm import AlgorithmConfig

# Log-probs are clamped into [LOGPROB_FLOOR, LOGPROB_CEIL] before the Bernoulli KL:
# the ceiling keeps log(1 - p) finite when p rounds to 1 (a certain token), the
# floor keeps q * log q at 0 instead of 0 * -inf = NaN for a -inf log-prob.
LOGPROB_CEIL = -1e-12
LOGPROB_FLOOR = -1e4


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012): expm1 near 0,
    log1p for very negative x."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def bernoulli_kl(log_q: Tensor, log_p: Tensor) -> Tensor:
    """KL(q || p) between Bernoulli(q) and Bernoulli(p) given log q and log p:
    q log(q / p) + (1 - q) log((1 - q) / (1 - p)). Float64, >= 0."""
    log_q = log_q.to(torch.float64).clamp(LOGPROB_FLOOR, LOGPROB_CEIL)
    log_p = log_p.to(torch.float64).clamp(LOGPROB_FLOOR, LOGPROB_CEIL)
    log_not_q, log_not_p = log1mexp(log_q), log1mexp(log_p)
    kl = log_q.exp() * (log_q - log_p) + log_not_q.exp() * (log_not_q - log_not_p)
    return kl.clamp(min=0.0)  # rounding can leave -1e-17 where q == p


def kpop_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """KPop ("Taming training-inference mismatch in RL with adaptive masking regions", Ant
    Group / NUS 2026; AReaL's rejection_sampling metric 'binary_kl'): each policy's
    probability of the sampled token y is a Bernoulli ("y" / "any other token"); a token is
    dropped when max(D(p || q), D(q || p)) > cfg.kpop_threshold, p = pi_old(y), q = mu(y).
    Kept tokens carry AReaL's decoupled weight pi_old / mu on PPO against pi_old; dropped
    ones stay in the denominator. Unlike a ratio band the divergence is small for a large
    ratio on a tiny probability (both policies agree y is unlikely) and large for a moderate
    ratio near p = 1. The post's full objective was not available to us: this follows
    AReaL's implementation.
    """
    x = prepare_inputs(inputs)
    judged_BT = x.behaviour_BT + judged_log_rho(x, cfg)  # log pi_old (published) or log pi_theta
    kl_BT = torch.maximum(bernoulli_kl(judged_BT, x.behaviour_BT), bernoulli_kl(x.behaviour_BT, judged_BT))
    keep_BT = kl_BT <= cfg.kpop_threshold
    log_rho_BT = torch.where(keep_BT, judged_log_rho(x, cfg), torch.zeros_like(kl_BT))
    weight_BT = log_rho_BT.exp() if published(cfg) else torch.ones_like(log_rho_BT)
    metrics = {"kpop/kl_mean": masked_mean(kl_BT, x.valid_BT)}
    return finish("kpop", x, cfg, weight_BT, keep_BT, baseline_anchor(x, cfg), metrics)


def m2po_keep_mask(sq_delta_BT: Tensor, valid_BT: Tensor, threshold: float) -> Tensor:
    """Keep the most valid tokens, smallest sq_delta first, whose mean sq_delta <= threshold.

    Equivalent to dropping the largest values one by one until the rest has mean
    <= threshold (the M2PO paper's Algorithm 1). Sorting ascending makes the prefix means
    non-decreasing, so the kept set is the longest prefix whose mean is within the
    threshold. The sort is stable over the row-major token order, so among equal values
    the earlier token is kept first.
    """
    flat_sq = torch.where(valid_BT, sq_delta_BT, torch.full_like(sq_delta_BT, torch.inf)).flatten()
    sorted_sq, order = torch.sort(flat_sq.to(torch.float64), stable=True)
    positions = torch.arange(1, flat_sq.numel() + 1, dtype=torch.float64, device=flat_sq.device)
    prefix_mean = sorted_sq.cumsum(0) / positions  # padding sorts last as +inf: never kept
    within = prefix_mean <= threshold
    # Rounding in cumsum could break monotonicity by an ulp; force a prefix.
    within_prefix = within.to(torch.int8).cummin(0).values.bool()
    keep_flat = torch.zeros_like(within_prefix).scatter(0, order, within_prefix)
    return keep_flat.view_as(valid_BT) & valid_BT


def m2po_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """M2PO (Zheng et al. 2025, "Prosperity before collapse: how far can off-policy RL reach
    with stale data on LLMs?"): M2 = mean (log pi_theta / mu)^2 over the valid tokens of this
    call (one micro-batch: the learner packs whole sequences); the largest are dropped until
    the kept tokens' M2 <= cfg.m2po_threshold (tau = 0.04). The objective is the UNCLIPPED
    surrogate (1 / sum |o_i|) sum M_t r_t A on the kept tokens, r = pi_theta / mu, all
    response tokens in the denominator. mask_only: the same mask on clipped PPO against mu."""
    x = prepare_inputs(inputs, use_old=False)
    sq_BT = x.delta_BT.square()
    keep_BT = m2po_keep_mask(sq_BT, x.valid_BT, cfg.m2po_threshold)
    metrics = {"m2po/kept_mean_sq_log_ratio": masked_mean(sq_BT, keep_BT)}
    return finish("m2po", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT, metrics,
                  clip=not published(cfg))

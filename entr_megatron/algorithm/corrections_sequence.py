"""Corrections of the 2026 frameworks: whole sequences masked (OPSM, TRM) and an approximated proximal
policy (A-3PO).

| name | rule | weight | PPO anchor | denominator | source |
|------|------|--------|------------|-------------|--------|
| opsm | drop sequence i when A_i < 0 and mean_t log(mu / pi_theta) > delta | 1 | pi_old | all tokens | DeepSeek-V3.2 (arXiv:2512.02556); TRL `get_off_policy_mask`, slime `compute_opsm_mask` |
| trm  | drop sequence i when max_t (or mean_t) k3(rho_t) > threshold, k3(rho) = rho - 1 - log rho, rho = pi_old / mu | 1 | pi_old | kept tokens | TRM (arXiv:2512.23075); verl rollout_rs `seq_max_k3` / `seq_mean_k3` |
| a3po | log pi_prox = log mu + alpha (log pi_theta - log mu), alpha = (v_theta - 1 - v_mu) / (v_theta - v_mu) in [0, 1]; drop pi_prox / mu > cap | pi_prox / mu | pi_prox | all tokens | A-3PO (arXiv:2512.06547); AReaL `prox_logp_method: loglinear` |

In 'mask_only' mode each keeps only its rule judged on pi_theta / mu, weight 1, PPO against mu.
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
from entr_megatron.algorithm.masked_ops import clamp_log_ratio, masked_fraction, masked_max, masked_mean, sequence_mean
from entr_megatron.config.algorithm import AlgorithmConfig


def _sequence_drop(name: str, x, drop_B: Tensor, stat_B: Tensor) -> dict[str, Tensor]:
    """The share of (non-empty) sequences dropped and the mean of the statistic judged."""
    nonempty_B = x.valid_BT.any(dim=-1)
    return {f"{name}/seq_mask_fraction": masked_fraction(drop_B, nonempty_B),
            f"{name}/seq_stat_mean": masked_mean(stat_B, nonempty_B)}


def opsm_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556): a sequence whose advantage is
    negative and whose mean log(mu / pi_theta) over its tokens exceeds delta (cfg.opsm_threshold,
    strictly greater) is dropped whole; every other token is kept with weight 1. The statistic
    compares the CURRENT policy with the sampling policy, recomputed every mini-batch, so it sees
    both staleness and engine mismatch (TRL's `get_off_policy_mask`, with sampling log-probs).
    As TRL and slime apply it, the mask multiplies PPO-clip against pi_old and the dropped
    sequences stay in the denominator. Needs `advantages_BT`."""
    x = prepare_inputs(inputs)
    if inputs.advantages_BT is None:
        raise ValueError("correction 'opsm' needs the advantages (CorrectionInputs.advantages_BT)")
    seq_log_mu_over_pi_B = sequence_mean(-x.delta_BT, x.valid_BT)
    negative_B = (torch.where(x.valid_BT, inputs.advantages_BT.to(x.delta_BT.dtype), 0.0).sum(-1) < 0)
    drop_B = negative_B & (seq_log_mu_over_pi_B > cfg.opsm_threshold)
    keep_BT = ~drop_B.unsqueeze(-1) & x.valid_BT
    metrics = _sequence_drop("opsm", x, drop_B, seq_log_mu_over_pi_B)
    return finish("opsm", x, cfg, torch.ones_like(x.delta_BT), keep_BT, baseline_anchor(x, cfg), metrics)


def k3(log_rho_BT: Tensor) -> Tensor:
    """k3 = rho - 1 - log rho >= 0 (Schulman's estimator; E_mu[k3] = KL(mu || pi) for rho = pi / mu)."""
    log_rho_BT = clamp_log_ratio(log_rho_BT)  # TRM, as verl: no overflow
    return torch.expm1(log_rho_BT) - log_rho_BT


def trm_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Trust-region masking (arXiv:2512.23075; verl's rollout rejection `seq_max_k3`, `seq_mean_k3`):
    a sequence is rejected whole when the max (cfg.trm_statistic 'max', the paper's "any token
    outside the trust region") or the mean of its per-token k3(pi_old / mu) exceeds
    cfg.trm_threshold. A divergence, not a ratio band: k3 grows slowly for rho < 1 and fast for
    rho > 1 (k3(0.5) = 0.19, k3(2) = 0.31). Rejected sequences leave the denominator (verl
    multiplies the response mask by the rejection mask). PPO against pi_old, weight 1."""
    x = prepare_inputs(inputs)
    k3_BT = torch.where(x.valid_BT, k3(judged_log_rho(x, cfg)), torch.zeros_like(x.delta_BT))
    if cfg.trm_statistic == "max":
        stat_B = torch.where(x.valid_BT, k3_BT, torch.full_like(k3_BT, -math.inf)).amax(dim=-1).clamp(min=0)
    else:
        stat_B = sequence_mean(k3_BT, x.valid_BT)
    drop_B = stat_B > cfg.trm_threshold
    keep_BT = ~drop_B.unsqueeze(-1) & x.valid_BT
    metrics = {**_sequence_drop("trm", x, drop_B, stat_B), "trm/k3_max": masked_max(k3_BT, x.valid_BT)}
    return finish("trm", x, cfg, torch.ones_like(x.delta_BT), keep_BT, baseline_anchor(x, cfg), metrics)


def a3po_alpha(versions_BT: Tensor, policy_version: int) -> Tensor:
    """A-3PO's interpolation weight per token: alpha = (v_prox - v_mu) / (v_theta - v_mu) with
    v_prox = v_theta - 1 (the policy one update before the current one), clamped to [0, 1];
    0 where v_theta <= v_mu (an on-policy token: pi_prox = mu) or the version is unknown (< 0)."""
    v_mu = versions_BT.to(torch.float64)
    diff = policy_version - v_mu
    alpha = torch.where((diff > 0) & (v_mu >= 0), (diff - 1.0) / diff.clamp(min=1.0), torch.zeros_like(v_mu))
    return alpha.clamp(0.0, 1.0)


def a3po_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """A-3PO (arXiv:2512.06547; AReaL `prox_logp_method: loglinear`): decoupled PPO whose proximal
    policy is not recomputed by a forward pass but interpolated in log space between the behaviour
    policy and the current one by version,

        log pi_prox = log mu + alpha (sg[log pi_theta] - log mu),  alpha = a3po_alpha(v_mu, v_theta)

    then as AReaL's decoupled loss: PPO-clip against pi_prox (ratio pi_theta / pi_prox), behaviour
    weight pi_prox / mu, tokens whose weight exceeds cfg.decoupled_cap dropped (AReaL's suggested
    rejection {token, mask, ratio, upper 5}) or clamped (decoupled_cap_mode), all tokens in the
    denominator. A one-step-old token (alpha = 0) has pi_prox = mu. Needs per-token versions and
    the version being trained."""
    if inputs.versions_BT is None or inputs.policy_version is None:
        raise ValueError("correction 'a3po' needs each token's policy version and the version being trained "
                         "(CorrectionInputs.versions_BT, policy_version): the learner passes them from the batch")
    x = prepare_inputs(inputs, use_old=False)
    alpha_BT = a3po_alpha(inputs.versions_BT, inputs.policy_version).to(x.delta_BT.dtype)
    prox_BT = x.behaviour_BT + alpha_BT * x.delta_BT
    log_w_BT = prox_BT - x.behaviour_BT if published(cfg) else x.delta_BT
    weight_BT = log_w_BT.exp() if published(cfg) else torch.ones_like(log_w_BT)
    keep_BT = x.valid_BT
    if cfg.decoupled_cap_mode == "clamp" and published(cfg):
        weight_BT = weight_BT.clamp(max=cfg.decoupled_cap)
    else:
        keep_BT = keep_BT & (log_w_BT <= math.log(cfg.decoupled_cap))
    anchor_BT = prox_BT if published(cfg) else x.behaviour_BT
    metrics = {"a3po/alpha_mean": masked_mean(alpha_BT, x.valid_BT)}
    return finish("a3po", x, cfg, weight_BT, keep_BT, anchor_BT, metrics)

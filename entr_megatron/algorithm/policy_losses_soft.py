"""Policy losses that replace the hard clip by a smooth weight: SAPO (token gate), VESPO (sequence weight).

SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347; verl `core_algos.py` loss 'sapo',
AReaL `sapo_loss_fn`, TRL's 'sapo'): the clipped surrogate becomes

    l = -w f(r) A,   f(r) = sigmoid(tau (r - 1)) 4 / tau,   tau = tau_pos (A > 0) or tau_neg (A <= 0)

with r = pi_theta / anchor NOT detached: the gradient is -w A f'(r) r grad log pi, with f'(1) = 1
(on-policy it is the plain policy gradient) and f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)),
fading smoothly as r leaves 1 instead of dropping to 0 at a clip edge. tau_neg > tau_pos fades
negative-advantage tokens faster (1.0 and 1.05 in all three frameworks). The paper averages per
sequence (GRPO's 1/G sum_i 1/|y_i| sum_t): seq-mean-token-mean, as verl forces.

VESPO (arXiv:2602.10693; TRL's loss_type 'vespo', the authors' verl recipe
`recipe/vespo/code/core_algos.py`): one weight per sequence from its importance ratio

    w_i = prod_t r_it (log w_i = sum_t clamp(log r_it, -20, 20), then clamped to [-20, 20])
    phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w),   phi(1) = 1
    l = -sg[phi(w_i)] A log pi_theta,   (k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0

phi is a gamma-shaped weight peaking at w = k / lambda and vanishing for w -> 0 and w -> inf,
so a sequence far off-policy in either direction loses its gradient without a clip. The ratio
is against the correction's anchor: `correction: none` gives the paper's pi_theta / mu (TRL
multiplies pi_theta / pi_old by its vLLM IS ratio pi_old / mu, the same product); tokens a
correction drops are left out of the product. token-mean over all tokens (TRL, the authors).
"""

from __future__ import annotations

import torch

from entr_megatron.algorithm.masked_ops import clamp_log_ratio, masked_max, masked_mean, sequence_sum, zero_padding
from entr_megatron.algorithm.policy_loss_base import LossInputs, PolicyLossOutput, prepare_loss_inputs, ratio_metrics
from entr_megatron.config.algorithm import AlgorithmConfig


def sapo_gate(ratio_BT: torch.Tensor, tau_BT: torch.Tensor) -> torch.Tensor:
    """SAPO's soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau (f(1) = 2 / tau, f'(1) = 1)."""
    return torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)


def sapo_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """SAPO: l = -w f(r) A with the soft gate f (module docstring). `clip=False` (M2PO's mask in
    place of the trust region): l = -w r A."""
    x = prepare_loss_inputs(inputs)
    ratio_BT = clamp_log_ratio(x.logprobs_BT - x.anchor_BT).exp()
    if not clip:
        loss_BT = -x.weight_BT * ratio_BT * x.advantages_BT
        return PolicyLossOutput(zero_padding(loss_BT, x.active_BT),
                                zero_padding((x.weight_BT * ratio_BT).detach(), x.active_BT),
                                ratio_metrics(ratio_BT, x.active_BT))
    tau_BT = torch.where(x.advantages_BT > 0, torch.full_like(ratio_BT, cfg.sapo_tau_pos),
                         torch.full_like(ratio_BT, cfg.sapo_tau_neg))
    loss_BT = -x.weight_BT * sapo_gate(ratio_BT, tau_BT) * x.advantages_BT
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)).detach()
    slope_BT = 4.0 * gate_BT * (1.0 - gate_BT)  # f'(r): the weight the gate leaves on the gradient
    is_weight_BT = zero_padding((x.weight_BT * slope_BT * ratio_BT).detach(), x.active_BT)
    metrics = {"sapo/gate_slope_mean": masked_mean(slope_BT, x.active_BT), **ratio_metrics(ratio_BT, x.active_BT)}
    return PolicyLossOutput(zero_padding(loss_BT, x.active_BT), is_weight_BT, metrics)


def vespo_loss(inputs: LossInputs, cfg: AlgorithmConfig, clip: bool = True) -> PolicyLossOutput:
    """VESPO: l = -sg[phi(w_i)] A log pi with the sequence weight phi (module docstring). The
    weight is its own trust region: `clip` is unused."""
    x = prepare_loss_inputs(inputs)
    log_ratio_BT = clamp_log_ratio((x.logprobs_BT - x.anchor_BT).detach())
    log_w_B = clamp_log_ratio(sequence_sum(log_ratio_BT, x.active_BT))
    nonempty_B = x.active_BT.any(dim=-1)
    # The sign of a sequence's advantage (every token of it carries the same one).
    positive_B = torch.where(x.active_BT, x.advantages_BT, torch.zeros_like(x.advantages_BT)).sum(-1) >= 0
    k_pos, k_neg = cfg.vespo_k
    lam_pos, lam_neg = cfg.vespo_lambda
    k_B = torch.where(positive_B, torch.full_like(log_w_B, k_pos), torch.full_like(log_w_B, k_neg))
    lam_B = torch.where(positive_B, torch.full_like(log_w_B, lam_pos), torch.full_like(log_w_B, lam_neg))
    phi_B = torch.exp(lam_B + k_B * log_w_B - lam_B * log_w_B.exp())
    coefficient_BT = zero_padding((x.weight_BT * phi_B.unsqueeze(-1)).detach(), x.active_BT)
    loss_BT = -coefficient_BT * x.advantages_BT * x.logprobs_BT
    metrics = {
        "vespo/phi_mean": masked_mean(phi_B, nonempty_B),
        "vespo/phi_max": masked_max(phi_B, nonempty_B),
        "policy_loss/seq_ratio_mean": masked_mean(log_w_B.exp(), nonempty_B),
        "policy_loss/seq_ratio_max": masked_max(log_w_B.exp(), nonempty_B),
    }
    return PolicyLossOutput(zero_padding(loss_BT, x.active_BT), coefficient_BT, metrics)

"""ENTR and its two variants as corrections (docs/ENTR.md).

All three compare the learner directly with the behaviour policy,
delta = log pi_theta - log mu; a recomputed old policy is not needed and is ignored.
"""

from __future__ import annotations

import torch

from entr_megatron.algorithm.correction_base import CorrectionInputs, CorrectionOutput, finish, prepare_inputs
from entr_megatron.algorithm.entr import (
    calibrated_score,
    calibrated_sigma2,
    collision_upper_bound,
    entr_mask,
    entr_score,
)
from entr_megatron.algorithm.masked_ops import float_detached, masked_fraction, masked_mean
from entr_megatron.config.algorithm import AlgorithmConfig


def entr_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """ENTR: keep tokens with delta^2 / (H + eps) <= tau; weight 1; PPO ratio against mu."""
    x = prepare_inputs(inputs, use_old=False)
    keep_BT = entr_mask(x.delta_BT, x.entropy_BT, cfg.tau, cfg.entr_eps)
    score_BT = entr_score(x.delta_BT, x.entropy_BT, cfg.entr_eps)
    metrics = {"entr/score_mean": masked_mean(score_BT, x.valid_BT)}
    return finish("entr", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT, metrics)


def entr_calibrated_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Self-calibrated ENTR: S = delta^2 / (sigma2_hat (G + eps)), keep S <= z^2.

    G = 1 - sum_j p_j^2 from `inputs.collision_BT` when given; otherwise 1 - exp(-H), an upper
    bound of it (see entr.collision_upper_bound), which admits slightly more.
    sigma2_hat = median_valid(delta^2 / (G + eps)) / CHI2_1_MEDIAN, per call (micro-batch).
    """
    x = prepare_inputs(inputs, use_old=False)
    if inputs.collision_BT is None:
        collision = collision_upper_bound(x.entropy_BT)
    else:
        collision = float_detached(inputs.collision_BT).to(x.delta_BT.dtype)
    collision = collision.clamp(0.0, 1.0)
    sigma2 = calibrated_sigma2(x.delta_BT, collision, x.valid_BT, cfg.entr_eps, cfg.calibrated_min_sigma2)
    score_BT = calibrated_score(x.delta_BT, collision, sigma2, cfg.entr_eps)
    keep_BT = score_BT <= cfg.calibrated_z**2
    metrics = {
        "entr_calibrated/sigma2_hat": sigma2,
        "entr_calibrated/score_mean": masked_mean(score_BT, x.valid_BT),
    }
    return finish("entr_calibrated", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT, metrics)


def entr_soft_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Soft ENTR: w = exp(clamp(delta, -b, b)), b = sqrt(tau (H + eps)); hard-mask only
    |delta| > soft_mask_multiple * b.

    The anchor is the detached current log-prob, so the policy ratio is 1 in value and
    carries the gradient of log pi: the (entropy-clamped) weight replaces pi / mu.
    """
    x = prepare_inputs(inputs, use_old=False)
    bound_BT = (cfg.tau * (x.entropy_BT.clamp(min=0) + cfg.entr_eps)).sqrt()
    weight_BT = torch.clamp(x.delta_BT, min=-bound_BT, max=bound_BT).exp()
    keep_BT = x.delta_BT.abs() <= cfg.soft_mask_multiple * bound_BT
    metrics = {"entr_soft/clamp_fraction": masked_fraction(x.delta_BT.abs() > bound_BT, x.valid_BT)}
    return finish("entr_soft", x, cfg, weight_BT, keep_BT, x.logprobs_BT, metrics)

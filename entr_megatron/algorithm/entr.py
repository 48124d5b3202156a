"""The ENTR rule: judge a token's off-policy log-ratio against the entropy of its position.

    S_t = delta_t^2 / (H_t + eps),   keep the token when S_t <= tau

(docs: docs/ENTR.md). Plus the pieces of the self-calibrated variant, which
replaces H by the first-order scale G = 1 - sum_j p_j^2 and tau by a batch
estimate of the perturbation variance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from entr_megatron.algorithm.masked_ops import float_detached
from entr_megatron.config.algorithm import AlgorithmConfig

# One source for each default: the config's (a test checks every CLI flag offering them agrees).
ENTR_DEFAULT_TAU: float = AlgorithmConfig.tau
ENTR_DEFAULT_EPS: float = AlgorithmConfig.entr_eps  # the paper's entropy floor

# Median of a chi-square variable with one degree of freedom (= Phi^-1(3/4)^2).
# If delta ~ N(0, sigma^2 G) then delta^2 / G ~ sigma^2 chi2_1, so
# median(delta^2 / G) / CHI2_1_MEDIAN estimates sigma^2 robustly: the masked outliers
# are a minority and do not move the median.
CHI2_1_MEDIAN = 0.45493642311957283


def entr_score(log_ratio: Tensor, entropy: Tensor, eps: float = ENTR_DEFAULT_EPS) -> Tensor:
    """ENTR score S = log_ratio^2 / (entropy + eps), elementwise, any shape.

    Computed on detached values in at least float32 (bf16 inputs are upcast).
    Slightly negative entropies (rounding in a vocab-parallel reduction) are read as 0.
    """
    if eps <= 0:
        raise ValueError(f"entr eps={eps!r} must be > 0 (it keeps S finite where H = 0)")
    delta = float_detached(log_ratio)
    entropy_f = float_detached(entropy)
    dtype = torch.promote_types(delta.dtype, entropy_f.dtype)
    return delta.to(dtype).square() / (entropy_f.to(dtype).clamp(min=0) + eps)


def entr_mask(log_ratio: Tensor, entropy: Tensor, tau: float, eps: float = ENTR_DEFAULT_EPS) -> Tensor:
    """Bool tensor, True where a token is kept: log_ratio^2 / (entropy + eps) <= tau.

    Equivalently |log_ratio| <= sqrt(tau * (entropy + eps)); the boundary is kept.
    Elementwise on any shape; detached; at least float32.
    """
    if tau <= 0:
        raise ValueError(f"entr tau={tau!r} must be > 0")
    return entr_score(log_ratio, entropy, eps) <= tau


def collision_upper_bound(entropy: Tensor) -> Tensor:
    """1 - exp(-H), used for G = 1 - sum_j p_j^2 when the learner did not compute it.

    It is an upper bound: by Jensen, log sum_j p_j^2 >= sum_j p_j log p_j = -H, so
    sum_j p_j^2 >= exp(-H). Detached, at least float32.
    """
    return -torch.expm1(-float_detached(entropy).clamp(min=0))


def calibrated_sigma2(
    log_ratio_BT: Tensor, collision_BT: Tensor, response_mask_BT: Tensor, eps: float, min_sigma2: float
) -> Tensor:
    """Batch estimate of the logit-perturbation variance sigma^2 (scalar, detached):

        sigma2_hat = median over valid tokens of delta^2 / (G + eps), divided by CHI2_1_MEDIAN

    torch.median gives the lower of the two middle values for an even count. Clamped
    below by `min_sigma2` (also the value for a batch without valid tokens).
    """
    scaled_BT = entr_score(log_ratio_BT, collision_BT, eps)
    valid_values = scaled_BT[response_mask_BT]
    if valid_values.numel() == 0:
        return scaled_BT.new_tensor(min_sigma2)
    return (valid_values.median() / CHI2_1_MEDIAN).clamp(min=min_sigma2)


def calibrated_score(
    log_ratio_BT: Tensor, collision_BT: Tensor, sigma2: Tensor, eps: float = ENTR_DEFAULT_EPS
) -> Tensor:
    """Self-calibrated ENTR score S = delta^2 / (sigma2 * (G + eps)); keep S <= z^2."""
    return entr_score(log_ratio_BT, collision_BT, eps) / sigma2

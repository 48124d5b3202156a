"""What every per-token policy loss shares: its inputs, its output, and their preparation.

The interface (see policy_losses.py for the losses themselves):

    fn(LossInputs(logprobs_BT, anchor_logprobs_BT, advantages_BT, weight_BT, keep_mask_BT, response_mask_BT),
       cfg, clip=True) -> PolicyLossOutput(loss_BT, is_weight_BT, metrics)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from entr_megatron.algorithm.masked_ops import masked_fraction, masked_max, masked_mean, zero_padding

class LossInputs(NamedTuple):
    """What a policy loss sees of one micro-batch; [B, T]."""

    logprobs_BT: Tensor
    """pi_theta: the gradient flows through it."""
    anchor_logprobs_BT: Tensor
    """The ratio's denominator, r = exp(logprobs - anchor) (the correction's choice)."""
    advantages_BT: Tensor
    """Each token's advantage (its sequence's, spread over the tokens)."""
    weight_BT: Tensor
    """The correction's detached per-token weight."""
    keep_mask_BT: Tensor
    """Tokens the correction keeps."""
    response_mask_BT: Tensor
    """Valid response tokens."""


class PreparedLoss(NamedTuple):
    """LossInputs cast to one float dtype, detached but for the log-probs, zeroed off the active tokens."""

    logprobs_BT: Tensor  # carries the gradient on active tokens only
    anchor_BT: Tensor
    advantages_BT: Tensor
    weight_BT: Tensor
    active_BT: Tensor  # kept and valid

    @property
    def ratio_BT(self) -> Tensor:
        return torch.exp(self.logprobs_BT - self.anchor_BT)


def prepare_loss_inputs(inputs: LossInputs) -> PreparedLoss:
    """Active tokens (kept and valid), one float dtype (>= float32), constants detached."""
    active_BT = inputs.keep_mask_BT.bool() & inputs.response_mask_BT.bool()
    dtype = torch.promote_types(inputs.logprobs_BT.dtype, torch.float32)
    anchor_BT = zero_padding(inputs.anchor_logprobs_BT.detach().to(dtype), active_BT)
    # Inactive tokens take the anchor's value through a branch without gradient: their
    # ratio is exactly 1, so an extreme delta (the reason it was masked) or padding
    # garbage cannot put inf into the forward or 0 * inf = NaN into the backward.
    logprobs = torch.where(active_BT, inputs.logprobs_BT.to(dtype), anchor_BT)
    advantages = zero_padding(inputs.advantages_BT.detach().to(dtype), active_BT)
    weight = zero_padding(inputs.weight_BT.detach().to(dtype).expand_as(active_BT), active_BT)
    return PreparedLoss(logprobs, anchor_BT, advantages, weight, active_BT)


def clipped_surrogate(ratio_BT: Tensor, advantages_BT: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's pessimistic surrogate as a loss: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    clipped_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(-ratio_BT * advantages_BT, -clipped_BT * advantages_BT)


def clip_fractions(ratio_BT: Tensor, x: PreparedLoss, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    """Fraction of active tokens where the clip binds (gradient cut) on each side."""
    low = (x.advantages_BT < 0) & (ratio_BT < 1.0 - eps_low)
    high = (x.advantages_BT > 0) & (ratio_BT > 1.0 + eps_high)
    return {
        "policy_loss/clip_frac_low": masked_fraction(low, x.active_BT),
        "policy_loss/clip_frac_high": masked_fraction(high, x.active_BT),
    }


def ratio_metrics(ratio_BT: Tensor, active_BT: Tensor) -> dict[str, Tensor]:
    ratio = ratio_BT.detach()
    return {
        "policy_loss/ratio_mean": masked_mean(ratio, active_BT),
        "policy_loss/ratio_max": masked_max(ratio, active_BT),
    }


class PolicyLossOutput(NamedTuple):
    loss_BT: Tensor
    """Per-token loss, 0 off the active (kept and valid) tokens."""
    is_weight_BT: Tensor
    """Detached importance weight on each active token's gradient (see the module docstring)."""
    metrics: dict[str, Tensor]


PolicyLossFn = Callable[..., PolicyLossOutput]

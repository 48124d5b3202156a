"""Masked reductions over padded [B, T] token tensors.

Padding may hold anything (an engine can pad log-probs with -inf), so the helpers
select with `torch.where` instead of multiplying by the mask: 0 * inf is NaN.
Every mean over an empty selection is 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (verl's log_ratio_safe,
the DPPO, SAPO and VESPO authors' code): no overflow on a token a mask drops anyway."""


def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """`log_ratio` clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] (safe to exp)."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def float_detached(x: Tensor) -> Tensor:
    """Detached copy of `x` in at least float32 (bf16/fp16 are upcast, float64 kept)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def zero_padding(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """`values_BT` where `mask_BT` is True, 0 elsewhere (gradient 0 at the zeroed places)."""
    return torch.where(mask_BT, values_BT, torch.zeros_like(values_BT))


def masked_sum(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Sum of `values_BT` over the True entries of `mask_BT` (scalar)."""
    return zero_padding(values_BT, mask_BT).sum()


def masked_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of `values_BT` over the True entries of `mask_BT`; 0 when there are none."""
    count = mask_BT.sum().clamp(min=1)
    return masked_sum(values_BT, mask_BT) / count


def masked_max(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Max of `values_BT` over the True entries of `mask_BT`; 0 when there are none."""
    if values_BT.numel() == 0:
        return values_BT.new_zeros(())
    # No host sync (bool(mask.any())): metrics run inside the training step on GPU.
    largest = torch.where(mask_BT, values_BT, torch.full_like(values_BT, -torch.inf)).max()
    return torch.where(mask_BT.any(), largest, torch.zeros_like(largest))


def masked_fraction(flag_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Fraction of the True entries of `mask_BT` where `flag_BT` is True (float32 scalar)."""
    return masked_mean(flag_BT.to(torch.float32), mask_BT)


def sequence_sum(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-sequence sum over valid tokens: [B, T] -> [B]."""
    return zero_padding(values_BT, mask_BT).sum(dim=-1)


def sequence_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-sequence mean over valid tokens: [B, T] -> [B]; 0 for an empty sequence."""
    return sequence_sum(values_BT, mask_BT) / mask_BT.sum(dim=-1).clamp(min=1)


def broadcast_to_tokens(values_B: Tensor, response_mask_BT: Tensor) -> Tensor:
    """Spread one value per sequence (e.g. advantages_B) over its response tokens: [B] -> [B, T],
    0 at padding."""
    return zero_padding(values_B.unsqueeze(-1).expand_as(response_mask_BT), response_mask_BT)

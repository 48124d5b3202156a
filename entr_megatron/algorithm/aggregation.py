"""Reduce a per-token loss [B, T] to the scalar the optimizer steps on.

Denominators use the RESPONSE mask, never a correction's keep mask: a token that
ENTR masks still counts in the token-mean denominator (docs/ENTR.md), so masking
shrinks the update instead of re-weighting the surviving tokens up.

Some methods drop rejected tokens from the denominator (verl's rejection sampling):
their callers pass the kept tokens as `response_mask_BT` (objective.PolicyTerms.denominator_BT).

Global counts: a distributed learner splits a global batch into micro-batches and
ranks. Passing the global `num_tokens` / `num_seqs` makes the sum of the
per-micro-batch results equal the loss of the whole batch. Without them the local
counts are used.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from entr_megatron.algorithm.masked_ops import zero_padding

Count = int | float | Tensor


def _positive(count: Count, like: Tensor) -> Tensor:
    """A count as a tensor, at least 1: an empty batch gives loss 0, never 0/0."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def _local_num_seqs(response_mask_BT: Tensor) -> Tensor:
    """Sequences with at least one response token."""
    return response_mask_BT.any(dim=-1).sum()


def token_mean(
    loss_BT: Tensor, response_mask_BT: Tensor, num_tokens: Count | None, num_seqs: Count | None, norm: Count | None
) -> Tensor:
    """sum_it l_it / num_tokens (default: local count of response tokens). ENTR's default."""
    total = zero_padding(loss_BT, response_mask_BT).sum()
    return total / _positive(response_mask_BT.sum() if num_tokens is None else num_tokens, total)


def seq_mean_token_mean(
    loss_BT: Tensor, response_mask_BT: Tensor, num_tokens: Count | None, num_seqs: Count | None, norm: Count | None
) -> Tensor:
    """sum_i (sum_t l_it / |o_i|) / num_seqs (default: local non-empty sequences)."""
    per_seq_B = zero_padding(loss_BT, response_mask_BT).sum(dim=-1) / response_mask_BT.sum(dim=-1).clamp(min=1)
    seqs = _local_num_seqs(response_mask_BT) if num_seqs is None else num_seqs
    return per_seq_B.sum() / _positive(seqs, per_seq_B)


def seq_mean_token_sum_norm(
    loss_BT: Tensor, response_mask_BT: Tensor, num_tokens: Count | None, num_seqs: Count | None, norm: Count | None
) -> Tensor:
    """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): sum_it l_it / (num_seqs * L), L a CONSTANT
    (the generation budget, so one sequence's gradient does not depend on its batch-mates'
    lengths; verl divides by the padded response width). Defaults: local non-empty
    sequences, and the padded width T for L."""
    total = zero_padding(loss_BT, response_mask_BT).sum()
    seqs = _local_num_seqs(response_mask_BT) if num_seqs is None else num_seqs
    length = response_mask_BT.shape[-1] if norm is None else norm
    return total / (_positive(seqs, total) * _positive(length, total))


AggregationFn = Callable[[Tensor, Tensor, Count | None, Count | None, Count | None], Tensor]

# Keys equal entr_megatron.config.algorithm.LOSS_AGG_MODES.
LOSS_AGGREGATIONS: dict[str, AggregationFn] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate_loss(
    loss_BT: Tensor,
    response_mask_BT: Tensor,
    mode: str,
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    max_response_len: Count | None = None,
) -> Tensor:
    """Scalar loss from per-token losses; `mode` is a key of LOSS_AGGREGATIONS.
    `max_response_len`: seq-mean-token-sum-norm's constant L (None: the padded width T)."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation mode {mode!r} is not valid; allowed: {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode](loss_BT, response_mask_BT.bool(), num_tokens, num_seqs, max_response_len)

"""Group-relative advantages: one scalar per response, from the rewards of its group.

A group is the set of responses sampled for one prompt, named by an integer id
(any values, any order, not necessarily contiguous). Everything is vectorised with
index_add over group slots; there is no Python loop over groups.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

GRPO_STD_EPS = 1e-6  # keeps a group with identical rewards (std 0) at advantage 0, not NaN


class _Groups:
    """Dense group slots of a batch: slot_B in [0, G) per response, and G."""

    def __init__(self, group_ids_B: Tensor) -> None:
        unique_ids, self.slot_B = torch.unique(group_ids_B, return_inverse=True)
        self.num_groups = unique_ids.numel()

    def sum(self, values_B: Tensor) -> Tensor:
        """Sum of values over each response's group, broadcast back to [B]."""
        sums_G = values_B.new_zeros(self.num_groups).index_add_(0, self.slot_B, values_B)
        return sums_G[self.slot_B]


def _as_float(rewards_B: Tensor) -> Tensor:
    return rewards_B.detach().to(torch.promote_types(rewards_B.dtype, torch.float32))


def grpo_advantages(rewards_B: Tensor, group_ids_B: Tensor, eps: float = GRPO_STD_EPS) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps) with the unbiased std (like torch.std).

    A group of size 1 has no spread to normalise by and gets advantage 0.
    """
    rewards, groups = _as_float(rewards_B), _Groups(group_ids_B)
    size_B = groups.sum(torch.ones_like(rewards))
    centred_B = rewards - groups.sum(rewards) / size_B
    # Bessel correction; the clamp only avoids 0/0 for singletons, whose value is discarded.
    std_B = (groups.sum(centred_B.square()) / (size_B - 1).clamp(min=1)).sqrt()
    return torch.where(size_B < 2, torch.zeros_like(rewards), centred_B / (std_B + eps))


def dr_grpo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """Dr.GRPO: A_i = r_i - mean_g (no std normalisation; its bias is what Dr.GRPO removes)."""
    rewards, groups = _as_float(rewards_B), _Groups(group_ids_B)
    return rewards - groups.sum(rewards) / groups.sum(torch.ones_like(rewards))


def rloo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """RLOO: A_i = r_i - mean of the other members of the group; 0 for a group of size 1."""
    rewards, groups = _as_float(rewards_B), _Groups(group_ids_B)
    size_B = groups.sum(torch.ones_like(rewards))
    others_mean_B = (groups.sum(rewards) - rewards) / (size_B - 1).clamp(min=1)
    return torch.where(size_B < 2, torch.zeros_like(rewards), rewards - others_mean_B)


AdvantageFn = Callable[[Tensor, Tensor], Tensor]

# name -> fn(rewards_B, group_ids_B) -> advantages_B. Keys equal
# entr_megatron.config.algorithm.ADVANTAGE_ESTIMATOR_NAMES.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}

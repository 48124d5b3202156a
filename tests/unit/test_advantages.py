"""Group advantages against hand arithmetic and a per-group loop with torch.std."""

import math

import pytest
import torch

from entr_megatron.algorithm import ADVANTAGE_ESTIMATORS, dr_grpo_advantages, grpo_advantages, rloo_advantages

# Three groups, interleaved and with non-contiguous ids: 7 -> [1, 0, 1], 3 -> [4] (singleton),
# -2 -> [2, 5].
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 5.0, 1.0], dtype=torch.float64)
GROUP_IDS = torch.tensor([7, -2, 7, 3, -2, 7])


def test_grpo_hand_values():
    # Group 7: mean 2/3, unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3.
    std7 = math.sqrt(1.0 / 3.0)
    # Group -2: mean 3.5, unbiased var (1.5^2 + 1.5^2) / 1 = 4.5.
    std2 = math.sqrt(4.5)
    expected = [
        (1 / 3) / (std7 + 1e-6),
        -1.5 / (std2 + 1e-6),
        (-2 / 3) / (std7 + 1e-6),
        0.0,  # singleton group
        1.5 / (std2 + 1e-6),
        (1 / 3) / (std7 + 1e-6),
    ]
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUP_IDS), torch.tensor(expected, dtype=torch.float64))


def test_dr_grpo_hand_values():
    expected = [1 / 3, -1.5, -2 / 3, 0.0, 1.5, 1 / 3]
    torch.testing.assert_close(dr_grpo_advantages(REWARDS, GROUP_IDS), torch.tensor(expected, dtype=torch.float64))


def test_rloo_hand_values():
    # Group 7: 1 - (0 + 1) / 2 = 0.5, 0 - (1 + 1) / 2 = -1. Group -2: 2 - 5 = -3, 5 - 2 = 3.
    expected = [0.5, -3.0, -1.0, 0.0, 3.0, 0.5]
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUP_IDS), torch.tensor(expected, dtype=torch.float64))


def _loop_reference(rewards, group_ids, kind):
    out = torch.zeros_like(rewards)
    for gid in set(group_ids.tolist()):
        idx = [i for i, g in enumerate(group_ids.tolist()) if g == gid]
        members = rewards[idx]
        for j, i in enumerate(idx):
            if kind == "grpo":
                out[i] = 0.0 if len(idx) == 1 else (rewards[i] - members.mean()) / (members.std() + 1e-6)
            elif kind == "dr_grpo":
                out[i] = rewards[i] - members.mean()
            else:
                others = [members[k].item() for k in range(len(idx)) if k != j]
                out[i] = 0.0 if not others else rewards[i] - sum(others) / len(others)
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_against_loop_reference(kind):
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(50, generator=generator, dtype=torch.float64)
    group_ids = torch.randint(100, 110, (50,), generator=generator)
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS[kind](rewards, group_ids), _loop_reference(rewards, group_ids, kind)
    )


def test_identical_rewards_give_zero_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    ids = torch.tensor([0, 0, 0, 1])
    for fn in ADVANTAGE_ESTIMATORS.values():
        assert fn(rewards, ids).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_integer_rewards_become_float():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([5, 5]))
    assert adv.dtype == torch.float32
    # mean 0.5, std sqrt(0.5): +-0.5 / sqrt(0.5) = +-0.7071
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))


def test_rloo_is_scaled_dr_grpo():
    # Known identity: r_i - mean_{-i} = n / (n - 1) * (r_i - mean).
    rewards = torch.tensor([0.3, 1.2, -0.4, 2.0], dtype=torch.float64)
    ids = torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(rloo_advantages(rewards, ids), 4 / 3 * dr_grpo_advantages(rewards, ids))

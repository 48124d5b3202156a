"""algorithm/token_local.py: which objectives have a per-token gradient known in the forward pass.

The lists are checked against the registries, and the predicate against its definition: for a
token-local config, perturbing one token's log-prob changes no other token's gradient of the
learner's numerator (policy_loss_terms + aggregate_loss with the learner's unit counts)."""

import math

import pytest
import torch

from entr_megatron.algorithm import CORRECTIONS, POLICY_LOSSES, aggregate_loss, policy_loss_terms
from entr_megatron.algorithm.token_local import (
    TOKEN_LOCAL_CORRECTIONS,
    TOKEN_LOCAL_POLICY_LOSSES,
    is_token_local,
    token_local_reason,
)
from entr_megatron.config.algorithm import AlgorithmConfig


def test_lists_name_registered_methods():
    assert TOKEN_LOCAL_CORRECTIONS <= set(CORRECTIONS)
    assert TOKEN_LOCAL_POLICY_LOSSES <= set(POLICY_LOSSES)


@pytest.mark.parametrize("overrides, local", [
    (dict(), True),  # ENTR with PPO-clip against mu, token-mean
    (dict(entropy_source="rollout", loss_agg_mode="seq-mean-token-mean"), True),
    (dict(correction="none", policy_loss="dppo_tv"), True),
    (dict(correction="tis"), True),
    (dict(correction="tis", tis_level="sequence"), False),
    (dict(correction="icepop"), True),
    (dict(correction="mis_token"), False),  # rejected tokens leave the denominator by default
    (dict(correction="mis_token", rejected_in_denominator=True), True),
    (dict(correction="entr", rejected_in_denominator=False), False),
    (dict(correction="m2po"), False),
    (dict(correction="entr_calibrated"), False),
    (dict(correction="opsm"), False),
    (dict(correction="matched_band"), False),
    (dict(policy_loss="gspo"), False),
    (dict(policy_loss="vespo"), False),
    (dict(correction="none", policy_loss="sapo"), True),
])
def test_predicate(overrides, local):
    cfg = AlgorithmConfig(**overrides)
    assert is_token_local(cfg) == local
    assert (token_local_reason(cfg) is None) == local


def _grad_rows(cfg, lp_BT, inputs):
    """d numerator / d lp for the learner's unit counts (learner/loss.py)."""
    lp = lp_BT.clone().requires_grad_()
    terms = policy_loss_terms(lp, *inputs, cfg)
    counts = {"num_tokens": 1} if cfg.aggregation == "token-mean" else {"num_seqs": 1}
    num = aggregate_loss(terms.loss_BT, terms.denominator_BT, cfg.aggregation, max_response_len=cfg.loss_norm_tokens,
                         **counts)
    (g,) = torch.autograd.grad(num, lp)
    return g


@pytest.mark.parametrize("overrides", [
    dict(), dict(correction="none", policy_loss="dppo_tv", eps_clip_low=0.05, eps_clip_high=0.05),
    dict(correction="icepop"), dict(correction="kpop", kpop_threshold=0.05),
    dict(correction="mis_token", rejected_in_denominator=True, loss_agg_mode="seq-mean-token-mean"),
    dict(correction="entr_soft", policy_loss="cispo"), dict(correction="none", policy_loss="sapo"),
    # and the negative: a sequence-level ratio moves the other tokens' gradients
    dict(policy_loss="gspo"), dict(correction="mis_seq", rejected_in_denominator=True),
])
def test_token_local_means_other_tokens_gradients_do_not_move(overrides):
    cfg = AlgorithmConfig(**{"tau": 0.5, **overrides})
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    blp = -2.0 + 0.5 * torch.randn(3, 6, generator=g)
    lp = blp + 0.4 * torch.randn(3, 6, generator=g)
    inputs = (torch.full((3, 6), 1.5), blp, torch.randn(3, generator=g), mask)
    before = _grad_rows(cfg, lp, inputs)
    moved = lp.clone()
    moved[0, 2] += 0.3  # one token's log-prob moves
    after = _grad_rows(cfg, moved, inputs)
    others = torch.ones_like(mask)
    others[0, 2] = False
    unchanged = torch.allclose(before[others], after[others], atol=1e-7, rtol=0)
    assert unchanged == is_token_local(cfg), (overrides, (before - after).abs().max())
    assert not math.isnan(float(before.sum()))

"""Each baseline as its authors define it: the loss and dL/dlog pi through compute_policy_loss,
against numbers worked out by hand from the published formula (docs/ENTR.md's table).

Conventions of every case: one or two sequences, mu = -2 on every token, token-mean unless
the method's aggregation says otherwise, so a kept token's gradient is -w r A / N.
"""

import math

import pytest
import torch

from entr_megatron.algorithm import compute_policy_loss, mismatch_metrics
from entr_megatron.config.algorithm import AlgorithmConfig
from helpers import assert_close_f64 as _close

F64 = torch.float64
MU = -2.0


def _loss_grad(cfg, log_k, *, advantages=(1.0,), delta_old=None, mask=None):
    """log_k [B, T]: log pi_old / mu; delta_old: log pi_theta / pi_old (None: 0, no step yet,
    pi_old not passed: the same-pass case). Returns (loss, dL/dlog pi, metrics)."""
    log_k = torch.tensor(log_k, dtype=F64)
    behaviour = torch.full_like(log_k, MU)
    old = behaviour + log_k
    logprobs = (old + (0.0 if delta_old is None else torch.tensor(delta_old, dtype=F64))).requires_grad_()
    mask = torch.ones_like(log_k, dtype=torch.bool) if mask is None else torch.tensor(mask)
    entropy = torch.ones_like(log_k)
    loss, metrics = compute_policy_loss(logprobs, entropy, behaviour, torch.tensor(advantages, dtype=F64), mask, cfg,
                                        old_logprobs_BT=None if delta_old is None else old)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), grad, metrics


# The example: ratios k = [2, 0.6, 1, 4], A = +1, one sequence, pi_old = pi.
K = [[math.log(2.0), math.log(0.6), 0.0, math.log(4.0)]]


def test_icepop_weights_each_ppo_term_by_k_inside_its_band():
    _, grad, _ = _loss_grad(AlgorithmConfig(correction="icepop"), K)
    _close(grad, [[-0.5, -0.15, -0.25, -1.0]])  # M(k) = k: -k / 4 (the old mask-on-PPO gave [0, -0.15, -0.25, 0])
    # Outside [0.5, 5] the weight is 0 and the token still counts in the denominator.
    _, grad, metrics = _loss_grad(AlgorithmConfig(correction="icepop"), [[math.log(6.0), math.log(0.4), 0.0, 0.0]])
    _close(grad, [[0.0, 0.0, -0.25, -0.25]])
    assert metrics["icepop/mask_fraction"].item() == pytest.approx(0.5)


def test_mask_only_keeps_the_old_composition_mask_on_ppo_against_mu():
    cfg = AlgorithmConfig(correction="icepop", correction_mode="mask_only")
    _, grad, _ = _loss_grad(cfg, K)
    _close(grad, [[0.0, -0.15, -0.25, 0.0]])  # r = pi / mu clipped at 1.28 for A > 0


def test_icepop_ratio_is_against_pi_old_after_a_step():
    # After an update pi_theta / pi_old = e^0.1 on every token: gradient -k r / 4, clip at 1.28 untouched.
    r = math.exp(0.1)
    _, grad, _ = _loss_grad(AlgorithmConfig(correction="icepop"), K, delta_old=[[0.1] * 4])
    _close(grad, [[-2 * r / 4, -0.6 * r / 4, -r / 4, -4 * r / 4]])


def test_tis_truncates_the_weight_at_two():
    _, grad, _ = _loss_grad(AlgorithmConfig(correction="tis"), K)
    _close(grad, [[-0.5, -0.15, -0.25, -0.5]])  # min(k, 2) / 4


def test_mis_token_weights_rho_inside_the_band_and_drops_the_rest_from_the_denominator():
    k = [[math.log(1.9), math.log(0.6), 0.0, math.log(4.0)]]  # 1.9, not the band edge 2 (rounding)
    loss, grad, _ = _loss_grad(AlgorithmConfig(correction="mis_token"), k)
    # k = 4 is outside [0.5, 2]: dropped, and the token-mean divides by the 3 kept tokens.
    _close(grad, [[-1.9 / 3, -0.6 / 3, -1 / 3, 0.0]])
    assert loss == pytest.approx(-(1.9 + 0.6 + 1) / 3)
    kept_in = AlgorithmConfig(correction="mis_token", rejected_in_denominator=True)
    _, grad, _ = _loss_grad(kept_in, k)
    _close(grad, [[-1.9 / 4, -0.15, -0.25, 0.0]])


def test_mis_seq_weights_every_token_by_the_sequence_ratio():
    # Sequence 0: prod k = 1.2 (kept, weight 1.2 per token); sequence 1: prod = 3 (dropped whole).
    log_k = [[math.log(2.0), math.log(0.6)], [math.log(3.0), 0.0]]
    loss, grad, metrics = _loss_grad(AlgorithmConfig(correction="mis_seq"), log_k, advantages=(1.0, -1.0))
    _close(grad, [[-1.2 / 2, -1.2 / 2], [0.0, 0.0]])  # denominator: the 2 kept tokens
    assert metrics["mis_seq/seq_mask_fraction"].item() == pytest.approx(0.5)


def test_mis_geo_drops_sequences_outside_verls_tight_geometric_band():
    # Geometric means e^0.0004 (kept) and e^0.002 (dropped) against [0.999, 1.001].
    log_k = [[0.0008, 0.0], [0.004, 0.0]]
    _, grad, _ = _loss_grad(AlgorithmConfig(correction="mis_geo"), log_k, advantages=(1.0, 1.0))
    _close(grad, [[-0.5, -0.5], [0.0, 0.0]])  # weight 1, r = 1; the 2 kept tokens are the denominator


def test_decoupled_drops_tokens_above_the_cap_on_ppo_against_pi_prox():
    # w = pi_prox / mu = [e, e^2 = 7.4]; the second is above the cap 5: weight 0, still counted.
    r = math.exp(0.1)
    _, grad, _ = _loss_grad(AlgorithmConfig(correction="decoupled"), [[1.0, 2.0]], delta_old=[[0.1, 0.1]])
    _close(grad, [[-math.e * r / 2, 0.0]])
    clamp = AlgorithmConfig(correction="decoupled", decoupled_cap_mode="clamp")
    _, grad, _ = _loss_grad(clamp, [[1.0, 2.0]], delta_old=[[0.1, 0.1]])
    _close(grad, [[-math.e * r / 2, -5.0 * r / 2]])


def test_m2po_replaces_the_clip_by_its_second_moment_mask():
    # log pi / mu = [0.3, -0.1, 0.1, 0, 1]: squares 0.09, 0.01, 0.01, 0, 1; the prefix means of the
    # sorted squares pass 0.04 only with 1 included: drop it. Kept tokens: unclipped -r A / 5,
    # although r = e^0.3 = 1.35 is above PPO's 1.28.
    log_r = [[0.3, -0.1, 0.1, 0.0, 1.0]]
    _, grad, metrics = _loss_grad(AlgorithmConfig(correction="m2po"), log_r)
    _close(grad, [[-math.exp(0.3) / 5, -math.exp(-0.1) / 5, -math.exp(0.1) / 5, -1 / 5, 0.0]])
    assert metrics["m2po/mask_fraction"].item() == pytest.approx(0.2)


def test_kpop_drops_by_the_two_way_bernoulli_kl_and_weights_pi_old_over_mu():
    # mu(y) = e^-2 = 0.135. Token 0: pi_old(y) = 0.9, D = max(1.49, 1.61) > 0.1: dropped.
    # Token 1: pi_old / mu = 1.5: D ~ 0.02, kept with weight 1.5 on a PPO ratio of 1 (against mu,
    # as before, the ratio 1.5 would be clipped at 1.28 and the gradient 0).
    log_k = [[math.log(0.9) - MU, math.log(1.5)]]
    _, grad, metrics = _loss_grad(AlgorithmConfig(correction="kpop"), log_k)
    _close(grad, [[0.0, -1.5 / 2]])
    assert metrics["kpop/mask_fraction"].item() == pytest.approx(0.5)


def test_gspo_defaults_to_the_papers_per_sequence_mean():
    # Token form at pi_old = pi: s_it = 1, l_it = -A_i. Sequence lengths 1 and 3, A = (1, 1):
    # per sequence the token-mean is -1; the loss is the mean over sequences, -1, and the
    # lone token of sequence 0 gets gradient -1/2 (token-mean would give -1/4 to every token).
    mask = [[True, False, False], [True, True, True]]
    loss, grad, _ = _loss_grad(AlgorithmConfig(policy_loss="gspo", correction="none"), [[0.0] * 3] * 2,
                               advantages=(1.0, 1.0), mask=mask)
    assert loss == pytest.approx(-1.0)
    _close(grad, [[-0.5, 0.0, 0.0], [-1 / 6, -1 / 6, -1 / 6]])


def test_dr_grpo_divides_by_a_constant_so_a_sequence_ignores_its_batch_mates():
    """seq-mean-token-sum-norm with loss_norm_tokens L: d loss / d log pi of a token of
    sequence 0 is -A / (num_seqs * L) whatever the other sequence's length."""
    cfg = AlgorithmConfig(correction="none", loss_agg_mode="seq-mean-token-sum-norm", loss_norm_tokens=64)
    short = [[True, True] + [False] * 48, [True, True] + [False] * 48]
    long = [[True, True] + [False] * 48, [True] * 50]
    _, g_short, _ = _loss_grad(cfg, [[0.0] * 50] * 2, advantages=(1.0, 1.0), mask=short)
    _, g_long, _ = _loss_grad(cfg, [[0.0] * 50] * 2, advantages=(1.0, 1.0), mask=long)
    assert g_short[0, 0].item() == pytest.approx(-1 / (2 * 64)) == g_long[0, 0].item()


def test_effective_sample_size_uses_the_ratio_that_weights_the_loss():
    # No correction (weight 1), PPO against mu: the weights are the ratios r = [1, 10, 100, 1].
    r = torch.tensor([[1.0, 10.0, 100.0, 1.0]], dtype=F64)
    behaviour = torch.full_like(r, -5.0)
    _, metrics = compute_policy_loss(behaviour + r.log(), torch.ones_like(r), behaviour, torch.ones(1, dtype=F64),
                                     torch.ones_like(r, dtype=torch.bool), AlgorithmConfig(correction="none"))
    assert metrics["is/ess"].item() == pytest.approx(112**2 / (4 * (1 + 100 + 10_000 + 1)))  # 0.3104
    # The same through mismatch_metrics with the ratios given as weights.
    direct = mismatch_metrics(behaviour + r.log(), behaviour, torch.ones_like(r), torch.ones_like(r, dtype=torch.bool),
                              weight_BT=r)
    assert direct["is/ess"].item() == pytest.approx(0.3104, abs=1e-4)


def test_naive_ignores_mu_and_runs_ppo_against_pi_old():
    # Whatever mu is (k = pi_old / mu from 0.6 to 4), the first step's gradient is -A / N on every
    # token: the behaviour policy plays no part, the stale tokens count as on-policy.
    _, grad, metrics = _loss_grad(AlgorithmConfig(correction="naive"), K)
    _close(grad, [[-0.25, -0.25, -0.25, -0.25]])
    assert metrics["naive/mask_fraction"].item() == 0.0
    # After a step pi_theta / pi_old = e^0.1 (inside PPO's clip) on two tokens and e^0.4 (clipped at
    # 1.28 for A > 0: no gradient) on the others: -r / 4 where unclipped, against pi_old, not mu.
    _, grad, _ = _loss_grad(AlgorithmConfig(correction="naive"), K, delta_old=[[0.1, 0.4, 0.1, 0.4]])
    r = math.exp(0.1)
    _close(grad, [[-r / 4, 0.0, -r / 4, 0.0]])


def test_naive_has_no_mask_and_refuses_mask_only():
    with pytest.raises(ValueError, match="correction_mode"):
        AlgorithmConfig(correction="naive", correction_mode="mask_only")
    assert AlgorithmConfig(correction="naive").uses_old_logprobs

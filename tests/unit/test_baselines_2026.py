"""The corrections the 2026 frameworks ship, against numbers worked out by hand from each published
formula (docs/ENTR.md's table), each with the case that tells it from its nearest neighbour.

Every case goes through compute_policy_loss (token-mean unless the loss's aggregation says
otherwise) and reads the gradient dL/dlog pi_theta of each token.
"""

import math

import pytest
import torch

from entr_megatron.algorithm import compute_policy_loss
from entr_megatron.config.algorithm import AlgorithmConfig
from helpers import assert_close_f64 as _close

F64 = torch.float64
LOG = math.log


def _run(cfg, logprobs, behaviour, advantages, mask=None, old=None, versions=None, policy_version=None):
    """(loss, dL/dlog pi [B, T], metrics) for [B, T] lists of log-probs (pi_theta, mu)."""
    lp = torch.tensor(logprobs, dtype=F64).requires_grad_()
    mu = torch.tensor(behaviour, dtype=F64)
    mask = torch.ones_like(mu, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, metrics = compute_policy_loss(
        lp, torch.ones_like(mu), mu, torch.tensor(advantages, dtype=F64), mask, cfg,
        old_logprobs_BT=None if old is None else torch.tensor(old, dtype=F64),
        versions_BT=None if versions is None else torch.tensor(versions), policy_version=policy_version)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad, metrics


# ------------------------------------------------------------------------------------------- DPPO

# Sequence 0 (A = +1): a rare token whose ratio doubled (0.001 -> 0.002) and a likely one that
# rose by 0.16 (0.6 -> 0.76, ratio 1.267, inside PPO's 1.28). Sequence 1 (A = -1): a likely token
# that fell by 0.16 (0.9 -> 0.74, ratio 0.822, inside PPO's 0.8). mu is the anchor (correction none).
DPPO_MU = [[LOG(0.001), LOG(0.6)], [LOG(0.9), 0.0]]
DPPO_PI = [[LOG(0.002), LOG(0.76)], [LOG(0.74), 0.0]]
DPPO_MASK = [[True, True], [True, False]]
DPPO_ADV = [1.0, -1.0]


def test_dppo_tv_keeps_the_rare_token_ppo_clips_and_drops_the_likely_ones_that_moved():
    _, grad, metrics = _run(AlgorithmConfig(correction="none", policy_loss="dppo_tv"), DPPO_PI, DPPO_MU, DPPO_ADV,
                            DPPO_MASK)
    # Kept: gradient -A min(r, 10) / 3 (token-mean over the 3 tokens); the moved ones: 0.
    _close(grad, [[-2.0 / 3, 0.0], [0.0, 0.0]])
    assert metrics["dppo_tv/mask_fraction"].item() == pytest.approx(2 / 3)
    _, ppo, _ = _run(AlgorithmConfig(correction="none", policy_loss="ppo_clip"), DPPO_PI, DPPO_MU, DPPO_ADV, DPPO_MASK)
    # PPO-clip against mu does the opposite: the ratio-2 token is clipped, the other two pass.
    _close(ppo, [[0.0, -(0.76 / 0.6) / 3], [(0.74 / 0.9) / 3, 0.0]])


def test_dppo_kl_judges_the_bernoulli_kl_in_the_direction_the_advantage_pushes():
    def bkl(q, p):  # KL(Bern(q) || Bern(p))
        return q * LOG(q / p) + (1 - q) * LOG((1 - q) / (1 - p))

    assert bkl(0.001, 0.002) < 0.05 < bkl(0.6, 0.76)  # the case: 3.1e-4 and 0.0625
    assert bkl(0.9, 0.74) > 0.05  # 0.117
    _, grad, _ = _run(AlgorithmConfig(correction="none", policy_loss="dppo_kl"), DPPO_PI, DPPO_MU, DPPO_ADV,
                      DPPO_MASK)
    _close(grad, [[-2.0 / 3, 0.0], [0.0, 0.0]])
    # A probability that fell under a positive advantage is never a violation, however far.
    _, grad, _ = _run(AlgorithmConfig(correction="none", policy_loss="dppo_kl"), [[LOG(0.2)]], [[LOG(0.9)]], [1.0])
    _close(grad, [[-0.2 / 0.9]])


def test_dppo_truncates_the_ratio_at_its_cap_and_anchors_on_pi_old_with_naive():
    # r = 50 on a token at p 0.005 (moved 0.0049): kept, the coefficient truncated at C = 10.
    _, grad, _ = _run(AlgorithmConfig(correction="none", policy_loss="dppo_tv"), [[LOG(0.005)]], [[LOG(0.0001)]],
                      [1.0])
    _close(grad, [[-10.0]])
    # correction naive: the anchor is pi_old (verl's dppo_tv), mu unused: r = 0.76 / 0.6 from pi_old.
    cfg = AlgorithmConfig(correction="naive", policy_loss="dppo_tv")
    _, grad, _ = _run(cfg, [[LOG(0.76)]], [[LOG(0.01)]], [1.0], old=[[LOG(0.6)]])
    _close(grad, [[0.0]])  # moved 0.16 > 0.15 from pi_old
    _, grad, _ = _run(cfg, [[LOG(0.7)]], [[LOG(0.01)]], [1.0], old=[[LOG(0.6)]])
    _close(grad, [[-0.7 / 0.6]])  # moved 0.1: kept, ratio against pi_old (70 against mu)


# ------------------------------------------------------------------------------------------- OPSM

def test_opsm_drops_only_negative_advantage_sequences_past_delta():
    # mean log(mu / pi) per sequence: 0.6, 0.4, 0.6, 0.6 against delta 0.5.
    mu = [[0.0, 0.0]] * 4
    pi = [[-0.7, -0.5], [-0.4, -0.4], [-0.6, -0.6], [-0.6, -0.6]]
    adv = [-1.0, -1.0, 1.0, 0.0]
    cfg = AlgorithmConfig(correction="opsm")
    _, grad, metrics = _run(cfg, pi, mu, adv)
    # pi_old = pi_theta (no step yet): the PPO ratio is 1, each kept token's gradient -A / 8.
    _close(grad, [[0.0, 0.0], [1 / 8, 1 / 8], [-1 / 8, -1 / 8], [0.0, 0.0]])
    assert metrics["opsm/seq_mask_fraction"].item() == pytest.approx(1 / 4)
    assert metrics["opsm/mask_fraction"].item() == pytest.approx(2 / 8)
    # Dropped sequences stay in the denominator: the same tokens, the loss is -sum(A) / 8.
    loss, _, _ = _run(cfg, pi, mu, adv)
    assert loss == pytest.approx((2 * 1.0 - 2 * 1.0) / 8)
    # mean exactly delta is kept (strictly greater drops); a larger delta keeps all.
    _, grad, _ = _run(cfg, [[-0.5, -0.5]], [[0.0, 0.0]], [-1.0])
    _close(grad, [[0.5, 0.5]])
    _, grad, _ = _run(AlgorithmConfig(correction="opsm", opsm_threshold=0.7), pi, mu, adv)
    assert (grad[:3] != 0).all()


# -------------------------------------------------------------------------------------------- TRM

def test_trm_rejects_on_the_largest_k3_not_on_a_ratio_band():
    # Sequence 0: rho = [1.2, 1, 1] (k3 0.0177 on one token); sequence 1: rho = 1.05 on all (k3 0.0012).
    rho = [[1.2, 1.0, 1.0], [1.05, 1.05, 1.05]]
    pi = [[LOG(r) - 1.0 for r in row] for row in rho]
    mu = [[-1.0] * 3] * 2
    k3 = 0.2 - LOG(1.2)
    assert k3 > 0.01 > k3 / 3 and 0.05 - LOG(1.05) < 0.01
    _, grad, metrics = _run(AlgorithmConfig(correction="trm"), pi, mu, [1.0, 1.0])
    # Sequence 0 goes whole (max k3 > 0.01) and leaves the denominator: 3 tokens remain.
    _close(grad, [[0.0, 0.0, 0.0], [-1 / 3] * 3])
    assert metrics["trm/seq_mask_fraction"].item() == pytest.approx(0.5)
    # The mean keeps sequence 0 (0.0059 <= 0.01); IcePop's band [0.5, 5] would keep both.
    _, grad, _ = _run(AlgorithmConfig(correction="trm", trm_statistic="mean"), pi, mu, [1.0, 1.0])
    assert (grad != 0).all()
    # rho = 0.5 is inside every usual ratio band; k3(0.5) = 0.193 rejects it.
    _, grad, _ = _run(AlgorithmConfig(correction="trm"), [[LOG(0.5) - 1]], [[-1.0]], [1.0])
    _close(grad, [[0.0]])


# ------------------------------------------------------------------------------------------- SAPO

def test_sapo_gate_fades_the_gradient_smoothly_where_ppo_cuts_it():
    # r = 1.5 (A = +1, tau 1) and r = 0.5 (A = -1, tau 1.05): gradient -A f'(r) r, f' = 4 s (1 - s).
    def slope(r, tau):
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        return 4 * s * (1 - s)

    pi, mu = [[LOG(1.5) - 1.0], [LOG(0.5) - 1.0]], [[-1.0], [-1.0]]
    _, grad, _ = _run(AlgorithmConfig(correction="none", policy_loss="sapo"), pi, mu, [1.0, -1.0])
    # seq-mean-token-mean over two one-token sequences: 1/2 each.
    _close(grad, [[-slope(1.5, 1.0) * 1.5 / 2], [slope(0.5, 1.05) * 0.5 / 2]])
    assert 0.9 < slope(1.5, 1.0) < 1.0  # PPO-clip would give exactly 0 for both
    _, ppo, _ = _run(AlgorithmConfig(correction="none", policy_loss="ppo_clip"), pi, mu, [1.0, -1.0])
    _close(ppo, [[0.0], [0.0]])
    # On policy the gate is the plain policy gradient: f'(1) = 1.
    _, grad, _ = _run(AlgorithmConfig(correction="none", policy_loss="sapo"), [[-1.0]], [[-1.0]], [2.0])
    _close(grad, [[-2.0]])


# ------------------------------------------------------------------------------------------ VESPO

def test_vespo_weights_each_sequence_by_the_gamma_shaped_phi_of_its_ratio():
    # Sequence ratio w = prod_t pi / mu = 2 for both (log-ratios 0.5 log 2 each); A = +1 and -1.
    half = 0.5 * LOG(2.0)
    pi, mu = [[half - 1.0, half - 1.0]] * 2, [[-1.0, -1.0]] * 2
    _, grad, metrics = _run(AlgorithmConfig(correction="none", policy_loss="vespo"), pi, mu, [1.0, -1.0])
    phi_pos = math.exp(3.0) * 2.0**2 * math.exp(-3.0 * 2)  # k 2, lambda 3: 4 e^-3 = 0.199
    phi_neg = math.exp(2.0) * 2.0**3 * math.exp(-2.0 * 2)  # k 3, lambda 2: 8 e^-2 = 1.083
    _close(grad, [[-phi_pos / 4] * 2, [phi_neg / 4] * 2])  # token-mean over 4 tokens
    assert metrics["vespo/phi_max"].item() == pytest.approx(phi_neg)
    # phi(1) = 1: on policy VESPO is REINFORCE.
    _, grad, _ = _run(AlgorithmConfig(correction="none", policy_loss="vespo"), [[-1.0]], [[-1.0]], [1.0])
    _close(grad, [[-1.0]])


# ------------------------------------------------------------------------------------------ A-3PO

def test_a3po_interpolates_the_proximal_policy_by_version():
    # Trained at version 10: a token from version 9 (alpha 0: pi_prox = mu) and one from version 7
    # (alpha = (10 - 1 - 7) / (10 - 7) = 2/3), both with delta = log pi / mu = 0.3, A = +1.
    cfg = AlgorithmConfig(correction="a3po")
    _, grad, metrics = _run(cfg, [[-0.7, -0.7]], [[-1.0, -1.0]], [1.0], versions=[[9, 7]], policy_version=10)
    # alpha 0: weight pi_prox / mu = 1, ratio pi / pi_prox = e^0.3 = 1.35 > 1.28: clipped, gradient 0.
    # alpha 2/3: weight e^0.2, ratio e^0.1 (inside the clip): gradient -e^0.2 e^0.1 / 2.
    _close(grad, [[0.0, -math.exp(0.2) * math.exp(0.1) / 2]])
    assert metrics["a3po/alpha_mean"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="a3po.*version"):
        _run(cfg, [[-0.7]], [[-1.0]], [1.0])


def test_a3po_drops_a_token_whose_behaviour_weight_passes_the_cap():
    # alpha = (10 - 1 - 0) / 10 = 0.9, delta = 2: weight e^1.8 = 6.05 > 5: dropped, still counted.
    _, grad, metrics = _run(AlgorithmConfig(correction="a3po"), [[-1.0, -1.0]], [[-3.0, -1.0]], [1.0],
                            versions=[[0, 9]], policy_version=10)
    _close(grad, [[0.0, -1.0 / 2]])
    assert metrics["a3po/mask_fraction"].item() == pytest.approx(0.5)


# ------------------------------------------------------------------------- TIS: both of TRL's shapes

def test_tis_truncates_the_sequence_product_at_sequence_level():
    # rho = [1.5, 1.5] -> product 2.25, truncated at 2 on both tokens (TRL's sequence_truncate);
    # token level: min(1.5, 2) each. PPO against pi_old = pi_theta: ratio 1.
    pi, mu = [[LOG(1.5) - 1.0] * 2], [[-1.0, -1.0]]
    _, grad, _ = _run(AlgorithmConfig(correction="tis", tis_level="sequence"), pi, mu, [1.0])
    _close(grad, [[-2.0 / 2, -2.0 / 2]])
    _, grad, _ = _run(AlgorithmConfig(correction="tis"), pi, mu, [1.0])
    _close(grad, [[-1.5 / 2, -1.5 / 2]])

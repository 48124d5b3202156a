"""What a mask did, on its own tokens: the effective mask, every rule's counterfactual mask, and
the statistics split by entropy (of mu and of pi_theta) and by token label, against hand-worked cases."""

import math

import pytest
import torch

from entr_megatron.algorithm import compute_policy_loss, mismatch_metrics, policy_loss_terms
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.learner.batching import build_microbatch
from entr_megatron.types import TOKEN_LABELS, Sample, TrainBatch

F64 = torch.float64
MU = math.log(0.3)
# One sequence, A = +1. delta = log pi / mu per token, learner entropy H.
DELTA = [1.0, -1.0, 0.1, -0.5]
H = [0.01, 0.01, 1.0, 2.0]


def _metrics(cfg, advantage=1.0):
    lp = torch.tensor([[MU + d for d in DELTA]], dtype=F64, requires_grad=True)
    mu = torch.full_like(lp.detach(), MU)
    mask = torch.ones_like(mu, dtype=torch.bool)
    _, metrics = compute_policy_loss(lp, torch.tensor([H], dtype=F64), mu, torch.tensor([advantage], dtype=F64), mask,
                                     cfg)
    return {k: float(v) for k, v in metrics.items()}


def test_effective_mask_counts_only_dropped_tokens_that_would_carry_a_gradient():
    # ENTR (tau 1) drops tokens 0 and 1 (S = 1 / 0.02 = 50). Token 0's ratio e^1 > 1.28 with A > 0:
    # PPO-clip against mu cuts its gradient anyway. Token 1's ratio e^-1 is below the band, which
    # does not bind for A > 0: the mask removed a real gradient. Effective: 1 of 4.
    m = _metrics(AlgorithmConfig(correction="entr"))
    assert m["mask/fraction"] == pytest.approx(0.5)
    assert m["mask/effective_fraction"] == pytest.approx(0.25)
    # With A = 0 no token carries a gradient: nothing the mask does is effective.
    assert _metrics(AlgorithmConfig(correction="entr"), advantage=0.0)["mask/effective_fraction"] == 0.0
    # Unclipped REINFORCE-vs-mu: both dropped tokens would have carried a gradient.
    m = _metrics(AlgorithmConfig(correction="entr", policy_loss="reinforce"))
    assert m["mask/effective_fraction"] == pytest.approx(0.5)


def _bkl(q, p):
    return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))


def test_counterfactual_masks_of_every_rule_on_the_same_tokens():
    m = _metrics(AlgorithmConfig(correction="none"))
    assert m["none/mask_fraction"] == 0.0  # the run drops nothing; the counterfactuals still report
    r = [math.exp(d) for d in DELTA]
    q = 0.3
    p = [q * x for x in r]
    want = {
        "entr": sum(d * d / (h + 0.01) > 1.0 for d, h in zip(DELTA, H)),  # tokens 0, 1
        "icepop": sum(not 0.5 <= x <= 5.0 for x in r),  # e^-1 = 0.37: token 1
        "tis": sum(x > 2.0 for x in r),  # truncated: token 0
        # m2po: sorted delta^2 = 0.01, 0.25, 1, 1: prefix means 0.01, 0.13, ... only the first <= 0.04.
        "m2po": 3,
        "kpop": sum(max(_bkl(pi, q), _bkl(q, pi)) > 0.1 for pi in p),
        "dppo": sum(pi - q > 0.15 for pi in p),  # A > 0: only a rise past 0.15 (token 0: 0.515)
    }
    assert want == {"entr": 2, "icepop": 1, "tis": 1, "m2po": 3, "kpop": 2, "dppo": 1}  # the case discriminates
    for rule, dropped in want.items():
        assert m[f"counterfactual/{rule}/mask_fraction"] == pytest.approx(dropped / 4), rule
    # The counterfactual of the run's own rule is its mask.
    m = _metrics(AlgorithmConfig(correction="entr"))
    assert m["counterfactual/entr/mask_fraction"] == m["entr/mask_fraction"]
    assert "counterfactual/entr/mask_fraction" not in _metrics(AlgorithmConfig(mask_diagnostics=False))


def test_mismatch_split_by_both_entropies_and_by_token_label():
    delta = torch.tensor([DELTA], dtype=F64)
    mu = torch.full_like(delta, MU)
    h_pi = torch.tensor([H], dtype=F64)
    h_mu = torch.tensor([[0.5, 0.005, 0.5, 0.5]], dtype=F64)  # the engine saw other entropies
    keep = torch.tensor([[False, False, True, True]])
    labels = torch.tensor([[0, 1, 1, -1]], dtype=torch.int8)  # forced, choice, choice, unlabelled
    m = mismatch_metrics(mu + delta, mu, h_pi, torch.ones_like(keep), keep_mask_BT=keep,
                         entropy_views={"mu": h_mu, "pi": h_pi}, token_labels_BT=labels)
    m = {k: float(v) for k, v in m.items()}
    # By H(pi): tokens 0, 1 in [0.01, 0.1); token 2 in [1, 10); token 3 in [1, 10).
    assert m["entropy_bin_pi/0.01-0.1/count"] == 2 and m["entropy_bin_pi/0.01-0.1/mask_fraction"] == 1.0
    assert m["entropy_bin_pi/1-10/mean_abs_delta"] == pytest.approx((0.1 + 0.5) / 2)
    # By H(mu): token 1 in [0.001, 0.01), the rest in [0.1, 1).
    assert m["entropy_bin_mu/0.001-0.01/count"] == 1
    assert m["entropy_bin_mu/0.001-0.01/mean_abs_delta"] == pytest.approx(1.0)
    assert m["entropy_bin_mu/0.1-1/count"] == 3
    assert m["entropy_bin_mu/0.1-1/mask_fraction"] == pytest.approx(1 / 3)
    assert m["entropy_bin_mu/0.1-1/mean_abs_delta"] == pytest.approx((1.0 + 0.1 + 0.5) / 3)
    assert TOKEN_LABELS[:2] == ("forced", "choice")
    assert m["token_label/forced/share"] == pytest.approx(0.25) and m["token_label/forced/mask_fraction"] == 1.0
    assert m["token_label/choice/share"] == pytest.approx(0.5)
    assert m["token_label/choice/mean_abs_delta"] == pytest.approx((1.0 + 0.1) / 2)
    assert m["token_label/choice/mask_fraction"] == pytest.approx(0.5)
    assert m["token_label/answer/count"] == 0 and m["token_label/answer/share"] == 0.0


def test_token_labels_travel_from_samples_to_the_micro_batch():
    labelled = Sample([5, 6], [7, 8, 9], [-0.1] * 3, [0] * 3, token_labels=["choice", "arithmetic", ""])
    plain = Sample([5], [7], [-0.2], [0])
    batch = TrainBatch.from_samples([labelled, plain], torch.tensor([1.0, -1.0]))
    # Target position j carries token j + 1: prompt [5, 6] -> response labels at positions 1..3.
    assert batch.token_labels_T.tolist() == [-1, 1, 2, -1, -1, -1, -1]
    mb = build_microbatch(batch, [0, 1])
    assert mb.token_labels_BT[0].tolist() == [1, 2, -1]
    with pytest.raises(ValueError, match="token_labels"):
        Sample([5], [7], [-0.2], [0], token_labels=["thinking"])


def _grad(cfg, delta, entropy, advantage=1.0):
    lp = torch.tensor([[MU + d for d in delta]], dtype=F64, requires_grad=True)
    mu = torch.full_like(lp.detach(), MU)
    loss, metrics = compute_policy_loss(lp, torch.tensor([entropy], dtype=F64), mu,
                                        torch.tensor([advantage], dtype=F64), torch.ones_like(mu, dtype=torch.bool), cfg)
    (grad,) = torch.autograd.grad(loss, lp)
    return grad[0].tolist(), {k: float(v) for k, v in metrics.items()}


def test_entr_mask_on_the_naive_loss_keeps_its_anchor_and_denominator():
    # naive: PPO against pi_old (= pi_theta before a step: ratio 1), mu unused; ENTR drops tokens 0, 1.
    grad, m = _grad(AlgorithmConfig(correction="naive", add_entr_mask=True), DELTA, H)
    assert grad == pytest.approx([0.0, 0.0, -0.25, -0.25])  # the 4 tokens stay in the denominator
    assert m["entr/mask_fraction"] == 0.5 and m["mask/fraction"] == 0.5
    grad, _ = _grad(AlgorithmConfig(correction="naive"), DELTA, H)
    assert grad == pytest.approx([-0.25] * 4)
    with pytest.raises(ValueError, match="add_entr_mask"):
        AlgorithmConfig(correction="entr", add_entr_mask=True)


def test_random_mask_on_the_naive_loss_drops_entrs_count_at_random_with_naives_anchor():
    # The control of add_entr_mask: ENTR's rule drops tokens 0 and 1 here (S = 50); the random mask
    # drops 2 of the 4 as well, chosen uniformly; naive's anchor (pi_old = pi_theta: ratio 1) and
    # denominator (all 4 tokens) stay, so each kept token's gradient is -A / 4, a dropped one's 0.
    grad, m = _grad(AlgorithmConfig(correction="naive", add_random_mask=True), DELTA, H)
    assert sorted(grad) == pytest.approx([-0.25, -0.25, 0.0, 0.0])
    assert m["entr/mask_fraction"] == 0.5 and m["random_mask/mask_fraction"] == 0.5 and m["mask/fraction"] == 0.5
    # Which two: uniform over the 6 pairs, not ENTR's. Over 600 micro-batches (mu varies, so does the
    # draw's seed) each token is dropped about half the time, ENTR's tokens 0 and 1 no more than 2 and 3.
    cfg = AlgorithmConfig(correction="naive", add_random_mask=True)
    dropped = torch.zeros(4, dtype=F64)
    for i in range(600):
        mu = math.log(0.05 + 0.9 * i / 600)
        lp = torch.tensor([[mu + d for d in DELTA]], dtype=F64)
        terms = policy_loss_terms(lp, torch.tensor([H], dtype=F64), torch.full_like(lp, mu),
                                  torch.tensor([1.0], dtype=F64), torch.ones_like(lp, dtype=torch.bool), cfg)
        assert int((~terms.keep_mask_BT).sum()) == 2
        dropped += (~terms.keep_mask_BT[0]).to(F64)
    share = dropped / 600  # binomial sd of each share about 0.02
    assert ((share - 0.5).abs() < 0.08).all(), share.tolist()
    with pytest.raises(ValueError, match="add_random_mask"):
        AlgorithmConfig(correction="naive", add_entr_mask=True, add_random_mask=True)
    with pytest.raises(ValueError, match="add_random_mask"):
        AlgorithmConfig(correction="matched_random", add_random_mask=True)


def test_matched_ablations_drop_as_many_tokens_as_entr_chosen_otherwise():
    # ENTR drops only token 3 (S = 0.25 / 0.02 = 12.5); token 0 has the largest |delta| but H = 2
    # (S = 1 / 2.01): the band at ENTR's fraction drops token 0 instead.
    delta, entropy = [1.0, -0.3, 0.1, -0.5], [2.0, 1.0, 1.0, 0.01]
    _, m = _grad(AlgorithmConfig(correction="entr"), delta, entropy)
    assert m["mask/fraction"] == 0.25
    grad, m = _grad(AlgorithmConfig(correction="matched_band"), delta, entropy)
    assert m["matched_band/mask_fraction"] == 0.25
    r = [math.exp(d) for d in delta]
    assert grad == pytest.approx([0.0, -r[1] / 4, -r[2] / 4, -r[3] / 4])  # ratios inside PPO's band
    _, m = _grad(AlgorithmConfig(correction="matched_random"), delta, entropy)
    assert m["matched_random/mask_fraction"] == 0.25

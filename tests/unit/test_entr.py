"""The ENTR rule: score, mask, boundary, dtype handling, and the calibrated pieces."""

import math
from statistics import NormalDist

import pytest
import torch

from entr_megatron.algorithm import CORRECTIONS, CorrectionInputs, entr_mask, entr_score
from entr_megatron.algorithm.entr import (
    CHI2_1_MEDIAN,
    calibrated_score,
    calibrated_sigma2,
    collision_upper_bound,
)
from entr_megatron.config.algorithm import AlgorithmConfig


def test_score_hand_values():
    delta = torch.tensor([0.5, -0.3, 0.0, 2.0], dtype=torch.float64)
    entropy = torch.tensor([0.99, 0.0, 1.0, 3.99], dtype=torch.float64)
    expected = [0.25 / 1.0, 0.09 / 0.01, 0.0, 4.0 / 4.0]
    torch.testing.assert_close(entr_score(delta, entropy), torch.tensor(expected, dtype=torch.float64))


def test_mask_boundary_is_kept_exactly():
    # tau * (H + eps) = 0.5 * (1.75 + 0.25) = 1 exactly, so |delta| = 1 sits on the boundary.
    entropy = torch.full((4,), 1.75, dtype=torch.float64)
    delta = torch.tensor([1.0, -1.0, 1.0 + 1e-12, -1.0 - 1e-12], dtype=torch.float64)
    assert entr_mask(delta, entropy, tau=0.5, eps=0.25).tolist() == [True, True, False, False]


@pytest.mark.parametrize("entropy_value", [0.0, 0.05, 1.0, 3.0])
def test_mask_threshold_with_default_eps(entropy_value):
    bound = math.sqrt(0.5 * (entropy_value + 0.01))  # ENTR.md: |delta| <= sqrt(tau (H + eps))
    delta = torch.tensor([bound * (1 - 1e-9), -bound * (1 - 1e-9), bound * (1 + 1e-9)], dtype=torch.float64)
    entropy = torch.full_like(delta, entropy_value)
    assert entr_mask(delta, entropy, tau=0.5).tolist() == [True, True, False]


def test_documented_admission_widths():
    # ENTR.md: tau = 0.5 admits |delta| <= 0.71 at H = 1, 0.1 at H = 0.01, 1.23 at H = 3.
    for entropy_value, width in [(1.0, 0.71), (0.01, 0.1), (3.0, 1.23)]:
        entropy = torch.tensor([entropy_value, entropy_value], dtype=torch.float64)
        inside, outside = width - 0.005, width + 0.005
        assert entr_mask(torch.tensor([inside, outside], dtype=torch.float64), entropy, 0.5).tolist() == [True, False]


def test_bf16_is_upcast_and_detached():
    delta = torch.tensor([0.3, 0.7, -0.2], dtype=torch.bfloat16, requires_grad=True)
    entropy = torch.tensor([0.2, 1.0, 0.05], dtype=torch.bfloat16)
    score = entr_score(delta, entropy)
    assert score.dtype == torch.float32 and not score.requires_grad
    expected = delta.detach().float().square() / (entropy.float() + 0.01)
    torch.testing.assert_close(score, expected)
    mask = entr_mask(delta, entropy, tau=0.5)
    assert mask.dtype == torch.bool and mask.shape == delta.shape


def test_any_shape_and_negative_entropy_rounding():
    delta = torch.zeros(2, 3, 4)
    entropy = torch.full((2, 3, 4), -1e-7)  # rounding noise of a vocab-parallel reduction
    assert entr_mask(delta, entropy, 0.5).all()
    assert torch.isfinite(entr_score(delta, entropy)).all()


def test_invalid_tau_and_eps_raise():
    with pytest.raises(ValueError, match="tau"):
        entr_mask(torch.zeros(1), torch.zeros(1), tau=0.0)
    with pytest.raises(ValueError, match="eps"):
        entr_score(torch.zeros(1), torch.zeros(1), eps=0.0)


def test_entropy_normalisation_disagrees_with_icepop_where_it_should():
    # Token 0: high entropy (5 nats), large delta -1 (ratio 0.37 < 0.5). S = 1 / 5.01 = 0.2.
    # Token 1: near-deterministic (H = 0.01), moderate delta 0.3 (ratio 1.35). S = 0.09 / 0.02 = 4.5.
    logprobs = torch.tensor([[-2.0, -0.7]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    entropy = torch.tensor([[5.0, 0.01]], dtype=torch.float64)
    valid = torch.ones(1, 2, dtype=torch.bool)
    cfg = AlgorithmConfig()
    entr_keep = CORRECTIONS["entr"](CorrectionInputs(logprobs, behaviour, entropy, valid), cfg).keep_mask_BT
    icepop_keep = CORRECTIONS["icepop"](CorrectionInputs(logprobs, behaviour, entropy, valid), cfg).keep_mask_BT
    assert entr_keep.tolist() == [[True, False]]
    assert icepop_keep.tolist() == [[False, True]]


def test_chi2_median_constant():
    assert CHI2_1_MEDIAN == pytest.approx(NormalDist().inv_cdf(0.75) ** 2, rel=1e-12)
    assert CHI2_1_MEDIAN == pytest.approx(0.455, abs=5e-4)


def test_collision_upper_bound():
    # Uniform over 2: H = ln 2, 1 - sum p^2 = 0.5 = 1 - exp(-ln 2): the bound is tight.
    assert collision_upper_bound(torch.tensor(math.log(2.0), dtype=torch.float64)).item() == pytest.approx(0.5)
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(200, 50, generator=generator, dtype=torch.float64) * 3, dim=-1)
    entropy = -(probs * probs.log()).sum(-1)
    collision = 1 - probs.square().sum(-1)
    assert (collision <= collision_upper_bound(entropy) + 1e-12).all()


def test_calibrated_sigma2_hand_case():
    # delta^2 / (G + eps) with G + eps = 0.5: [0.02, 0.08, 0.18, 0.32] + a padded token;
    # lower median of 4 values = 0.08.
    delta = torch.tensor([[0.1, -0.2, 0.3, 0.4, 9.0]], dtype=torch.float64)
    collision = torch.full_like(delta, 0.49)
    valid = torch.tensor([[True, True, True, True, False]])
    sigma2 = calibrated_sigma2(delta, collision, valid, eps=0.01, min_sigma2=1e-6)
    assert sigma2.item() == pytest.approx(0.08 / CHI2_1_MEDIAN)
    score = calibrated_score(delta, collision, sigma2, eps=0.01)
    assert score[0, 3].item() == pytest.approx(0.32 / (0.08 / CHI2_1_MEDIAN))


def test_calibrated_sigma2_floor_and_empty():
    delta = torch.zeros(2, 3, dtype=torch.float64)
    collision = torch.full_like(delta, 0.5)
    assert calibrated_sigma2(delta, collision, torch.ones(2, 3, dtype=torch.bool), 0.01, 1e-6).item() == 1e-6
    assert calibrated_sigma2(delta, collision, torch.zeros(2, 3, dtype=torch.bool), 0.01, 1e-6).item() == 1e-6


def test_calibrated_sigma2_recovers_perturbation_variance():
    # delta ~ N(0, sigma^2 (G + eps)) => the estimator targets sigma^2.
    generator = torch.Generator().manual_seed(1)
    sigma2 = 0.03
    collision = torch.rand(1, 40_000, generator=generator, dtype=torch.float64)
    delta = torch.randn(1, 40_000, generator=generator, dtype=torch.float64) * (sigma2 * (collision + 0.01)).sqrt()
    estimate = calibrated_sigma2(delta, collision, torch.ones_like(delta, dtype=torch.bool), 0.01, 1e-9)
    assert estimate.item() == pytest.approx(sigma2, rel=0.05)

"""compute_policy_loss: the ENTR loss of ENTR.md end to end, wiring, errors, micro-batching."""

import math

import pytest
import torch

from entr_megatron.algorithm import CORRECTIONS, LOSS_AGGREGATIONS, POLICY_LOSSES, compute_policy_loss
from entr_megatron.config.algorithm import AlgorithmConfig

F64 = torch.float64


def _hand_batch():
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=F64)
    delta = torch.tensor([[0.1, 0.9, -0.3], [0.2, 0.4, 0.0]], dtype=F64)
    entropy = torch.tensor([[1.0, 0.05, 0.5], [0.3, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([1.0, -0.5], dtype=F64)
    return (behaviour + delta).requires_grad_(), entropy, behaviour, advantages, mask


def test_entr_default_loss_by_hand():
    logprobs, entropy, behaviour, advantages, mask = _hand_batch()
    loss, metrics = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, AlgorithmConfig())
    # S = delta^2 / (H + 0.01): 0.0099, 13.5 (dropped), 0.176 | 0.129, 0.0796; tau = 0.5.
    r = [math.exp(0.1), math.exp(-0.3), math.exp(0.2), math.exp(0.4)]
    per_token = [
        -r[0] * 1.0,  # inside the clip band
        -r[1] * 1.0,  # A > 0, r = 0.74 < 0.8: unclipped side of the min
        r[2] * 0.5,  # A < 0, inside the band
        r[3] * 0.5,  # A < 0, r = 1.49 > 1.28: the pessimistic unclipped term
    ]
    # Denominator: all 5 response tokens, the masked one included (ENTR.md).
    assert loss.item() == pytest.approx(sum(per_token) / 5)
    loss.backward()
    expected_grad = [[-r[0] / 5, 0.0, -r[1] / 5], [0.5 * r[2] / 5, 0.5 * r[3] / 5, 0.0]]
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grad, dtype=F64))
    assert metrics["entr/mask_fraction"].item() == pytest.approx(1 / 5)
    assert metrics["mask/fraction"].item() == pytest.approx(1 / 5)
    assert metrics["policy_loss/value"].item() == pytest.approx(loss.item())
    assert "mismatch/k3" in metrics and "entropy_bin/0.01-0.1/mask_fraction" in metrics


@pytest.mark.parametrize("overrides", [dict(), dict(correction="naive", add_entr_mask=True)])
def test_the_entr_score_is_computed_once_per_micro_batch(monkeypatch, overrides):
    """The correction computes ENTR's score; the per-bin metric (entropy_bin/*/mean_score) and the
    counterfactual ENTR mask read it, with the values of the hand batch (S = delta^2 / (H + 0.01))."""
    from entr_megatron.algorithm import corrections_entr, metrics

    calls = []
    for module in (corrections_entr, metrics):
        real = module.entr_score
        monkeypatch.setattr(module, "entr_score", lambda *a, _f=real, **k: calls.append(1) or _f(*a, **k))
    logprobs, entropy, behaviour, advantages, mask = _hand_batch()
    _, out = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, AlgorithmConfig(**overrides))
    assert len(calls) == 1
    scores = [0.1**2 / 1.01, 0.9**2 / 0.06, 0.3**2 / 0.51, 0.2**2 / 0.31, 0.4**2 / 2.01]
    assert out["counterfactual/entr/mask_fraction"].item() == pytest.approx(1 / 5)  # 13.5 > tau = 1
    # bins 0, 1e-3, 1e-2, 0.1, 1, 10, inf: H 0.05 in 0.01-0.1; 0.5 and 0.3 in 0.1-1; 1.0 and 2.0 in 1-10
    assert out["entropy_bin/0.01-0.1/mean_score"].item() == pytest.approx(scores[1])
    assert out["entropy_bin/0.1-1/mean_score"].item() == pytest.approx((scores[2] + scores[3]) / 2)
    assert out["entropy_bin/1-10/mean_score"].item() == pytest.approx((scores[0] + scores[4]) / 2)


def test_ratio_one_corrections_reduce_to_weighted_policy_gradient():
    # tis in bypass mode and entr_soft anchor at the current policy: r = 1 exactly, so PPO-clip's
    # loss is -w A per kept token and its gradient -w A / N.
    logprobs, entropy, behaviour, advantages, mask = _hand_batch()
    delta = (logprobs - behaviour).detach()
    for name, weight in [
        ("tis", delta.exp().clamp(max=2.0)),
        ("entr_soft", delta.clamp(-(0.5 * (entropy + 0.01)).sqrt(), (0.5 * (entropy + 0.01)).sqrt()).exp()),
    ]:
        logprobs.grad = None
        loss, _ = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, AlgorithmConfig(correction=name))
        loss.backward()
        keep = mask if name == "tis" else mask & (delta.abs() <= 2 * (0.5 * (entropy + 0.01)).sqrt())
        adv = advantages.unsqueeze(-1).expand_as(mask)
        expected_grad = torch.where(keep, -weight * adv / 5, torch.zeros_like(weight))
        torch.testing.assert_close(logprobs.grad, expected_grad)
        assert loss.item() == pytest.approx(expected_grad.sum().item())


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_aggregation_mode_is_applied(mode):
    logprobs, entropy, behaviour, advantages, mask = _hand_batch()
    cfg = AlgorithmConfig(correction="none", loss_agg_mode=mode, dual_clip_c=None)
    loss, _ = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, cfg)
    # No mask, r A inside or on the pessimistic side everywhere: per-token -min(r A, clip(r) A).
    d = (logprobs - behaviour).detach().tolist()
    rows = [
        [-min(math.exp(x) * a, min(max(math.exp(x), 0.8), 1.28) * a) for x in d[b][:n]]
        for b, (a, n) in enumerate([(1.0, 3), (-0.5, 2)])
    ]
    expected = {
        "token-mean": sum(map(sum, rows)) / 5,
        "seq-mean-token-mean": (sum(rows[0]) / 3 + sum(rows[1]) / 2) / 2,
        "seq-mean-token-sum-norm": sum(map(sum, rows)) / (2 * 3),
    }[mode]
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_every_combination_is_finite_and_differentiable(correction, loss_name):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    behaviour = -torch.rand(B, T, generator=g) * 4 - 0.01
    logprobs = (behaviour + torch.randn(B, T, generator=g) * 0.5).clamp(max=-1e-3).requires_grad_()
    entropy = torch.rand(B, T, generator=g) * 2
    mask = torch.arange(T) < torch.tensor([[6], [3], [0], [5]])
    old = behaviour + 0.05
    cfg = AlgorithmConfig(correction=correction, policy_loss=loss_name)
    advantages = torch.randn(B, generator=g)
    versions = torch.randint(0, 6, (B, T), generator=g)  # a3po: tokens 0 .. 5 versions old at version 5
    loss, metrics = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, cfg, old_logprobs_BT=old,
                                        versions_BT=versions, policy_version=5)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all() and (logprobs.grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_micro_batches_with_global_counts_sum_to_the_batch():
    g = torch.Generator().manual_seed(5)
    B, T = 6, 7
    behaviour = -torch.rand(B, T, generator=g, dtype=F64) * 4
    logprobs = (behaviour + torch.randn(B, T, generator=g, dtype=F64) * 0.4).requires_grad_()
    entropy = torch.rand(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.3
    advantages = torch.randn(B, generator=g, dtype=F64)
    cfg = AlgorithmConfig()
    whole, _ = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, cfg)
    counts = {"num_tokens": int(mask.sum()), "num_seqs": int(mask.any(-1).sum())}
    parts = sum(
        compute_policy_loss(logprobs[s], entropy[s], behaviour[s], advantages[s], mask[s], cfg, **counts)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    torch.testing.assert_close(parts, whole)


def test_shape_errors_name_the_tensor():
    logprobs, entropy, behaviour, advantages, mask = _hand_batch()
    with pytest.raises(ValueError, match="entropy_BT"):
        compute_policy_loss(logprobs, entropy[:, :2], behaviour, advantages, mask, AlgorithmConfig())
    with pytest.raises(ValueError, match="advantages_B"):
        compute_policy_loss(logprobs, entropy, behaviour, advantages[:1], mask, AlgorithmConfig())


def test_decoupled_before_any_update_needs_no_old_logprobs():
    """pi_prox before the first optimizer step is the current policy: without old log-probs
    the loss equals the one given them explicitly (detached current log-probs)."""
    logprobs, entropy, behaviour, advantages, mask = _hand_batch()
    cfg = AlgorithmConfig(correction="decoupled")
    implicit, _ = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, cfg)
    explicit, _ = compute_policy_loss(logprobs, entropy, behaviour, advantages, mask, cfg,
                                      old_logprobs_BT=logprobs.detach())
    torch.testing.assert_close(implicit, explicit)

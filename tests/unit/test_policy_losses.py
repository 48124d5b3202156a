"""Per-token policy losses: values and gradients against hand arithmetic and float64 loops."""

import math

import pytest
import torch

from entr_megatron.algorithm import POLICY_LOSSES, LossInputs, compute_policy_loss
from entr_megatron.config.algorithm import AlgorithmConfig
from helpers import assert_close_f64 as _close

F64 = torch.float64


def _loss_and_grad(name, log_ratio, advantages, weight=None, keep=None, mask=None, cfg=None, anchor=None):
    """Run a loss on [B, T] float64 lists; logprobs = anchor + log_ratio. Returns (loss, grad, metrics)."""
    log_ratio = torch.tensor(log_ratio, dtype=F64)
    anchor = torch.full_like(log_ratio, -1.0) if anchor is None else torch.tensor(anchor, dtype=F64)
    logprobs = (anchor + log_ratio).requires_grad_()
    ones = torch.ones_like(log_ratio)
    weight = ones if weight is None else torch.tensor(weight, dtype=F64)
    keep = torch.ones_like(log_ratio, dtype=torch.bool) if keep is None else torch.tensor(keep)
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else torch.tensor(mask)
    cfg = cfg or AlgorithmConfig(policy_loss=name)
    adv = torch.tensor(advantages, dtype=F64)
    loss, _, metrics = POLICY_LOSSES[name](LossInputs(logprobs, anchor, adv, weight, keep, mask), cfg)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    return loss.detach(), grad, metrics


# ---------------------------------------------------------------- hand-computed cases


def test_ppo_clip_every_regime():
    # eps_low 0.2, eps_high 0.28, dual clip c = 3.
    log_r = [[0.1, 0.5, -0.5, 0.2, 1.5, -0.5, 0.5]]
    adv = [[1.0, 2.0, -1.0, -1.0, -0.5, 1.0, -1.0]]
    weight = [[1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0]]
    r = [math.exp(v) for v in log_r[0]]
    expected_loss = [
        -r[0] * 1.0,  # unclipped
        -1.28 * 2.0,  # A > 0, r = 1.65 > 1.28: clipped high
        0.8,  # A < 0, r = 0.61 < 0.8: clipped low, -0.8 * -1
        r[3],  # A < 0, r inside the band
        1.5,  # A < 0, r = 4.48 > c = 3: dual clip, -3 * -0.5
        -0.5 * r[5],  # A > 0 with r < 0.8 is not clipped; weight 0.5
        r[6],  # A < 0, r = 1.65 above the band but below c: unclipped, pessimistic
    ]
    expected_grad = [-r[0], 0.0, 0.0, r[3], 0.0, -0.5 * r[5], r[6]]
    loss, grad, metrics = _loss_and_grad("ppo_clip", log_r, adv, weight)
    _close(loss, [expected_loss])
    _close(grad, [expected_grad])
    assert metrics["policy_loss/clip_frac_low"].item() == pytest.approx(1 / 7)
    assert metrics["policy_loss/clip_frac_high"].item() == pytest.approx(1 / 7)
    assert metrics["policy_loss/dual_clip_frac"].item() == pytest.approx(1 / 7)
    assert metrics["policy_loss/ratio_max"].item() == pytest.approx(r[4])


def test_ppo_dual_clip_disabled():
    cfg = AlgorithmConfig(dual_clip_c=None)
    loss, grad, metrics = _loss_and_grad("ppo_clip", [[1.5]], [[-0.5]], cfg=cfg)
    _close(loss, [[0.5 * math.exp(1.5)]])
    _close(grad, [[0.5 * math.exp(1.5)]])
    assert "policy_loss/dual_clip_frac" not in metrics


def test_reinforce_hand_case():
    # r = e^0.2, A = 2, w = 0.5, log pi = -1: l = -0.5 r 2 (-1) = r, d l / d log pi = -r.
    r = math.exp(0.2)
    loss, grad, _ = _loss_and_grad("reinforce", [[0.2]], [[2.0]], [[0.5]], anchor=[[-1.2]])
    _close(loss, [[r]])
    _close(grad, [[-r]])


def test_cispo_hand_case():
    # Token 0: r = 1.65 truncated to 1.28, A = 1, log pi = -0.7: l = 1.28 * 0.7, grad -1.28
    # (the gradient survives truncation, unlike PPO). Token 1: r = 0.3, no lower clip by default,
    # A = -1, log pi = -2: l = -0.3 * -1 * -2 = -0.6, grad +0.3.
    log_r = [[0.5, math.log(0.3)]]
    anchor = [[-0.7 - 0.5, -2.0 - math.log(0.3)]]
    loss, grad, metrics = _loss_and_grad("cispo", log_r, [[1.0, -1.0]], anchor=anchor)
    _close(loss, [[1.28 * 0.7, -0.6]])
    _close(grad, [[-1.28, 0.3]])
    assert metrics["policy_loss/clip_frac_high"].item() == pytest.approx(0.5)
    assert metrics["policy_loss/clip_frac_low"].item() == 0.0


def test_gspo_hand_case():
    # eps 3e-4 / 4e-4. Row 0: mean log ratio 2e-4 -> s = e^2e-4 inside, A = 1: l = -s, grad -s.
    # Row 1: mean 6e-4 -> s = 1.0006 > 1.0004, A = 1: l = -1.0004, grad 0.
    # Row 2: the masked log ratio 50 is left out of s = e^1e-4; A = -1: l = s, grad s.
    log_r = [[1e-4, 3e-4], [5e-4, 7e-4], [1e-4, 50.0]]
    adv = [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]
    keep = [[True, True], [True, True], [True, False]]
    s0, s2 = math.exp(2e-4), math.exp(1e-4)
    loss, grad, metrics = _loss_and_grad("gspo", log_r, adv, keep=keep)
    _close(loss, [[-s0, -s0], [-1.0004, -1.0004], [s2, 0.0]])
    _close(grad, [[-s0, -s0], [0.0, 0.0], [s2, 0.0]])
    assert metrics["policy_loss/clip_frac_high"].item() == pytest.approx(2 / 5)
    assert metrics["policy_loss/seq_ratio_mean"].item() == pytest.approx((s0 + math.exp(6e-4) + s2) / 3)


def test_nll_hand_case():
    # log pi = [-0.5, -2.0 | -0.1, pad]; token (0, 1) dropped by keep. Anchor, advantages and
    # weights must not matter: l = -log pi = 0.5 and 0.1 on the active tokens, grad -1 there.
    log_r = [[0.3, 1.7], [-0.4, 0.0]]
    anchor = [[-0.8, -3.7], [0.3, -1.0]]
    keep = [[True, False], [True, True]]
    mask = [[True, True], [True, False]]
    adv, weight = [[-2.0, 5.0], [3.0, 0.0]], [[0.1, 9.0], [4.0, 1.0]]
    loss, grad, metrics = _loss_and_grad("nll", log_r, adv, weight, keep, mask, anchor=anchor)
    _close(loss, [[0.5, 0.0], [0.1, 0.0]])
    _close(grad, [[-1.0, 0.0], [-1.0, 0.0]])
    assert metrics["policy_loss/nll_mean"].item() == pytest.approx(0.3)


def test_nll_through_compute_policy_loss_token_mean():
    # SFT: correction "none" keeps every response token; token-mean over 4 response tokens
    # gives loss = (0.25 + 1.5 + 0.75 + 3.0) / 4 and d loss / d log pi = -1/4 on each of them.
    logprobs = torch.tensor([[-0.25, -1.5, -0.75], [-3.0, -7.0, -9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    behaviour = torch.tensor([[-0.2, -5.0, -0.1], [-0.3, -1.0, -1.0]], dtype=F64)
    entropy = torch.full_like(behaviour, 0.7)
    cfg = AlgorithmConfig(policy_loss="nll", correction="none")
    loss, metrics = compute_policy_loss(logprobs, entropy, behaviour, torch.tensor([4.0, -2.0], dtype=F64), mask, cfg)
    assert loss.item() == pytest.approx(5.5 / 4, rel=1e-12)
    loss.backward()
    _close(logprobs.grad, [[-0.25, -0.25, -0.25], [-0.25, 0.0, 0.0]])
    assert metrics["policy_loss/value"].item() == pytest.approx(5.5 / 4, rel=1e-12)


# ---------------------------------------------------------------- masking and gradient flow


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_and_padded_tokens_get_zero_loss_and_gradient(name):
    # Token 1 was dropped by a correction for an extreme ratio (e^200 overflows);
    # token 2 is padding holding -inf. Both must be exactly 0 in value and gradient, never NaN.
    logprobs = torch.tensor([[-1.0, 199.0, -math.inf]], dtype=torch.float32, requires_grad=True)
    anchor = torch.tensor([[-1.0001, -1.0, -math.inf]])  # a ratio inside even GSPO's band
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    keep = torch.tensor([[True, False, True]])
    mask = torch.tensor([[True, True, False]])
    loss, _, _ = POLICY_LOSSES[name](LossInputs(logprobs, anchor, adv, torch.ones(1, 3), keep, mask), AlgorithmConfig())
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    assert loss[0, 1:].tolist() == [0.0, 0.0] and logprobs.grad[0, 1:].tolist() == [0.0, 0.0]
    assert logprobs.grad[0, 0].item() != 0.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_gradient_flows_through_logprobs_only(name):
    shape = (2, 3)
    logprobs = torch.full(shape, -1.0, requires_grad=True)
    others = [torch.full(shape, v, requires_grad=True) for v in (-1.1, 0.7, 1.3)]  # anchor, adv, weight
    ones = torch.ones(shape, dtype=torch.bool)
    loss, _, _ = POLICY_LOSSES[name](LossInputs(logprobs, *others, ones, ones), AlgorithmConfig())
    loss.sum().backward()
    assert logprobs.grad is not None and all(t.grad is None for t in others)


def test_bf16_logprobs_give_float32_loss():
    logprobs = torch.full((1, 2), -1.0, dtype=torch.bfloat16, requires_grad=True)
    ones = torch.ones(1, 2)
    loss, _, _ = POLICY_LOSSES["ppo_clip"](LossInputs(logprobs, ones * -1.0, ones, ones, ones.bool(), ones.bool()),
                                           AlgorithmConfig())
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logprobs.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- float64 loop reference


def _token_reference(name, lr, a, w, s, cfg, log_w=0.0):
    """(loss, d loss / d log pi) of one active token with log ratio lr (s: GSPO sequence ratio,
    log_w: the sequence's sum of log ratios, VESPO's log w; the anchor is -1)."""
    eps_low, eps_high = cfg.clip_range(name)
    lo, hi = 1 - eps_low, 1 + eps_high
    r = math.exp(lr)
    if name in ("dppo_tv", "dppo_kl"):
        p, p_a = math.exp(lr - 1.0), math.exp(-1.0)
        if name == "dppo_tv":
            kept = p - p_a <= eps_high if a > 0 else p - p_a >= -eps_low
        else:
            kl = p_a * math.log(p_a / p) + (1 - p_a) * math.log((1 - p_a) / (1 - p))
            kept = (kl <= eps_high or p <= p_a) if a > 0 else (kl <= eps_low or p >= p_a)
        c = w * min(r, cfg.dppo_ratio_cap)
        return (-c * a * (lr - 1.0), -c * a) if kept else (0.0, 0.0)
    if name == "sapo":
        tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
        sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        return -w * sig * 4.0 / tau * a, -w * a * 4.0 * sig * (1.0 - sig) * r
    if name == "vespo":
        k, lam = (cfg.vespo_k[0], cfg.vespo_lambda[0]) if a >= 0 else (cfg.vespo_k[1], cfg.vespo_lambda[1])
        phi = math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))
        return -w * phi * a * (lr - 1.0), -w * phi * a
    if name == "reinforce":
        return -w * r * a * (lr - 1.0), -w * r * a  # anchor is -1, so log pi = lr - 1
    if name == "nll":
        return -(lr - 1.0), -1.0  # -log pi; the anchor, advantage and weight play no part
    if name == "cispo":
        c = min(max(r, lo), hi)
        return -w * c * a * (lr - 1.0), -w * c * a
    ratio = s if name == "gspo" else r
    unclipped, clipped = -ratio * a, -min(max(ratio, lo), hi) * a
    if unclipped >= clipped:
        loss, grad = unclipped, -ratio * a
    else:
        loss, grad = clipped, 0.0
    if name == "ppo_clip" and a < 0 and loss > -cfg.dual_clip_c * a:
        loss, grad = -cfg.dual_clip_c * a, 0.0
    return w * loss, w * grad


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_against_loop_reference(name):
    g = torch.Generator().manual_seed(7)
    B, T = 6, 5
    # GSPO's band is ~1e-4 wide, so give it log ratios on that scale.
    scale = 4e-4 if name == "gspo" else 0.6
    log_r = (torch.randn(B, T, generator=g, dtype=F64) * scale).tolist()
    log_r[0][0] = 1.7 if name != "gspo" else log_r[0][0]  # a dual-clip case for ppo
    if name.startswith("dppo"):  # DPPO reads probabilities: log pi = -1 + log r must stay below 0
        log_r = [[min(v, 0.9) for v in row] for row in log_r]
    adv_B = torch.randn(B, generator=g, dtype=F64).tolist()
    weight = (torch.rand(B, T, generator=g, dtype=F64) + 0.5).tolist()
    keep = (torch.rand(B, T, generator=g) > 0.2).tolist()
    mask = [[t < T - b % 3 for t in range(T)] for b in range(B)]
    adv = [[adv_B[b] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    cfg = AlgorithmConfig(policy_loss=name)
    loss, grad, _ = _loss_and_grad(name, log_r, adv, weight, keep, mask, cfg)
    expected_loss = [[0.0] * T for _ in range(B)]
    expected_grad = [[0.0] * T for _ in range(B)]
    for b in range(B):
        active = [t for t in range(T) if keep[b][t] and mask[b][t]]
        s = math.exp(sum(log_r[b][t] for t in active) / len(active)) if active else 1.0
        log_w = sum(log_r[b][t] for t in active)
        for t in active:
            reference = _token_reference(name, log_r[b][t], adv_B[b], weight[b][t], s, cfg, log_w)
            expected_loss[b][t], expected_grad[b][t] = reference
    _close(loss, expected_loss)
    _close(grad, expected_grad)
    active = [(b, t) for b in range(B) for t in range(T) if keep[b][t] and mask[b][t]]
    clipped_grads = sum(1 for b, t in active if expected_grad[b][t] == 0)
    if name in ("ppo_clip", "gspo", "dppo_tv", "dppo_kl"):
        assert clipped_grads > 0, "the random case should exercise the clip"

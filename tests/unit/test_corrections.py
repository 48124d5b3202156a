"""Off-policy corrections: hand-computed cases and a per-token float64 loop reference."""

import math

import pytest
import torch

from entr_megatron.algorithm import CORRECTIONS, CorrectionInputs
from entr_megatron.algorithm.corrections_divergence import bernoulli_kl, m2po_keep_mask
from entr_megatron.algorithm.entr import CHI2_1_MEDIAN
from entr_megatron.config.algorithm import AlgorithmConfig

F64 = torch.float64
CFG = AlgorithmConfig(tau=0.5)  # the hand cases below are worked at tau = 0.5


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def _run(name, logprobs, behaviour, entropy=None, mask=None, cfg=CFG, old=None, collision=None):
    entropy = torch.ones_like(logprobs) if entropy is None else entropy
    mask = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask
    return CORRECTIONS[name](CorrectionInputs(logprobs, behaviour, entropy, mask, old, collision), cfg)


# ---------------------------------------------------------------- hand-computed cases


def test_entr_hand_case_and_mask_fraction_counts_valid_tokens_only():
    # Row 0: H + eps = 1.0, tau = 0.5: deltas 0.5 (S 0.25, keep), -0.8 (S 0.64, drop), 0.7 (S 0.49, keep).
    # Row 1 is padding holding garbage the correction must not look at.
    logprobs = _t([[-1.0, -1.8, -0.3], [-math.inf, math.nan, 0.0]])
    behaviour = _t([[-1.5, -1.0, -1.0], [0.0, -math.inf, math.nan]])
    entropy = _t([[0.99, 0.99, 0.99], [math.nan, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True], [False, False, False]])
    out = _run("entr", logprobs, behaviour, entropy, mask)
    assert out.keep_mask_BT.tolist() == [[True, False, True], [False, False, False]]
    assert out.metrics["entr/mask_fraction"].item() == pytest.approx(1 / 3)
    assert out.weight_BT[0].tolist() == [1.0, 0.0, 1.0]  # weight 1 on kept tokens
    assert out.denominator_BT[0].all() and not out.denominator_BT[1].any()  # masked ones still counted
    assert out.anchor_logprobs_BT[0].tolist() == behaviour[0].tolist()  # ratio against mu
    assert out.metrics["entr/score_mean"].item() == pytest.approx((0.25 + 0.64 + 0.49) / 3)
    assert all(torch.isfinite(t).all() for t in (out.weight_BT, out.anchor_logprobs_BT))


def test_entr_soft_hand_case():
    # H + eps = 2, tau = 0.5 -> b = 1; hard mask beyond 2b = 2.
    behaviour = _t([[-1.0, -1.0, -1.0, -3.0]])
    logprobs = behaviour + _t([[0.5, 1.5, -2.5, -1.2]])
    entropy = torch.full_like(logprobs, 1.99)
    out = _run("entr_soft", logprobs, behaviour, entropy)
    assert out.keep_mask_BT.tolist() == [[True, True, False, True]]
    kept = out.weight_BT[out.keep_mask_BT]
    torch.testing.assert_close(kept, _t([math.exp(0.5), math.exp(1.0), math.exp(-1.0)]))
    torch.testing.assert_close(out.anchor_logprobs_BT, logprobs)  # ratio 1: the weight replaces it
    assert out.metrics["entr_soft/clamp_fraction"].item() == pytest.approx(3 / 4)


@pytest.mark.parametrize("with_collision", [True, False])
def test_entr_calibrated_hand_case(with_collision):
    # G + eps = 0.5 either given directly (G = 0.49) or from H with 1 - exp(-H) = 0.49.
    delta = _t([[0.1, -0.2, 0.3, 0.4, 1.5]])
    behaviour = torch.full_like(delta, -2.0)
    entropy = torch.full_like(delta, -math.log(0.51))
    collision = torch.full_like(delta, 0.49) if with_collision else None
    cfg = AlgorithmConfig(correction="entr_calibrated", calibrated_z=1.0)
    out = _run("entr_calibrated", behaviour + delta, behaviour, entropy, cfg=cfg, collision=collision)
    # delta^2 / 0.5 = [0.02, 0.08, 0.18, 0.32, 4.5]; median 0.18; S = values / sigma2.
    sigma2 = 0.18 / CHI2_1_MEDIAN
    assert out.metrics["entr_calibrated/sigma2_hat"].item() == pytest.approx(sigma2)
    # S = [0.051, 0.20, 0.455, 0.81, 11.4] against z^2 = 1.
    assert out.keep_mask_BT.tolist() == [[True, True, True, True, False]]


def test_tis_hand_case_bypass_and_recomputed():
    behaviour = _t([[-1.0, -1.0]])
    logprobs = behaviour + _t([[0.9, -0.3]])
    out = _run("tis", logprobs, behaviour)
    torch.testing.assert_close(out.weight_BT, _t([[2.0, math.exp(-0.3)]]))  # min(e^0.9 = 2.46, C = 2)
    torch.testing.assert_close(out.anchor_logprobs_BT, logprobs)  # bypass: ratio 1 in value
    assert out.keep_mask_BT.all() and out.denominator_BT.all() and out.clip
    old = behaviour + _t([[0.1, 0.2]])
    out = _run("tis", logprobs, behaviour, old=old)
    torch.testing.assert_close(out.weight_BT, _t([[math.exp(0.1), math.exp(0.2)]]))
    torch.testing.assert_close(out.anchor_logprobs_BT, old)
    with pytest.raises(ValueError, match="correction_mode='mask_only' is not valid with correction='tis'"):
        AlgorithmConfig(correction="tis", correction_mode="mask_only")


def test_decoupled_drops_above_the_cap_like_areal_or_clamps():
    behaviour = _t([[-2.0, -2.0]])
    prox = behaviour + _t([[1.0, 2.0]])  # e^1 = 2.72 under the cap, e^2 = 7.39 above 5
    out = _run("decoupled", behaviour + 0.3, behaviour, old=prox, cfg=AlgorithmConfig(correction="decoupled"))
    assert out.keep_mask_BT.tolist() == [[True, False]]  # AReaL's behav_imp_weight_cap drops it
    assert out.denominator_BT.tolist() == [[True, True]]  # ... but counts it
    assert out.weight_BT.tolist() == [[pytest.approx(math.e), 0.0]]
    torch.testing.assert_close(out.anchor_logprobs_BT, prox)
    clamp = AlgorithmConfig(correction="decoupled", decoupled_cap_mode="clamp")
    out = _run("decoupled", behaviour + 0.3, behaviour, old=prox, cfg=clamp)
    torch.testing.assert_close(out.weight_BT, _t([[math.e, 5.0]]))
    assert out.keep_mask_BT.all()
    # Before any optimizer step pi_prox is the current policy: no extra forward pass is needed.
    current = behaviour + _t([[1.0, 2.0]])
    bypass = _run("decoupled", current, behaviour, cfg=AlgorithmConfig(correction="decoupled"))
    assert bypass.keep_mask_BT.tolist() == [[True, False]]
    torch.testing.assert_close(bypass.anchor_logprobs_BT, current)


def test_icepop_weights_k_inside_its_band_on_ppo_against_pi_old():
    """Ring-1T's M(k) = k on [0.5, 5], 0 outside; mis_token is the same weight on [0.5, 2]
    but drops the rejected tokens from the denominator (verl's rejection sampling)."""
    behaviour = torch.full((1, 5), -2.0, dtype=F64)
    log_rho = _t([[-0.8, -0.6, 0.6, 1.0, 1.7]])  # ratios 0.45, 0.55, 1.82, 2.72, 5.47
    old = behaviour + log_rho
    mis = _run("mis_token", behaviour + 0.01, behaviour, old=old, cfg=AlgorithmConfig(correction="mis_token"))
    ice = _run("icepop", behaviour + 0.01, behaviour, old=old, cfg=AlgorithmConfig(correction="icepop"))
    assert mis.keep_mask_BT.tolist() == [[False, True, True, False, False]]  # [0.5, 2]
    assert ice.keep_mask_BT.tolist() == [[False, True, True, True, False]]  # [0.5, 5]
    ratios = [0.0, math.exp(-0.6), math.exp(0.6), math.exp(1.0), 0.0]
    torch.testing.assert_close(ice.weight_BT, _t([ratios]))
    torch.testing.assert_close(mis.weight_BT, _t([[0.0, ratios[1], ratios[2], 0.0, 0.0]]))
    torch.testing.assert_close(ice.anchor_logprobs_BT, old)
    assert ice.denominator_BT.all() and mis.denominator_BT.tolist() == mis.keep_mask_BT.tolist()
    # mask_only: the band judged on pi_theta / mu, weight 1, PPO against mu, all tokens counted.
    only = AlgorithmConfig(correction="mis_token", correction_mode="mask_only")
    bypass = _run("mis_token", old, behaviour, cfg=only)
    assert bypass.keep_mask_BT.tolist() == mis.keep_mask_BT.tolist()
    torch.testing.assert_close(bypass.anchor_logprobs_BT, behaviour)
    assert (bypass.weight_BT[bypass.keep_mask_BT] == 1).all() and bypass.denominator_BT.all()


def test_mis_seq_and_geo_hand_case():
    behaviour = torch.full((4, 2), -1.0, dtype=F64)
    log_rho = _t([[0.3, 0.3], [0.5, 0.3], [-0.4, -0.4], [0.75, 0.75]])
    # products: e^0.6 = 1.82 keep, e^0.8 = 2.23 drop, e^-0.8 = 0.45 drop, e^1.5 = 4.48 drop
    # geometric means with a [0.5, 2] band: e^0.3, e^0.4, e^-0.4 = 0.67 keep; e^0.75 = 2.12 drop
    seq = _run("mis_seq", behaviour + log_rho, behaviour, cfg=AlgorithmConfig(correction="mis_seq"))
    geo_cfg = AlgorithmConfig(correction="mis_geo", mis_geo_band=(0.5, 2.0))
    geo = _run("mis_geo", behaviour + log_rho, behaviour, cfg=geo_cfg)
    assert seq.keep_mask_BT.all(dim=1).tolist() == [True, False, False, False]
    assert geo.keep_mask_BT.all(dim=1).tolist() == [True, True, True, False]
    torch.testing.assert_close(seq.weight_BT[0], _t([math.exp(0.6)] * 2))  # Seq-MIS: rho_seq on each token
    assert (geo.weight_BT[geo.keep_mask_BT] == 1).all()
    assert seq.metrics["mis_seq/seq_mask_fraction"].item() == pytest.approx(3 / 4)
    assert geo.metrics["mis_geo/mask_fraction"].item() == pytest.approx(2 / 8)
    # verl's default geometric band [0.999, 1.001]: only the sequence within 0.1% survives.
    tight = _run("mis_geo", behaviour + _t([[0.0005, 0.0], [0.01, 0.0], [0.0, 0.0], [-0.01, -0.01]]), behaviour,
                 cfg=AlgorithmConfig(correction="mis_geo"))
    assert tight.keep_mask_BT.all(dim=1).tolist() == [True, False, True, False]
    assert AlgorithmConfig().mis_geo_band == (0.999, 1.001)


def test_mis_seq_ignores_padding_in_the_product():
    behaviour = torch.full((1, 3), -1.0, dtype=F64)
    logprobs = behaviour + _t([[0.3, 0.3, 5.0]])  # the 5.0 is padding
    mask = torch.tensor([[True, True, False]])
    out = _run("mis_seq", logprobs, behaviour, mask=mask, cfg=AlgorithmConfig(correction="mis_seq"))
    assert out.keep_mask_BT.tolist() == [[True, True, False]]


def _bkl(a, b):
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def test_kpop_hand_values():
    # q = mu(y), p = pi_old(y). (0.9, 0.99): a ratio of only 1.1 near p = 1 -> large KL, drop.
    # (1e-4, 1e-3): a ratio of 10 on a rare token -> tiny KL, keep (IcePop would drop it).
    q = [0.9, 1e-4]
    p = [0.99, 1e-3]
    expected = [max(_bkl(a, b), _bkl(b, a)) for a, b in zip(q, p)]
    assert expected[0] == pytest.approx(0.14448, abs=1e-5) and expected[1] < 1e-2
    behaviour = _t([[math.log(v) for v in q]])
    logprobs = _t([[math.log(v) for v in p]])
    out = _run("kpop", logprobs, behaviour, cfg=AlgorithmConfig(correction="kpop"))
    assert out.keep_mask_BT.tolist() == [[False, True]]
    torch.testing.assert_close(bernoulli_kl(behaviour, logprobs), _t([[_bkl(a, b) for a, b in zip(q, p)]]))
    assert out.metrics["kpop/kl_mean"].item() == pytest.approx(sum(expected) / 2)
    assert out.weight_BT[0, 1].item() == pytest.approx(10.0)  # AReaL's decoupled weight pi_old / mu


def test_bernoulli_kl_is_accurate_near_certainty_and_finite_at_extremes():
    # q = e^-2e-10, p = e^-1e-10: 1 - q and 1 - p from expm1 (exact to double precision).
    log_q, log_p = -2e-10, -1e-10
    one_minus_q, one_minus_p = -math.expm1(log_q), -math.expm1(log_p)
    expected = math.exp(log_q) * (log_q - log_p) + one_minus_q * math.log(one_minus_q / one_minus_p)
    value = bernoulli_kl(_t([log_q]), _t([log_p])).item()
    assert value == pytest.approx(expected, rel=1e-6) and value > 0
    extremes = bernoulli_kl(_t([0.0, -math.inf, -1.0, 0.0]), _t([-1.0, -1.0, 0.0, 0.0]))
    assert torch.isfinite(extremes).all() and (extremes >= 0).all()
    assert extremes[3].item() == 0.0  # q = p = 1


def test_m2po_hand_cases():
    # delta^2 = 0.01, 0.04, 0.09, 0.16: prefix means 0.01, 0.025, 0.0467 > 0.04 -> keep 2.
    behaviour = torch.full((2, 2), -1.0, dtype=F64)
    out = _run("m2po", behaviour + _t([[0.1, -0.4], [0.3, -0.2]]), behaviour, cfg=AlgorithmConfig(correction="m2po"))
    assert out.keep_mask_BT.tolist() == [[True, False], [False, True]]
    assert out.metrics["m2po/mask_fraction"].item() == pytest.approx(0.5)
    assert out.metrics["m2po/kept_mean_sq_log_ratio"].item() == pytest.approx(0.025)
    assert not out.clip and out.denominator_BT.all()  # the mask replaces PPO's clip; 1 / sum |o_i|
    torch.testing.assert_close(out.anchor_logprobs_BT, behaviour)  # r = pi_theta / mu
    # Tie: 0.01, 0.09, 0.09 with threshold 0.06: means 0.01, 0.05, 0.0633 -> one of the tied
    # tokens stays, the one earlier in row-major order.
    sq = _t([[0.09, 0.01], [0.09, 0.0]])
    valid = torch.tensor([[True, True], [True, False]])
    assert m2po_keep_mask(sq, valid, 0.06).tolist() == [[True, True], [False, False]]


def test_none_keeps_everything_valid():
    logprobs = _t([[-1.0, -9.0], [-0.5, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = _run("none", logprobs, logprobs - 3.0, mask=mask)
    assert out.keep_mask_BT.tolist() == mask.tolist()
    assert out.metrics["none/mask_fraction"].item() == 0.0


# ---------------------------------------------------------------- loop reference


def _lower_median(values):
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _reference(name, lp, mu, H, mask, cfg, old, adv=None, versions=None, policy_version=None):
    """Per-token float64 loops from the published formulas (docs/ENTR.md's table):
    (weight, keep, anchor) as dicts over valid tokens; `old` is pi_old or None (then pi_old
    is the current policy); `adv` per row, `versions` per token and `policy_version` for
    opsm and a3po."""
    B, T = len(lp), len(lp[0])
    valid = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
    delta = {k: lp[k[0]][k[1]] - mu[k[0]][k[1]] for k in valid}
    mask_only = cfg.correction_mode == "mask_only"
    src = {k: (old if old is not None and not mask_only else lp)[k[0]][k[1]] for k in valid}
    log_rho = {k: src[k] - mu[k[0]][k[1]] for k in valid}
    weight = {k: 1.0 for k in valid}
    keep = {k: True for k in valid}
    anchor = {k: mu[k[0]][k[1]] for k in valid}
    weighted = name in ("tis", "decoupled", "mis_token", "mis_seq", "icepop", "kpop") and not mask_only
    eps = cfg.entr_eps
    if name == "entr":
        keep = {k: delta[k] ** 2 / (H[k[0]][k[1]] + eps) <= cfg.tau for k in valid}
    elif name == "entr_calibrated":
        g = {k: 1 - math.exp(-H[k[0]][k[1]]) for k in valid}
        sigma2 = max(_lower_median([delta[k] ** 2 / (g[k] + eps) for k in valid]) / CHI2_1_MEDIAN, 1e-6)
        keep = {k: delta[k] ** 2 / (sigma2 * (g[k] + eps)) <= cfg.calibrated_z**2 for k in valid}
    elif name == "entr_soft":
        for k in valid:
            b = math.sqrt(cfg.tau * (H[k[0]][k[1]] + eps))
            weight[k] = math.exp(min(max(delta[k], -b), b))
            keep[k] = abs(delta[k]) <= 2 * b
            anchor[k] = lp[k[0]][k[1]]
    elif name == "tis":
        weight = {k: min(math.exp(log_rho[k]), cfg.tis_cap) for k in valid}
    elif name == "decoupled":
        keep = {k: math.exp(log_rho[k]) <= cfg.decoupled_cap for k in valid}
    elif name in ("mis_token", "icepop"):
        lo, hi = cfg.mis_token_band if name == "mis_token" else cfg.icepop_band
        keep = {k: lo <= math.exp(log_rho[k]) <= hi for k in valid}
    elif name in ("mis_seq", "mis_geo"):
        lo, hi = cfg.mis_seq_band if name == "mis_seq" else cfg.mis_geo_band
        for b in range(B):
            members = [k for k in valid if k[0] == b]
            if not members:
                continue
            if name == "mis_seq":
                value = math.prod(math.exp(log_rho[k]) for k in members)
            else:
                value = math.exp(sum(log_rho[k] for k in members) / len(members))
            for k in members:
                keep[k] = lo <= value <= hi
                weight[k] = value if name == "mis_seq" and not mask_only else 1.0
    elif name == "kpop":
        for k in valid:
            q, p = math.exp(mu[k[0]][k[1]]), math.exp(src[k])
            keep[k] = max(_bkl(q, p), _bkl(p, q)) <= cfg.kpop_threshold
    elif name == "m2po":
        remaining = sorted(valid, key=lambda k: (delta[k] ** 2, k))
        while remaining and sum(delta[k] ** 2 for k in remaining) / len(remaining) > cfg.m2po_threshold:
            dropped = remaining.pop()  # the largest; among ties the latest token goes first
            keep[dropped] = False
    elif name == "opsm":
        # DeepSeek-V3.2: a negative-advantage sequence whose mean log(mu / pi_theta) exceeds delta goes.
        for b in range(B):
            members = [k for k in valid if k[0] == b]
            if members and adv[b] < 0:
                stat = sum(mu[k[0]][k[1]] - lp[k[0]][k[1]] for k in members) / len(members)
                for k in members:
                    keep[k] = not stat > cfg.opsm_threshold
    elif name == "trm":
        for b in range(B):
            members = [k for k in valid if k[0] == b]
            k3s = [math.exp(log_rho[k]) - 1 - log_rho[k] for k in members]
            stat = (max(k3s) if cfg.trm_statistic == "max" else sum(k3s) / len(k3s)) if members else 0.0
            for k in members:
                keep[k] = stat <= cfg.trm_threshold
    elif name == "a3po":
        for k in valid:
            v_mu = versions[k[0]][k[1]]
            alpha = min(max((policy_version - 1 - v_mu) / (policy_version - v_mu), 0.0), 1.0) \
                if policy_version > v_mu else 0.0
            prox = mu[k[0]][k[1]] + alpha * delta[k]
            judged = delta[k] if mask_only else prox - mu[k[0]][k[1]]
            keep[k] = math.exp(judged) <= cfg.decoupled_cap
            weight[k] = 1.0 if mask_only else math.exp(judged)
            anchor[k] = mu[k[0]][k[1]] if mask_only else prox
    elif name in ("matched_band", "matched_random"):
        count = sum(delta[k] ** 2 / (H[k[0]][k[1]] + eps) > cfg.tau for k in valid)  # what ENTR drops
        if name == "matched_band":  # the largest |delta| go, the earlier token first among ties
            for k in sorted(valid, key=lambda k: (-abs(delta[k]), k))[:count]:
                keep[k] = False
        else:  # which ones is the generator's choice: the test checks the count
            keep = {"count": count}
    elif name == "random_drop":  # a fixed share at random, whatever ENTR drops: the test checks the count
        keep = {"count": round(cfg.random_drop_fraction * len(valid))}
    else:
        assert name in ("none", "naive")
    if weighted and name != "mis_seq":
        weight = {k: weight[k] if name == "tis" else math.exp(log_rho[k]) for k in valid}
    if name in ("naive", "tis", "decoupled", "mis_token", "mis_seq", "mis_geo", "icepop", "kpop", "opsm", "trm") \
            and not mask_only:
        anchor = src
    return weight, keep, anchor


def _random_batch(seed, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    # Two stale rows drift as a whole (+-0.9 nats) so the sequence-level baselines bite too.
    row_drift = torch.zeros(B, 1, dtype=F64)
    row_drift[2], row_drift[3] = 0.9, -0.9
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.02
    mu = (lp + torch.randn(B, T, generator=g, dtype=F64) * 0.4 - row_drift).clamp(max=-0.02)
    old = (mu + torch.randn(B, T, generator=g, dtype=F64) * 0.5 + row_drift).clamp(max=-0.02)
    H = torch.rand(B, T, generator=g, dtype=F64) ** 3 * 3  # many low-entropy positions
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1], lengths[2], lengths[3] = T, 0, T, T  # full rows and an empty one
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return lp, mu, H, mask, old


# Names whose masks the random batch must exercise on both sides (else the test is vacuous).
MASKING = {"entr", "entr_calibrated", "entr_soft", "mis_token", "mis_seq", "mis_geo", "icepop", "kpop", "m2po", "opsm",
           "trm", "matched_band"}

# Per-row advantages (rows 2 and 3 drift as a whole; row 3's mu sits above pi_theta: OPSM's case)
# and per-token versions of the random batch, trained at version POLICY_VERSION.
ADVANTAGES = [0.5, -1.0, -0.7, -1.2, 0.3, -0.4, 1.0, -0.9]
POLICY_VERSION = 9


def _versions(B=8, T=7):
    return torch.tensor([[(3 * b + t) % 10 for t in range(T)] for b in range(B)])


def _full_inputs(lp, mu, H, mask, old=None):
    """CorrectionInputs with the advantages and versions every correction may read."""
    adv_BT = torch.tensor(ADVANTAGES, dtype=lp.dtype)[:, None].expand_as(lp) * mask
    return CorrectionInputs(lp, mu, H, mask, old, None, _versions(*lp.shape), POLICY_VERSION, adv_BT)


CASES = [(n, w, m) for n in sorted(CORRECTIONS) for w in (False, True) for m in ("published", "mask_only")
         if not (n in ("tis", "naive") and m == "mask_only")]


@pytest.mark.parametrize("name, with_old, mode", CASES)
def test_against_loop_reference(name, with_old, mode):
    lp, mu, H, mask, old = _random_batch(seed=11)
    # z = 1.5 so the calibrated mask bites; a wider geometric band than verl's for this drift.
    # trm: a looser bound than verl's 0.01 preset, which every row of this drift would fail.
    cfg = AlgorithmConfig(correction=name, correction_mode=mode, calibrated_z=1.5, mis_geo_band=(0.5, 2.0),
                          trm_threshold=0.8)
    out = CORRECTIONS[name](_full_inputs(lp, mu, H, mask, old if with_old else None), cfg)
    # ENTR, none and m2po compare pi_theta with mu directly and ignore old log-probs.
    uses_old = with_old and cfg.uses_old_logprobs
    weight, keep, anchor = _reference(
        name, lp.tolist(), mu.tolist(), H.tolist(), mask.tolist(), cfg, old.tolist() if uses_old else None,
        ADVANTAGES, _versions().tolist(), POLICY_VERSION,
    )
    if name in ("matched_random", "random_drop"):
        assert int((mask & ~out.keep_mask_BT).sum()) == keep["count"] > 0  # the count, at random
        assert (out.weight_BT[out.keep_mask_BT] == 1).all() and torch.equal(out.anchor_logprobs_BT[mask], mu[mask])
        again = CORRECTIONS[name](_full_inputs(lp, mu, H, mask, old if with_old else None), cfg)
        assert torch.equal(again.keep_mask_BT, out.keep_mask_BT)  # a rerun drops the same tokens
        return
    got_keep = {k: out.keep_mask_BT[k].item() for k in keep}
    assert got_keep == keep
    assert not out.keep_mask_BT[~mask].any()
    for k in keep:
        assert out.anchor_logprobs_BT[k].item() == pytest.approx(anchor[k], rel=1e-12)
        if keep[k]:
            assert out.weight_BT[k].item() == pytest.approx(weight[k], rel=1e-12)
    dropped = sum(not v for v in keep.values())
    assert out.metrics[f"{name}/mask_fraction"].item() == pytest.approx(dropped / len(keep))
    want_denominator = mask if cfg.counts_rejected else out.keep_mask_BT
    assert out.denominator_BT.tolist() == want_denominator.tolist()
    assert cfg.counts_rejected == (mode == "mask_only" or name not in ("mis_token", "mis_seq", "mis_geo", "trm"))
    assert out.clip == (name != "m2po" or mode == "mask_only")
    if name in MASKING:
        assert 0 < dropped < len(keep), f"{name}: random batch should drop some but not all tokens"


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_outputs_detached_finite_and_padding_dropped(name):
    lp, mu, H, mask, old = _random_batch(seed=5)
    lp = lp.float().requires_grad_()
    mu, H, old = mu.float(), H.float(), old.float()
    padding = ~mask
    mu = torch.where(padding, torch.full_like(mu, -math.inf), mu)  # engine-style padding
    H = torch.where(padding, torch.full_like(H, math.nan), H)
    out = CORRECTIONS[name](_full_inputs(lp, mu, H, mask, old), AlgorithmConfig(correction=name))
    for tensor in (out.weight_BT, out.keep_mask_BT, out.anchor_logprobs_BT):
        assert not tensor.requires_grad
    assert torch.isfinite(out.weight_BT).all() and torch.isfinite(out.anchor_logprobs_BT).all()
    assert out.keep_mask_BT.dtype == torch.bool and not out.keep_mask_BT[padding].any()
    assert (out.weight_BT[padding] == 0).all()
    assert out.weight_BT.dtype == torch.float32
    for key, value in out.metrics.items():
        assert value.ndim == 0 and torch.isfinite(value), key
    assert f"{name}/mask_fraction" in out.metrics


def test_bf16_inputs_are_upcast():
    lp, mu, H, mask, _ = _random_batch(seed=2)
    out = CORRECTIONS["entr"](CorrectionInputs(lp.bfloat16(), mu.bfloat16(), H.bfloat16(), mask), CFG)
    assert out.weight_BT.dtype == torch.float32 and out.anchor_logprobs_BT.dtype == torch.float32
    reference = CORRECTIONS["entr"](
        CorrectionInputs(lp.bfloat16().double(), mu.bfloat16().double(), H.bfloat16().double(), mask), CFG
    )
    assert out.keep_mask_BT.tolist() == reference.keep_mask_BT.tolist()


def test_random_drop_is_none_with_a_fixed_share_of_tokens_dropped():
    """random_drop at 0 is `none` token for token; at 0.25 it drops round(0.25 x valid) valid tokens,
    whatever ENTR would drop, and keeps none's weight, anchor (mu) and denominator."""
    lp, mu, H, mask, old = _random_batch(seed=5)
    inputs = _full_inputs(lp, mu, H, mask, old)
    none = CORRECTIONS["none"](inputs, AlgorithmConfig(correction="none"))
    zero = CORRECTIONS["random_drop"](inputs, AlgorithmConfig(correction="random_drop", random_drop_fraction=0.0))
    for field in ("keep_mask_BT", "weight_BT", "anchor_logprobs_BT", "denominator_BT"):
        assert torch.equal(getattr(zero, field), getattr(none, field)), field
    for tau in (0.5, 4.0):  # ENTR's count changes with tau; random_drop's does not
        cfg = AlgorithmConfig(correction="random_drop", random_drop_fraction=0.25, tau=tau)
        out = CORRECTIONS["random_drop"](inputs, cfg)
        assert int((mask & ~out.keep_mask_BT).sum()) == round(0.25 * int(mask.sum()))
        assert not out.keep_mask_BT[~mask].any()
        assert torch.equal(out.anchor_logprobs_BT[mask], mu[mask]) and torch.equal(out.denominator_BT, mask)


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan")])
def test_random_drop_fraction_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="random_drop_fraction"):
        AlgorithmConfig(correction="random_drop", random_drop_fraction=value)

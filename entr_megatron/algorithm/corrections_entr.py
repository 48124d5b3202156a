"""ENTR, its two variants and its two ablations as corrections (docs/ENTR.md).

All compare the learner directly with the behaviour policy, delta = log pi_theta - log mu;
a recomputed old policy is not needed and is ignored. The ablations drop exactly as many
tokens as ENTR would on the same micro-batch, chosen otherwise: `matched_band` the largest
|delta| (a magnitude-only band at ENTR's fraction), `matched_random` at random. What ENTR
gains over them is what judging |delta| against the entropy gains. `random_drop`, a control, drops
a fixed share of the tokens at random, whatever ENTR would drop. `with_added_mask` puts ENTR's rule,
or matched_random's choice, on top of another correction (algorithm.add_entr_mask, add_random_mask).
"""

from __future__ import annotations

import torch

from entr_megatron.algorithm.correction_base import (
    CorrectionInputs,
    CorrectionOutput,
    TokenInputs,
    finish,
    prepare_inputs,
)
from entr_megatron.algorithm.entr import (
    calibrated_score,
    calibrated_sigma2,
    collision_upper_bound,
    entr_mask,
    entr_score,
)
from entr_megatron.algorithm.masked_ops import float_detached, masked_fraction, masked_mean
from entr_megatron.config.algorithm import AlgorithmConfig


def entr_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """ENTR: keep tokens with delta^2 / (H + eps) <= tau; weight 1; PPO ratio against mu."""
    x = prepare_inputs(inputs, use_old=False)
    score_BT = entr_score(x.delta_BT, x.entropy_BT, cfg.entr_eps)
    keep_BT = score_BT <= cfg.tau  # entr_mask's rule, on the score computed once
    metrics = {"entr/score_mean": masked_mean(score_BT, x.valid_BT)}
    out = finish("entr", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT, metrics)
    return out._replace(entr_score_BT=score_BT)


def entr_calibrated_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Self-calibrated ENTR: S = delta^2 / (sigma2_hat (G + eps)), keep S <= z^2.

    G = 1 - sum_j p_j^2 from `inputs.collision_BT` when given; otherwise 1 - exp(-H), an upper
    bound of it (see entr.collision_upper_bound), which admits slightly more.
    sigma2_hat = median_valid(delta^2 / (G + eps)) / CHI2_1_MEDIAN, per call (micro-batch).
    """
    x = prepare_inputs(inputs, use_old=False)
    if inputs.collision_BT is None:
        collision = collision_upper_bound(x.entropy_BT)
    else:
        collision = float_detached(inputs.collision_BT).to(x.delta_BT.dtype)
    collision = collision.clamp(0.0, 1.0)
    sigma2 = calibrated_sigma2(x.delta_BT, collision, x.valid_BT, cfg.entr_eps, cfg.calibrated_min_sigma2)
    score_BT = calibrated_score(x.delta_BT, collision, sigma2, cfg.entr_eps)
    keep_BT = score_BT <= cfg.calibrated_z**2
    metrics = {
        "entr_calibrated/sigma2_hat": sigma2,
        "entr_calibrated/score_mean": masked_mean(score_BT, x.valid_BT),
    }
    return finish("entr_calibrated", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT, metrics)


def entr_soft_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Soft ENTR: w = exp(clamp(delta, -b, b)), b = sqrt(tau (H + eps)); hard-mask only
    |delta| > soft_mask_multiple * b.

    The anchor is the detached current log-prob, so the policy ratio is 1 in value and
    carries the gradient of log pi: the (entropy-clamped) weight replaces pi / mu.
    """
    x = prepare_inputs(inputs, use_old=False)
    bound_BT = (cfg.tau * (x.entropy_BT.clamp(min=0) + cfg.entr_eps)).sqrt()
    weight_BT = torch.clamp(x.delta_BT, min=-bound_BT, max=bound_BT).exp()
    keep_BT = x.delta_BT.abs() <= cfg.soft_mask_multiple * bound_BT
    metrics = {"entr_soft/clamp_fraction": masked_fraction(x.delta_BT.abs() > bound_BT, x.valid_BT)}
    return finish("entr_soft", x, cfg, weight_BT, keep_BT, x.logprobs_BT, metrics)


def _matched_drop_count(x: TokenInputs, cfg: AlgorithmConfig) -> int:
    """How many valid tokens ENTR drops on these tokens."""
    return int((x.valid_BT & ~entr_mask(x.delta_BT, x.entropy_BT, cfg.tau, cfg.entr_eps)).sum())


def _drop_ranked(x: TokenInputs, rank_BT, count: int):
    """Keep mask dropping the `count` valid tokens with the largest `rank_BT` (ties: the earlier
    token goes first)."""
    flat = torch.where(x.valid_BT, rank_BT, torch.full_like(rank_BT, -torch.inf)).flatten()
    keep = torch.ones_like(flat, dtype=torch.bool)
    if count:
        order = torch.sort(flat, descending=True, stable=True).indices
        keep[order[:count]] = False
    return keep.view_as(x.valid_BT) & x.valid_BT


def matched_band_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Ablation: a magnitude band at ENTR's mask fraction. Drops the valid tokens with the largest
    |delta| (entropy ignored), as many as ENTR (tau, entr_eps) drops on the same micro-batch; weight
    1, PPO against mu, every token in the denominator: ENTR with H + eps replaced by a constant
    whose band edge falls where ENTR's count says."""
    x = prepare_inputs(inputs, use_old=False)
    count = _matched_drop_count(x, cfg)
    keep_BT = _drop_ranked(x, x.delta_BT.abs(), count)
    return finish("matched_band", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT)


def _drop_at_random(x: TokenInputs, count: int):
    """Keep mask dropping `count` valid tokens chosen uniformly, by a generator seeded by the
    micro-batch's values (a rerun drops the same ones)."""
    seed = int(torch.round(x.behaviour_BT.abs().sum() * 1e3).item()) % (2**31)
    scores = torch.rand(x.delta_BT.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return _drop_ranked(x, scores.to(x.delta_BT.device, x.delta_BT.dtype), count)


def matched_random_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Ablation: a random mask at ENTR's mask fraction: as many valid tokens as ENTR drops on the same
    micro-batch, chosen uniformly; weight 1, PPO against mu, every token in the denominator."""
    x = prepare_inputs(inputs, use_old=False)
    keep_BT = _drop_at_random(x, _matched_drop_count(x, cfg))
    return finish("matched_random", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT)


def random_drop_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Control: round(random_drop_fraction x valid tokens) of each micro-batch dropped uniformly,
    whatever ENTR would drop (matched_random's choice at a fixed size); weight 1, PPO against mu, every
    token in the denominator. Asks what dropping tokens does by itself."""
    x = prepare_inputs(inputs, use_old=False)
    keep_BT = _drop_at_random(x, round(cfg.random_drop_fraction * int(x.valid_BT.sum())))
    return finish("random_drop", x, cfg, torch.ones_like(x.delta_BT), keep_BT, x.behaviour_BT)


def with_added_mask(out: CorrectionOutput, inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Another correction's output with a second keep rule added: a token is kept when the correction
    keeps it AND the added rule does. The weight, anchor and denominator stay the correction's.

    cfg.add_entr_mask: ENTR's rule, delta^2 / (H + eps) <= tau, delta = log pi_theta / mu; on `naive`
    (PPO against pi_old, mu unused) this is the paper's claim, ENTR's mask rescuing asynchronous GRPO.
    cfg.add_random_mask: its control, as many valid tokens as ENTR's rule drops on this micro-batch,
    chosen uniformly (matched_random's choice). Metric `entr/mask_fraction`: the tokens ENTR's rule
    alone drops (the random mask's size too)."""
    x = prepare_inputs(inputs, use_old=False)
    score_BT = entr_score(x.delta_BT, x.entropy_BT, cfg.entr_eps)
    entr_keep_BT = score_BT <= cfg.tau  # entr_mask's rule
    metrics = {**out.metrics, "entr/mask_fraction": masked_fraction(~entr_keep_BT, x.valid_BT)}
    if cfg.add_random_mask:
        added_keep_BT = _drop_at_random(x, int((x.valid_BT & ~entr_keep_BT).sum()))
        metrics["random_mask/mask_fraction"] = masked_fraction(~added_keep_BT, x.valid_BT)
    else:
        added_keep_BT = entr_keep_BT
    keep_BT = out.keep_mask_BT & added_keep_BT
    denominator_BT = out.denominator_BT if cfg.counts_rejected else out.denominator_BT & keep_BT
    return out._replace(weight_BT=torch.where(keep_BT, out.weight_BT, torch.zeros_like(out.weight_BT)),
                        keep_mask_BT=keep_BT, denominator_BT=denominator_BT, metrics=metrics, entr_score_BT=score_BT)

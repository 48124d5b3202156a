"""Baselines that act on the importance ratio rho = pi_old / mu (magnitude only).

As published (cfg.correction_mode 'published', the default) each runs PPO against
pi_old, the policy before the rollout batch's first optimizer step: the recomputed
`inputs.old_logprobs_BT` when given, otherwise the detached current policy (exact while no
step has been taken; the ratio pi_theta / pi_old is then 1 in value). In 'mask_only'
mode the masking ones keep only their rule, judged on pi_theta / mu, on PPO against mu.

| name      | weight on the PPO term                 | dropped                          | denominator | source |
|-----------|----------------------------------------|----------------------------------|-------------|--------|
| naive     | 1 (mu unused)                          | -                                | all tokens  | async GRPO without a rollout correction (verl / slime defaults) |
| tis       | min(rho, C)                            | -                                | all tokens  | Yao et al. 2025; verl token_is |
| icepop    | rho inside [lo, hi], else 0            | (weight 0 outside the band)      | all tokens  | Ring-1T (arXiv:2510.18855) |
| mis_token | rho inside [lo, hi]                    | tokens outside                   | kept only   | verl token IS + token rejection |
| mis_seq   | prod_t rho_t inside [lo, hi]           | whole sequences outside          | kept only   | verl decoupled_seq_is_rs (Seq-MIS) |
| mis_geo   | 1                                      | sequences, exp(mean log rho)     | kept only   | verl geo_rs |
| decoupled | pi_prox / mu, 'drop' above the cap      | tokens above the cap ('drop')    | all tokens  | AReaL (arXiv:2505.24298) |
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from entr_megatron.algorithm.correction_base import (
    CorrectionInputs,
    CorrectionOutput,
    TokenInputs,
    baseline_anchor,
    finish,
    judged_log_rho,
    log_band,
    prepare_inputs,
    published,
)
from entr_megatron.algorithm.masked_ops import masked_fraction, sequence_mean, sequence_sum
from entr_megatron.config.algorithm import AlgorithmConfig


def none_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """No correction: weight 1, keep every token, plain PPO against mu ("GRPO async")."""
    x = prepare_inputs(inputs, use_old=False)
    return finish("none", x, cfg, torch.ones_like(x.delta_BT), x.valid_BT, x.behaviour_BT)


def naive_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """The behaviour policy ignored: weight 1, every token kept, PPO against pi_old (the learner's
    own recomputed log-probs), as an asynchronous GRPO runs in verl or slime without a rollout
    correction. Stale or mismatched samples are trained as if they were on-policy: with one
    optimizer step per batch the ratio is 1 and the update is A grad log pi on every token."""
    x = prepare_inputs(inputs)
    return finish("naive", x, cfg, torch.ones_like(x.delta_BT), x.valid_BT, x.ratio_source_BT)


def tis_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; verl PR #2953): w = min(pi_old / mu, C), C = tis_cap
    (2), multiplied on PPO against pi_old (after its clip); every token kept. cfg.tis_level
    'sequence': w = min(prod_t pi_old / mu, C) on every token of the sequence (TRL's
    sequence_truncate; the product in log space, clamped at log C before exp)."""
    x = prepare_inputs(inputs)
    if cfg.tis_level == "sequence":
        seq_log_rho_B = sequence_sum(x.log_rho_BT, x.valid_BT).clamp(max=math.log(cfg.tis_cap))
        weight_BT = seq_log_rho_B.exp().unsqueeze(-1).expand_as(x.delta_BT)
    else:
        weight_BT = x.log_rho_BT.exp().clamp(max=cfg.tis_cap)
    return finish("tis", x, cfg, weight_BT, x.valid_BT, x.ratio_source_BT)


def decoupled_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Decoupled PPO (AReaL, arXiv:2505.24298; areal/utils/functional ppo_actor_loss_fn):
    w = pi_prox / mu on PPO against pi_prox, pi_prox = pi_old. decoupled_cap_mode 'drop'
    (AReaL's behav_imp_weight_cap): a token with w > decoupled_cap gets weight 0, still
    counted in the denominator; 'clamp': w = min(w, cap), as TIS. mask_only: drop
    pi_theta / mu > cap, weight 1, PPO against mu."""
    x = prepare_inputs(inputs)
    log_rho_BT = judged_log_rho(x, cfg)
    weight_BT = log_rho_BT.exp() if published(cfg) else torch.ones_like(log_rho_BT)
    keep_BT = x.valid_BT
    if cfg.decoupled_cap_mode == "clamp" and published(cfg):
        weight_BT = weight_BT.clamp(max=cfg.decoupled_cap)
    else:
        keep_BT = keep_BT & (log_rho_BT <= math.log(cfg.decoupled_cap))
    return finish("decoupled", x, cfg, weight_BT, keep_BT, baseline_anchor(x, cfg))


def _band_keep(log_value: Tensor, band: tuple[float, float]) -> Tensor:
    lo, hi = log_band(band)
    return (log_value >= lo) & (log_value <= hi)


def _token_band(name: str, x: TokenInputs, cfg: AlgorithmConfig, band: tuple[float, float]) -> CorrectionOutput:
    """Keep tokens whose rho lies inside the band; as published their weight is rho (masked IS)."""
    log_rho_BT = judged_log_rho(x, cfg)
    keep_BT = _band_keep(log_rho_BT, band)
    # Outside the band the weight is never used (the token is dropped): no overflow from exp.
    inside_BT = torch.where(keep_BT, log_rho_BT, torch.zeros_like(log_rho_BT))
    weight_BT = inside_BT.exp() if published(cfg) else torch.ones_like(log_rho_BT)
    return finish(name, x, cfg, weight_BT, keep_BT, baseline_anchor(x, cfg))


def _sequence_band(name: str, x: TokenInputs, cfg: AlgorithmConfig, seq_log_rho_B: Tensor,
                   band: tuple[float, float], weighted: bool) -> CorrectionOutput:
    """Keep whole sequences whose sequence-level log-ratio lies inside the band; `weighted`
    (and published): every token of a kept sequence carries exp(seq_log_rho)."""
    keep_B = _band_keep(seq_log_rho_B, band)
    nonempty_B = x.valid_BT.any(dim=-1)
    metrics = {f"{name}/seq_mask_fraction": masked_fraction(~keep_B, nonempty_B)}
    keep_BT = keep_B.unsqueeze(-1) & x.valid_BT
    if weighted and published(cfg):
        weight_B = torch.where(keep_B, seq_log_rho_B, torch.zeros_like(seq_log_rho_B)).exp()
        weight_BT = weight_B.unsqueeze(-1).expand_as(x.delta_BT)
    else:
        weight_BT = torch.ones_like(x.delta_BT)
    return finish(name, x, cfg, weight_BT, keep_BT, baseline_anchor(x, cfg), metrics)


def mis_token_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Token-level masked IS (verl rollout correction: token IS weights truncated at 2 with
    token rejection, lower bound 1 / upper): weight rho_t = pi_old / mu inside
    cfg.mis_token_band (default [0.5, 2]), tokens outside dropped and removed from the
    denominator (verl multiplies the response mask by the rejection mask)."""
    x = prepare_inputs(inputs)
    return _token_band("mis_token", x, cfg, cfg.mis_token_band)


def mis_seq_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Sequence-level masked IS (Seq-MIS, Liu et al. 2025 "When speed kills stability"; verl's
    decoupled_seq_is_rs): rho_i = prod_t pi_old / mu over the sequence's tokens; inside
    cfg.mis_seq_band (default [0.5, 2]) every token of it carries weight rho_i, outside the
    whole sequence is dropped and leaves the denominator."""
    x = prepare_inputs(inputs)
    seq_log_rho_B = sequence_sum(judged_log_rho(x, cfg), x.valid_BT)
    return _sequence_band("mis_seq", x, cfg, seq_log_rho_B, cfg.mis_seq_band, weighted=True)


def mis_geo_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """Geometric rejection sampling (verl's geo_rs presets, rs_threshold "0.999_1.001"): drop a
    whole sequence when exp(mean_t log pi_old / mu) is outside cfg.mis_geo_band (default
    [0.999, 1.001]); weight 1; dropped sequences leave the denominator."""
    x = prepare_inputs(inputs)
    seq_log_rho_B = sequence_mean(judged_log_rho(x, cfg), x.valid_BT)
    return _sequence_band("mis_geo", x, cfg, seq_log_rho_B, cfg.mis_geo_band, weighted=False)


def icepop_correction(inputs: CorrectionInputs, cfg: AlgorithmConfig) -> CorrectionOutput:
    """IcePop (Ring-1T, arXiv:2510.18855): each token's PPO term (ratio pi_theta / pi_old) is
    weighted by M(k) = k for k = pi_old / mu inside cfg.icepop_band [alpha, beta] = [0.5, 5]
    and 0 outside; every response token stays in the denominator (verl's "0.5_5.0" IS
    weights, slime's icepop_function). The magnitude-only band ENTR is compared against."""
    x = prepare_inputs(inputs)
    return _token_band("icepop", x, cfg, cfg.icepop_band)

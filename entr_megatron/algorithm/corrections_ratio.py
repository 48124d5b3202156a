"""Baselines that act on the importance ratio rho = pi_src / mu (magnitude only).

pi_src is the recomputed old policy when `old_logprobs_BT` is given, otherwise the
detached current policy ("bypass mode": no extra forward pass). The masking
baselines (mis_*, icepop) then run PPO against pi_old if it exists, else against mu.
"""

from __future__ import annotations

import torch
from torch import Tensor

from entr_megatron.algorithm.correction_base import CorrectionOutput, TokenInputs, finish, log_band, prepare_inputs
from entr_megatron.algorithm.masked_ops import masked_fraction, sequence_mean, sequence_sum
from entr_megatron.config.algorithm import AlgorithmConfig


def none_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """No correction: weight 1, keep every token, plain PPO against mu ("GRPO async")."""
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, None)
    return finish("none", x, torch.ones_like(x.delta_BT), x.valid_BT, x.behaviour_BT)


def tis_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """Truncated importance sampling (Yao et al.): w = min(pi_src / mu, tis_cap), keep all,
    PPO against pi_src (ratio 1 in value in bypass mode)."""
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, old_logprobs_BT)
    weight_BT = x.log_rho_BT.exp().clamp(max=cfg.tis_cap)
    return finish("tis", x, weight_BT, x.valid_BT, x.ratio_source_BT)


def decoupled_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """Decoupled PPO (AReaL): w = min(pi_prox / mu, decoupled_cap), keep all, PPO against
    pi_prox. `old_logprobs_BT` must hold the proximal policy's log-probs."""
    if old_logprobs_BT is None:
        raise ValueError(
            "correction 'decoupled' requires old_logprobs_BT: the proximal policy's log-probs "
            "from an extra forward pass before the update"
        )
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, old_logprobs_BT)
    weight_BT = x.log_rho_BT.exp().clamp(max=cfg.decoupled_cap)
    return finish("decoupled", x, weight_BT, x.valid_BT, x.ratio_source_BT)


def _token_band(name: str, x: TokenInputs, band: tuple[float, float]) -> CorrectionOutput:
    """Mask tokens whose rho lies outside the band; weight 1."""
    lo, hi = log_band(band)
    log_rho_BT = x.log_rho_BT
    keep_BT = (log_rho_BT >= lo) & (log_rho_BT <= hi)
    return finish(name, x, torch.ones_like(log_rho_BT), keep_BT, x.rejection_anchor_BT)


def _sequence_band(name: str, x: TokenInputs, seq_log_rho_B: Tensor, band: tuple[float, float]) -> CorrectionOutput:
    """Mask whole sequences whose sequence-level log-ratio lies outside the band; weight 1."""
    lo, hi = log_band(band)
    keep_B = (seq_log_rho_B >= lo) & (seq_log_rho_B <= hi)
    nonempty_B = x.valid_BT.any(dim=-1)
    metrics = {f"{name}/seq_mask_fraction": masked_fraction(~keep_B, nonempty_B)}
    keep_BT = keep_B.unsqueeze(-1) & x.valid_BT
    return finish(name, x, torch.ones_like(x.delta_BT), keep_BT, x.rejection_anchor_BT, metrics)


def mis_token_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """Masked IS per token (verl rollout_rs "token"): drop tokens with rho outside
    cfg.mis_token_band (default [0.5, 2])."""
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, old_logprobs_BT)
    return _token_band("mis_token", x, cfg.mis_token_band)


def mis_seq_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """Masked IS per sequence (verl "seq"): drop a whole sequence when prod_t rho_t, i.e.
    exp(sum of log rho over its valid tokens), is outside cfg.mis_seq_band (default [0.5, 2])."""
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, old_logprobs_BT)
    return _sequence_band("mis_seq", x, sequence_sum(x.log_rho_BT, x.valid_BT), cfg.mis_seq_band)


def mis_geo_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """Masked IS, geometric mean (verl "geo"): drop a whole sequence when
    exp(mean of log rho over its valid tokens) is outside cfg.mis_geo_band (default [0.5, 2])."""
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, old_logprobs_BT)
    return _sequence_band("mis_geo", x, sequence_mean(x.log_rho_BT, x.valid_BT), cfg.mis_geo_band)


def icepop_correction(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
) -> CorrectionOutput:
    """IcePop (Ring-1T): drop tokens with rho outside cfg.icepop_band (default [0.5, 5]).
    The magnitude-only band ENTR is compared against."""
    x = prepare_inputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, old_logprobs_BT)
    return _token_band("icepop", x, cfg.icepop_band)

"""The composed policy objective: correction -> per-token loss -> aggregation, plus metrics.

    policy_loss_terms      CORRECTIONS[cfg.correction] (weight, keep, anchor, denominator, clip)
                           -> POLICY_LOSSES[cfg.policy_loss] (per-token loss, importance weight)
    compute_policy_loss    policy_loss_terms -> aggregate_loss(cfg.aggregation) + mismatch_metrics

The learner (learner/loss.py) calls `policy_loss_terms` and reduces over micro-batches
and ranks itself; `compute_policy_loss` is the one-device whole-batch form.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from entr_megatron.algorithm.aggregation import Count, aggregate_loss
from entr_megatron.algorithm.correction_base import CorrectionInputs
from entr_megatron.algorithm.corrections import CORRECTIONS
from entr_megatron.algorithm.corrections_entr import with_added_mask
from entr_megatron.algorithm.mask_diagnostics import counterfactual_mask_metrics, effective_mask_fraction
from entr_megatron.algorithm.masked_ops import broadcast_to_tokens
from entr_megatron.algorithm.metrics import mismatch_metrics
from entr_megatron.algorithm.policy_losses import POLICY_LOSSES, LossInputs
from entr_megatron.config.algorithm import AlgorithmConfig


class PolicyTerms(NamedTuple):
    """One micro-batch's per-token pieces of the objective; [B, T], detached except loss_BT."""

    loss_BT: Tensor
    """Per-token loss (0 off the kept tokens); the gradient flows through it."""
    denominator_BT: Tensor
    """Tokens the aggregation counts: every response token, or only the kept ones for
    methods that drop rejected tokens from the denominator (cfg.rejected_in_denominator)."""
    keep_mask_BT: Tensor
    """Tokens that carry gradient."""
    is_weight_BT: Tensor
    """Importance weight on each kept token's gradient (policy ratio x correction weight)."""
    metrics: dict[str, Tensor]
    """The correction's and the policy loss's own metrics."""
    entr_score_BT: Tensor | None = None
    """ENTR's score when the correction computed it (CorrectionOutput.entr_score_BT), detached."""


def _check_shapes(response_mask_BT: Tensor, advantages_B: Tensor, **named: Tensor | None) -> None:
    shape = response_mask_BT.shape
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected response_mask_BT's {tuple(shape)}")
    if advantages_B.shape != shape[:1]:
        raise ValueError(f"advantages_B has shape {tuple(advantages_B.shape)}, expected ({shape[0]},)")


def policy_loss_terms(
    logprobs_BT: Tensor,
    entropy_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    advantages_B: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
    versions_BT: Tensor | None = None,
    policy_version: int | None = None,
) -> PolicyTerms:
    """Correction then per-token loss for one micro-batch (see PolicyTerms).

    `old_logprobs_BT` is pi_old for corrections that anchor on it (None: pi_old is the
    current policy, detached). `entropy_BT` is whatever entropy the caller chose
    (cfg.entropy_source); `collision_BT` (1 - sum p^2) only feeds entr_calibrated; `versions_BT`
    (the version that sampled each token) and `policy_version` (the version being trained) feed a3po.
    """
    _check_shapes(response_mask_BT, advantages_B, logprobs_BT=logprobs_BT, entropy_BT=entropy_BT,
                  behaviour_logprobs_BT=behaviour_logprobs_BT, old_logprobs_BT=old_logprobs_BT,
                  collision_BT=collision_BT)
    mask_BT = response_mask_BT.bool()
    advantages_BT = broadcast_to_tokens(advantages_B, mask_BT)
    inputs = CorrectionInputs(logprobs_BT, behaviour_logprobs_BT, entropy_BT, mask_BT, old_logprobs_BT, collision_BT,
                              versions_BT, policy_version, advantages_BT)
    correction = CORRECTIONS[cfg.correction](inputs, cfg)
    if cfg.add_entr_mask or cfg.add_random_mask:
        correction = with_added_mask(correction, inputs, cfg)
    loss = POLICY_LOSSES[cfg.policy_loss](
        LossInputs(logprobs_BT, correction.anchor_logprobs_BT, advantages_BT,
                   correction.weight_BT, correction.keep_mask_BT, mask_BT),
        cfg,
        clip=correction.clip,
    )
    metrics = {**correction.metrics, **loss.metrics}
    if cfg.mask_diagnostics:
        metrics["mask/effective_fraction"] = effective_mask_fraction(inputs, advantages_BT, correction, cfg)
        metrics.update(counterfactual_mask_metrics(inputs, advantages_BT, cfg, correction.entr_score_BT))
    return PolicyTerms(loss.loss_BT, correction.denominator_BT, correction.keep_mask_BT, loss.is_weight_BT, metrics,
                       correction.entr_score_BT)


def compute_policy_loss(
    logprobs_BT: Tensor,
    entropy_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    advantages_B: Tensor,
    response_mask_BT: Tensor,
    cfg: AlgorithmConfig,
    old_logprobs_BT: Tensor | None = None,
    collision_BT: Tensor | None = None,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    versions_BT: Tensor | None = None,
    policy_version: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss and its metrics for one batch on one device.

    `policy_loss_terms`, then aggregate_loss(cfg.aggregation) over the denominator tokens
    with the optional global counts (seq-mean-token-sum-norm divides by
    cfg.loss_norm_tokens, else the padded width T). The gradient flows through
    `logprobs_BT` only. Metrics: the correction's, the loss's (policy_loss/...),
    mismatch_metrics(...) with the keep mask and importance weights, and policy_loss/value.
    """
    terms = policy_loss_terms(logprobs_BT, entropy_BT, behaviour_logprobs_BT, advantages_B, response_mask_BT, cfg,
                              old_logprobs_BT=old_logprobs_BT, collision_BT=collision_BT, versions_BT=versions_BT,
                              policy_version=policy_version)
    loss = aggregate_loss(terms.loss_BT, terms.denominator_BT, cfg.aggregation, num_tokens=num_tokens,
                          num_seqs=num_seqs, max_response_len=cfg.loss_norm_tokens)
    metrics = {
        **terms.metrics,
        **mismatch_metrics(
            logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT.bool(),
            keep_mask_BT=terms.keep_mask_BT, weight_BT=terms.is_weight_BT, eps=cfg.entr_eps,
            entr_score_BT=terms.entr_score_BT,
        ),
        "policy_loss/value": loss.detach(),
    }
    return loss, metrics

"""The composed policy objective: correction -> per-token loss -> aggregation, plus metrics."""

from __future__ import annotations

from torch import Tensor

from entr_megatron.algorithm.aggregation import Count, aggregate_loss
from entr_megatron.algorithm.corrections import CORRECTIONS
from entr_megatron.algorithm.masked_ops import broadcast_to_tokens
from entr_megatron.algorithm.metrics import mismatch_metrics
from entr_megatron.algorithm.policy_losses import POLICY_LOSSES
from entr_megatron.config.algorithm import AlgorithmConfig


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
    max_response_len: Count | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss and its metrics for one micro-batch.

    Runs CORRECTIONS[cfg.correction] (weight, keep mask, ratio anchor), then
    POLICY_LOSSES[cfg.policy_loss] on the advantages spread over response tokens, then
    aggregate_loss(cfg.loss_agg_mode) with the optional global counts. The gradient flows
    through `logprobs_BT` only. `entropy_BT` is whatever entropy the caller chose
    (cfg.entropy_source); `collision_BT` (1 - sum p^2) only feeds entr_calibrated.
    Metrics: the correction's, the loss's (policy_loss/...), mismatch_metrics(...) and
    policy_loss/value.
    """
    shape = response_mask_BT.shape
    named = {"logprobs_BT": logprobs_BT, "entropy_BT": entropy_BT, "behaviour_logprobs_BT": behaviour_logprobs_BT}
    if old_logprobs_BT is not None:
        named["old_logprobs_BT"] = old_logprobs_BT
    if collision_BT is not None:
        named["collision_BT"] = collision_BT
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected response_mask_BT's {tuple(shape)}")
    if advantages_B.shape != shape[:1]:
        raise ValueError(f"advantages_B has shape {tuple(advantages_B.shape)}, expected ({shape[0]},)")

    mask_BT = response_mask_BT.bool()
    correction = CORRECTIONS[cfg.correction](
        logprobs_BT,
        behaviour_logprobs_BT,
        entropy_BT,
        mask_BT,
        cfg,
        old_logprobs_BT=old_logprobs_BT,
        collision_BT=collision_BT,
    )
    loss_BT, loss_metrics = POLICY_LOSSES[cfg.policy_loss](
        logprobs_BT,
        correction.anchor_logprobs_BT,
        broadcast_to_tokens(advantages_B, mask_BT),
        correction.weight_BT,
        correction.keep_mask_BT,
        mask_BT,
        cfg,
    )
    loss = aggregate_loss(
        loss_BT, mask_BT, cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_response_len=max_response_len
    )
    metrics = {
        **correction.metrics,
        **loss_metrics,
        **mismatch_metrics(
            logprobs_BT,
            behaviour_logprobs_BT,
            entropy_BT,
            mask_BT,
            keep_mask_BT=correction.keep_mask_BT,
            weight_BT=correction.weight_BT,
            eps=cfg.entr_eps,
        ),
        "policy_loss/value": loss.detach(),
    }
    return loss, metrics

"""The RL loss on the last pipeline stage, in the form Megatron's schedules expect.

Exact normalisation over micro-batches and data-parallel ranks
----------------------------------------------------------------
The model is built with ``TransformerConfig.calculate_per_token_loss=True`` and
``loss_func`` returns Megatron's 3-tuple ``(numerator, count, report)``. In
megatron-core 0.16.1 that means:

* ``pipeline_parallel/schedules.py`` ``forward_step_calc_loss`` (l. 257-263):
  with 3 values and ``calculate_per_token_loss`` the numerator is backpropagated
  as is: NOT divided by ``count`` nor by ``num_microbatches`` (both divisions sit
  in the ``not calculate_per_token_loss`` branch; a 2-tuple is always divided by
  ``num_microbatches``, l. 264-269).
* every schedule sums the counts of its micro-batches (``total_num_tokens +=
  num_tokens``: no pipelining l. 649/672, interleaved l. 1210, 1F1B l. 2175/2219)
  and passes the sum to ``finalize_model_grads`` (l. 682, 1921, 2313).
* ``distributed/distributed_data_parallel.py`` l. 254-259: with
  ``calculate_per_token_loss`` the DP gradient reduction is a plain SUM
  (``gradient_scaling_factor = 1.0``, dense and expert buffers alike), not a mean.
* ``distributed/finalize_model_grads.py`` l. 484-497: the count is broadcast from
  the last pipeline stage over the PP group, ALL-REDUCED (sum) over the
  data-parallel x context-parallel group, and every gradient is multiplied by
  ``1 / count`` (skipped when the global count is 0: then every numerator is 0).

So the gradient is ``sum_{ranks, micro-batches} d numerator / sum count``: exact
when each micro-batch returns its share of the global numerator and its count of
the global denominator (``_AGGREGATION_PARTS``):

===========================  ======================================  ===============================
mode                         numerator of a micro-batch               count
===========================  ======================================  ===============================
token-mean                   sum of per-token losses                  denominator tokens
seq-mean-token-mean          sum over sequences of their token-mean   sequences with a denominator token
seq-mean-token-sum-norm      sum of per-token losses / L              sequences with a denominator token
===========================  ======================================  ===============================

with ``L`` Dr.GRPO's constant (``AlgorithmConfig.loss_norm_tokens``, the generation
budget) and the denominator tokens every response token, or only the kept ones
for methods that drop rejected tokens (``PolicyTerms.denominator_BT``).
Sequences are never split across micro-batches, so the sequence-level terms are
whole. The numerators come from ``policy_loss_terms`` and ``aggregate_loss`` with
unit global counts (it divides by them). The count must be
an integer tensor (``total_num_tokens`` is ``torch.int``); the counts here are.
Megatron scales MoE auxiliary losses assuming ``count`` is a token count
(``moe/router.py`` l. 456-466), which only holds for token-mean.

Metrics: ``report`` is a ``LossReport`` (loss_report.py) that the train step adds
over micro-batches and data-parallel ranks before dividing, so the loss and the
mismatch metrics (``mismatch_metric_stats``, with the loss's own keep mask and
importance weights) are exact for the global batch; the correction's and policy
loss's own metrics are token-weighted means of their per-micro-batch values
(exact for those that average over all response tokens).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

from entr_megatron.algorithm import aggregate_loss, mismatch_metric_stats, policy_loss_terms
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.learner.batching import MicroBatch
from entr_megatron.learner.fused_output import fused_loss_applies, fused_policy_loss
from entr_megatron.learner.loss_report import LossReport
from entr_megatron.parallel.fused_output import vocab_parallel_linear_logprobs_entropy
from entr_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = ["make_logprob_loss_func", "make_policy_loss_func", "packed_logprobs_entropy"]


def packed_logprobs_entropy(output_bsx: Tensor, mb: MicroBatch, tp_group, learner_cfg: LearnerConfig,
                            vocab_size: int | None = None, collision: bool = False,
                            temperature: float = 1.0, output_weight: Tensor | None = None) -> tuple[Tensor, ...]:
    """Per-position ``[T]`` log-prob of the next token and entropy from the vocab-sharded logits
    (and, with ``collision``, 1 - sum p^2, in the same pass).

    ``output_bsx`` is what ``GPTModel.forward`` returns without labels: the logits ``[b=1, s=T, V/tp]``
    (it transposes the output layer's ``[s, b, V/tp]``), or with ``output_weight`` (the fused output
    layer, `learner.fused_output`) the hidden states ``[1, T, h]`` and this rank's ``[V/tp, h]``
    output weight, multiplied tile by tile inside the op. Every TP rank holds its contiguous
    vocabulary shard; nothing is gathered. ``vocab_size``: the true vocabulary; Megatron's
    padding columns beyond it stay out of the softmax. ``temperature``: the rollouts' sampling
    temperature T, the distribution is softmax(z / T). Entropy is returned detached: no loss
    here differentiates it, so its backward is skipped.
    """
    width = "h" if output_weight is not None else "V/tp"
    if output_bsx.dim() != 3 or output_bsx.shape[:2] != (1, mb.length):
        raise ValueError(f"expected model output [1, {mb.length}, {width}] (b, s, ...), got {tuple(output_bsx.shape)}")
    targets = mb.targets[0].to(output_bsx.device)
    if output_weight is None:
        out = vocab_parallel_logprobs_entropy(output_bsx[0], targets, tp_group, temperature,
                                              learner_cfg.logprob_chunk_size, vocab_size, return_collision=collision)
    else:  # Float16Module hands the last stage's output back in fp32: the layer's own dtype again (lossless)
        out = vocab_parallel_linear_logprobs_entropy(
            output_bsx[0].to(output_weight.dtype), output_weight, targets, tp_group, temperature, vocab_size,
            chunk_tokens=learner_cfg.logprob_chunk_size, return_collision=collision,
            backend=learner_cfg.fused_output_backend)
    return (out[0], out[1].detach(), *out[2:])


def _token_mean_parts(mask_BT: Tensor) -> tuple[dict, Tensor]:
    return {"num_tokens": 1}, mask_BT.sum()


def _seq_mean_token_mean_parts(mask_BT: Tensor) -> tuple[dict, Tensor]:
    return {"num_seqs": 1}, mask_BT.any(dim=-1).sum()


def _seq_mean_token_sum_norm_parts(mask_BT: Tensor) -> tuple[dict, Tensor]:
    return {"num_seqs": 1}, mask_BT.any(dim=-1).sum()


# aggregation -> (aggregate_loss kwargs that make it return this micro-batch's numerator,
# the count Megatron sums into the global denominator). Keys: config.algorithm.LOSS_AGG_MODES.
_AGGREGATION_PARTS: dict[str, Callable[[Tensor], tuple[dict, Tensor]]] = {
    "token-mean": _token_mean_parts,
    "seq-mean-token-mean": _seq_mean_token_mean_parts,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm_parts,
}


def _entropy_for_algorithm(mb: MicroBatch, learner_entropy_BT: Tensor, cfg: AlgorithmConfig) -> Tensor:
    if cfg.entropy_source == "learner":
        return learner_entropy_BT
    if mb.rollout_entropy_BT is None:
        raise ValueError("AlgorithmConfig.entropy_source='rollout' but the batch has no rollout_entropy_T "
                         "(the engine must return per-token entropy)")
    return mb.rollout_entropy_BT.to(learner_entropy_BT.device)


def make_policy_loss_func(mb: MicroBatch, tp_group, algo_cfg: AlgorithmConfig, learner_cfg: LearnerConfig, *,
                          vocab_size: int | None = None, temperature: float = 1.0,
                          old_logprobs_T: Tensor | None = None) -> Callable[[Tensor], tuple[Tensor, Tensor, dict]]:
    """Megatron ``loss_func`` of one micro-batch: ``logits [1, T, V/tp] -> (numerator, count, report)``
    (or hidden states and ``output_weight``: `packed_logprobs_entropy`).

    Args:
        mb: the micro-batch the logits belong to.
        tp_group: tensor-parallel group of the vocab shards (``groups.tp``).
        vocab_size: the true (unpadded) vocabulary size; None: every column is real.
        temperature: the rollouts' sampling temperature (log-probs of softmax(z / T)).
        old_logprobs_T: pi_old in the DP-local batch's packed layout (``compute_logprobs``) for
            corrections that anchor on it; None: the current policy, detached (exact before
            the rollout batch's first optimizer step).

    See the module docstring for why (numerator, count) is exact under Megatron's schedules.
    """
    aggregation = algo_cfg.aggregation
    parts = _AGGREGATION_PARTS[aggregation]
    if aggregation == "seq-mean-token-sum-norm" and algo_cfg.loss_norm_tokens is None:
        raise ValueError("AlgorithmConfig.loss_agg_mode='seq-mean-token-sum-norm' needs loss_norm_tokens, Dr.GRPO's "
                         "constant divisor (a run sets it to rollout.sampling.max_new_tokens)")
    wants_collision = algo_cfg.correction == "entr_calibrated"
    # Token-local losses on the fused output layer: gradients in the forward pass (learner/fused_output.py).
    fuse_loss = learner_cfg.fused_output and fused_loss_applies(algo_cfg)

    def loss_func(output_bsx: Tensor, output_weight: Tensor | None = None) -> tuple[Tensor, Tensor, dict]:
        device = output_bsx.device
        count_dtype = torch.int  # Megatron's total_num_tokens is torch.int
        if mb.num_seqs == 0:
            # Padding-only micro-batch: contributes nothing, but backward must still reach the model.
            zero = output_bsx.sum() * 0.0
            return zero, torch.zeros([], dtype=count_dtype, device=device), LossReport()
        blp_BT = mb.behaviour_logprobs_BT.to(device)
        old_BT = None if old_logprobs_T is None else mb.padded_from_batch(old_logprobs_T.to(device))
        versions_BT = None if mb.versions_BT is None else mb.versions_BT.to(device)
        fused = fuse_loss and output_weight is not None
        if fused:  # the numerator and its gradient from the op; the terms below are metrics only
            if algo_cfg.entropy_source == "rollout":
                _entropy_for_algorithm(mb, blp_BT, algo_cfg)  # the missing-entropy error, before the op
            numerator, *out = fused_policy_loss(
                output_bsx, output_weight, mb, tp_group, algo_cfg, behaviour_BT=blp_BT,
                rollout_entropy_BT=mb.rollout_entropy_BT, old_BT=old_BT, versions_BT=versions_BT,
                vocab_size=vocab_size, temperature=temperature, chunk_tokens=learner_cfg.logprob_chunk_size,
                backend=learner_cfg.fused_output_backend)
        else:
            out = packed_logprobs_entropy(output_bsx, mb, tp_group, learner_cfg, vocab_size, collision=wants_collision,
                                          temperature=temperature, output_weight=output_weight)
        logprobs_T, entropy_T = out[0], out[1]
        mask_BT = mb.response_mask_BT.to(device)
        lp_BT = mb.to_padded(logprobs_T)
        learner_entropy_BT = mb.to_padded(entropy_T)
        entropy_BT = _entropy_for_algorithm(mb, learner_entropy_BT, algo_cfg)
        collision_BT = mb.to_padded(out[2]) if wants_collision else None
        with torch.no_grad() if fused else contextlib.nullcontext():
            terms = policy_loss_terms(lp_BT, entropy_BT, blp_BT, mb.advantages_B.to(device), mask_BT, algo_cfg,
                                      old_logprobs_BT=old_BT, collision_BT=collision_BT, versions_BT=versions_BT,
                                      policy_version=mb.policy_version)
        unit_counts, count = parts(terms.denominator_BT)
        if not fused:
            numerator = aggregate_loss(terms.loss_BT, terms.denominator_BT, aggregation,
                                       max_response_len=algo_cfg.loss_norm_tokens, **unit_counts)
        views = {"pi": learner_entropy_BT}
        if mb.rollout_entropy_BT is not None:
            views["mu"] = mb.rollout_entropy_BT.to(device)
        labels_BT = None if mb.token_labels_BT is None else mb.token_labels_BT.to(device)
        stats = mismatch_metric_stats(
            lp_BT, blp_BT, entropy_BT, mask_BT, keep_mask_BT=terms.keep_mask_BT, weight_BT=terms.is_weight_BT,
            eps=algo_cfg.entr_eps, entropy_views=views, token_labels_BT=labels_BT, entr_score_BT=terms.entr_score_BT,
        )
        report = LossReport.of_microbatch(numerator, count, terms, stats, tokens=mask_BT.sum())
        return numerator, count.to(count_dtype), report

    return loss_func


def make_logprob_loss_func(mb: MicroBatch, index: int, tp_group, learner_cfg: LearnerConfig,
                           vocab_size: int | None = None,
                           temperature: float = 1.0) -> Callable[[Tensor], tuple[Tensor, Tensor, dict]]:
    """Forward-only ``loss_func``: reports the micro-batch's per-position log-probs and entropy.

    The report is ``{"index": index, "logprobs": [T], "entropy": [T]}`` in the micro-batch's
    packed layout; the scalar loss is 0 (nothing is backpropagated in forward-only mode).
    """

    def loss_func(output_bsx: Tensor, output_weight: Tensor | None = None) -> tuple[Tensor, Tensor, dict]:
        logprobs_T, entropy_T = packed_logprobs_entropy(output_bsx, mb, tp_group, learner_cfg, vocab_size,
                                                        temperature=temperature, output_weight=output_weight)
        zero = torch.zeros([], dtype=output_bsx.dtype, device=output_bsx.device)
        count = torch.zeros([], dtype=torch.int, device=output_bsx.device)
        return zero, count, {"index": index, "logprobs": logprobs_T.detach(), "entropy": entropy_T}

    return loss_func

"""What a mask did, on the tokens it was applied to: the effective mask and every rule's mask.

A logged mask fraction overstates a rule's effect: with PPO-clip, a token the rule drops
may carry no gradient anyway (its ratio is clipped, or its advantage is 0). And mask
fractions of different runs are not comparable, since each run drifts its own way. So,
per micro-batch, on the same tokens:

- `mask/effective_fraction`: valid tokens the correction drops that WOULD carry a gradient
  under the same loss without the drop (their per-token gradient is non-zero with the
  token kept). Tested by autograd on a detached copy of the log-probs: exact for any loss.
- `counterfactual/<rule>/mask_fraction`: the tokens each rule of COUNTERFACTUAL_RULES would
  drop here, judged as in `mask_only` mode (pi_theta against mu, the comparison every rule
  can make on the same tokens) with the run's settings of that rule (the defaults unless
  changed). `tis` drops nothing: its entry counts the tokens whose weight it truncates
  (pi_theta / mu > tis_cap), its band edge. `dppo` is DPPO's Binary-TV trust region against mu
  (its mask is signed by the advantage), at its thresholds of `dppo_tv` (0.15 unless the run is
  dppo_tv with other clip widths).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from entr_megatron.algorithm.correction_base import CorrectionInputs, CorrectionOutput
from entr_megatron.algorithm.corrections import CORRECTIONS
from entr_megatron.algorithm.masked_ops import masked_fraction
from entr_megatron.algorithm.policy_loss_base import LossInputs
from entr_megatron.algorithm.policy_losses import POLICY_LOSSES
from entr_megatron.algorithm.policy_losses_dppo import dppo_keep_mask
from entr_megatron.config.algorithm import CLIP_RANGE_DEFAULTS, AlgorithmConfig

COUNTERFACTUAL_RULES: tuple[str, ...] = ("entr", "icepop", "tis", "m2po", "kpop", "dppo")
"""The rules whose masks every training step reports on its own tokens (issue: "the 10x claim")."""


def effective_mask_fraction(inputs: CorrectionInputs, advantages_BT: Tensor, correction: CorrectionOutput,
                            cfg: AlgorithmConfig) -> Tensor:
    """Fraction of valid tokens that the correction drops and that would carry a gradient if it
    kept them: d loss_t / d log pi_t != 0 under cfg.policy_loss with the correction's anchor and
    clip and every token kept (weight 1 where it dropped: only zero vs non-zero matters)."""
    valid_BT = inputs.response_mask_BT.bool()
    dropped_BT = valid_BT & ~correction.keep_mask_BT
    if not bool(dropped_BT.any()):
        return masked_fraction(dropped_BT, valid_BT)
    with torch.enable_grad():
        logprobs_BT = inputs.logprobs_BT.detach().to(correction.anchor_logprobs_BT.dtype).requires_grad_()
        weight_BT = torch.where(correction.keep_mask_BT, correction.weight_BT, torch.ones_like(correction.weight_BT))
        out = POLICY_LOSSES[cfg.policy_loss](
            LossInputs(logprobs_BT, correction.anchor_logprobs_BT, advantages_BT, weight_BT, valid_BT, valid_BT),
            cfg, clip=correction.clip)
        (grad_BT,) = torch.autograd.grad(out.loss_BT.sum(), logprobs_BT)
    return masked_fraction(dropped_BT & (grad_BT != 0), valid_BT)


def counterfactual_mask_metrics(inputs: CorrectionInputs, advantages_BT: Tensor, cfg: AlgorithmConfig,
                                entr_score_BT: Tensor | None = None) -> dict[str, Tensor]:
    """`counterfactual/<rule>/mask_fraction` for every rule of COUNTERFACTUAL_RULES on these
    tokens (see the module docstring). `entr_score_BT`: ENTR's score on these tokens when the run's
    correction already computed it (the entr rule then reads it instead of computing it again)."""
    valid_BT = inputs.response_mask_BT.bool()
    same_tokens = inputs._replace(old_logprobs_BT=None)
    metrics = {}
    for rule in COUNTERFACTUAL_RULES:
        if rule == "tis":
            delta_BT = (inputs.logprobs_BT - inputs.behaviour_logprobs_BT).detach()
            dropped_BT = valid_BT & (delta_BT > torch.log(torch.tensor(cfg.tis_cap, dtype=delta_BT.dtype)))
        elif rule == "entr" and entr_score_BT is not None:
            dropped_BT = valid_BT & ~(entr_score_BT <= cfg.tau)
        elif rule == "dppo":
            low, high = cfg.clip_range("dppo_tv") if cfg.policy_loss == "dppo_tv" else CLIP_RANGE_DEFAULTS["dppo_tv"]
            dropped_BT = valid_BT & ~dppo_keep_mask(inputs.logprobs_BT, inputs.behaviour_logprobs_BT, advantages_BT,
                                                    low, high, "tv")
        else:
            rule_cfg = dataclasses.replace(cfg, correction=rule, correction_mode="mask_only",
                                           rejected_in_denominator=None, add_entr_mask=False,
                                           add_random_mask=False)
            dropped_BT = valid_BT & ~CORRECTIONS[rule](same_tokens, rule_cfg).keep_mask_BT
        metrics[f"counterfactual/{rule}/mask_fraction"] = masked_fraction(dropped_BT, valid_BT)
    return metrics

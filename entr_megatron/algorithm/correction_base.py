"""The one interface every off-policy correction implements, and what they share.

A correction looks at the detached log-probs of the learner (pi_theta), of the
behaviour policy that sampled each token (mu, per token, any version) and
optionally of a recomputed old/proximal policy, and returns:

- weight_BT: a detached per-token factor on the loss (1 when it only masks),
- keep_mask_BT: True where the token contributes (always False at padding),
- anchor_logprobs_BT: the denominator of the policy ratio r = exp(logprobs - anchor),
- denominator_BT: the tokens the loss aggregation counts (cfg.counts_rejected),
- clip: whether the policy loss keeps its trust-region clip (M2PO's mask replaces it),
- metrics: scalar tensors, at least `<name>/mask_fraction` over valid tokens.

Two modes (cfg.correction_mode). 'published': each method as its authors define it;
those on CORRECTIONS_ON_OLD_POLICY judge rho = pi_old / mu and run PPO against pi_old,
where pi_old is `old_logprobs_BT` or, when it is None (no optimizer step yet in this
rollout batch), the current policy detached. 'mask_only': only the keep rule, judged on
pi_theta / mu, weight 1, PPO against mu (ENTR's composition).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from entr_megatron.algorithm.masked_ops import float_detached, masked_fraction, masked_max, masked_mean, zero_padding
from entr_megatron.config.algorithm import AlgorithmConfig


class CorrectionOutput(NamedTuple):
    """Result of a correction; all tensors detached, [B, T]."""

    weight_BT: Tensor
    keep_mask_BT: Tensor
    anchor_logprobs_BT: Tensor
    denominator_BT: Tensor
    clip: bool
    metrics: dict[str, Tensor]
    entr_score_BT: Tensor | None = None
    """ENTR's score delta^2 / (H + eps) on these tokens when the correction computed it (entr, or
    any correction with add_entr_mask or add_random_mask), for the metrics and diagnostics to reuse."""


class CorrectionInputs(NamedTuple):
    """What a correction sees of one micro-batch; [B, T]."""

    logprobs_BT: Tensor
    """The learner's current log-probs, pi_theta (read detached)."""
    behaviour_logprobs_BT: Tensor
    """mu: the engine's log-probs at the moment it sampled each token."""
    entropy_BT: Tensor
    """The entropy ENTR divides by (cfg.entropy_source)."""
    response_mask_BT: Tensor
    """True at the response tokens the loss sees."""
    old_logprobs_BT: Tensor | None = None
    """pi_old, the policy before the rollout batch's first optimizer step; None: the current one."""
    collision_BT: Tensor | None = None
    """1 - sum_j p_j^2 of the learner, for entr_calibrated; None: its bound 1 - exp(-H)."""
    versions_BT: Tensor | None = None
    """The policy version that sampled each token (a3po); None: not known."""
    policy_version: int | None = None
    """The version of the weights being trained (a3po's v_theta); None: not known."""
    advantages_BT: Tensor | None = None
    """Each token's advantage, for rules signed by it (opsm); None: not given."""


CorrectionFn = Callable[[CorrectionInputs, AlgorithmConfig], CorrectionOutput]
"""fn(inputs, cfg) -> CorrectionOutput."""


class TokenInputs(NamedTuple):
    """Detached inputs in one float dtype (>= float32), zeroed at padding so garbage
    there (e.g. -inf) cannot turn into NaN."""

    logprobs_BT: Tensor
    behaviour_BT: Tensor
    entropy_BT: Tensor
    valid_BT: Tensor
    old_BT: Tensor | None

    @property
    def delta_BT(self) -> Tensor:
        """log pi_theta - log mu, the deviation ENTR judges."""
        return self.logprobs_BT - self.behaviour_BT

    @property
    def ratio_source_BT(self) -> Tensor:
        """Numerator of the importance ratio rho = pi_src / mu: the old policy when it was
        recomputed, otherwise the current policy ("bypass mode", no extra forward pass)."""
        return self.logprobs_BT if self.old_BT is None else self.old_BT

    @property
    def log_rho_BT(self) -> Tensor:
        """log rho = log pi_src - log mu."""
        return self.ratio_source_BT - self.behaviour_BT



def prepare_inputs(inputs: CorrectionInputs, use_old: bool = True) -> TokenInputs:
    """Detach, upcast to a common float dtype (>= float32), zero the padding. `use_old=False`:
    ignore pi_old (the methods that compare pi_theta with mu directly)."""
    old = inputs.old_logprobs_BT if use_old else None
    tensors = [inputs.logprobs_BT, inputs.behaviour_logprobs_BT, inputs.entropy_BT]
    if old is not None:
        tensors.append(old)
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    valid_BT = inputs.response_mask_BT.bool()

    def clean(t: Tensor) -> Tensor:
        return zero_padding(float_detached(t).to(dtype), valid_BT)

    old_BT = None if old is None else clean(old)
    return TokenInputs(clean(inputs.logprobs_BT), clean(inputs.behaviour_logprobs_BT), clean(inputs.entropy_BT),
                       valid_BT, old_BT)


def log_band(band: tuple[float, float]) -> tuple[float, float]:
    """[lo, hi] on ratios -> the same band on log-ratios (lo = 0 maps to -inf). Comparing
    in log space avoids exp overflow of large log-ratios."""
    lo, hi = band
    return (-math.inf if lo == 0 else math.log(lo)), math.log(hi)


def published(cfg: AlgorithmConfig) -> bool:
    return cfg.correction_mode == "published"


def judged_log_rho(x: TokenInputs, cfg: AlgorithmConfig) -> Tensor:
    """The log-ratio a baseline's rule judges: log pi_old / mu as published (pi_old: the
    recomputed old policy, else the current one), log pi_theta / mu in mask_only mode."""
    return x.log_rho_BT if published(cfg) else x.delta_BT


def baseline_anchor(x: TokenInputs, cfg: AlgorithmConfig) -> Tensor:
    """PPO's anchor: pi_old as published (ratio 1 in value before the first update), mu in mask_only mode."""
    return x.ratio_source_BT if published(cfg) else x.behaviour_BT


def finish(
    name: str,
    inputs: TokenInputs,
    cfg: AlgorithmConfig,
    weight_BT: Tensor,
    keep_BT: Tensor,
    anchor_BT: Tensor,
    extra_metrics: dict[str, Tensor] | None = None,
    clip: bool = True,
) -> CorrectionOutput:
    """Restrict keep to valid tokens, zero weights off the kept tokens, pick the denominator
    (cfg.counts_rejected), add the standard metrics: `<name>/mask_fraction` (valid tokens
    dropped), `<name>/weight_mean|max` (kept tokens)."""
    valid_BT = inputs.valid_BT
    keep_BT = keep_BT & valid_BT
    weight_BT = zero_padding(weight_BT.expand_as(valid_BT).to(inputs.logprobs_BT.dtype), keep_BT)
    metrics = {
        f"{name}/mask_fraction": masked_fraction(~keep_BT, valid_BT),
        f"{name}/weight_mean": masked_mean(weight_BT, keep_BT),
        f"{name}/weight_max": masked_max(weight_BT, keep_BT),
    }
    metrics.update(extra_metrics or {})
    denominator_BT = valid_BT if cfg.counts_rejected else keep_BT
    return CorrectionOutput(weight_BT.detach(), keep_BT, anchor_BT.detach(), denominator_BT, clip, metrics)

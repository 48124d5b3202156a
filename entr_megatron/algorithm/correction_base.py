"""The one interface every off-policy correction implements, and what they share.

A correction looks at the detached log-probs of the learner (pi_theta), of the
behaviour policy that sampled each token (mu, per token, any version) and
optionally of a recomputed old/proximal policy, and returns:

- weight_BT: a detached per-token factor on the loss (1 when it only masks),
- keep_mask_BT: True where the token contributes (always False at padding),
- anchor_logprobs_BT: the denominator of the policy ratio r = exp(logprobs - anchor),
- metrics: scalar tensors, at least `<name>/mask_fraction` over valid tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from entr_megatron.algorithm.masked_ops import float_detached, masked_fraction, masked_max, masked_mean, zero_padding
from entr_megatron.config.algorithm import AlgorithmConfig


class CorrectionOutput(NamedTuple):
    """Result of a correction; all tensors detached, [B, T]."""

    weight_BT: Tensor
    keep_mask_BT: Tensor
    anchor_logprobs_BT: Tensor
    metrics: dict[str, Tensor]


class CorrectionFn(Protocol):
    """fn(logprobs_BT, behaviour_logprobs_BT, entropy_BT, response_mask_BT, cfg,
    old_logprobs_BT=None, collision_BT=None) -> CorrectionOutput."""

    def __call__(
        self,
        logprobs_BT: Tensor,
        behaviour_logprobs_BT: Tensor,
        entropy_BT: Tensor,
        response_mask_BT: Tensor,
        cfg: AlgorithmConfig,
        old_logprobs_BT: Tensor | None = None,
        collision_BT: Tensor | None = None,
    ) -> CorrectionOutput: ...


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

    @property
    def rejection_anchor_BT(self) -> Tensor:
        """Anchor of the masking baselines: PPO against pi_old when recomputed, else mu."""
        return self.behaviour_BT if self.old_BT is None else self.old_BT


def prepare_inputs(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    old_logprobs_BT: Tensor | None,
) -> TokenInputs:
    """Detach, upcast to a common float dtype (>= float32), zero the padding."""
    tensors = [logprobs_BT, behaviour_logprobs_BT, entropy_BT]
    if old_logprobs_BT is not None:
        tensors.append(old_logprobs_BT)
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    valid_BT = response_mask_BT.bool()

    def clean(t: Tensor) -> Tensor:
        return zero_padding(float_detached(t).to(dtype), valid_BT)

    old_BT = None if old_logprobs_BT is None else clean(old_logprobs_BT)
    return TokenInputs(clean(logprobs_BT), clean(behaviour_logprobs_BT), clean(entropy_BT), valid_BT, old_BT)


def log_band(band: tuple[float, float]) -> tuple[float, float]:
    """[lo, hi] on ratios -> the same band on log-ratios (lo = 0 maps to -inf). Comparing
    in log space avoids exp overflow of large log-ratios."""
    lo, hi = band
    return (-math.inf if lo == 0 else math.log(lo)), math.log(hi)


def finish(
    name: str,
    inputs: TokenInputs,
    weight_BT: Tensor,
    keep_BT: Tensor,
    anchor_BT: Tensor,
    extra_metrics: dict[str, Tensor] | None = None,
) -> CorrectionOutput:
    """Restrict keep to valid tokens, zero weights at padding, add the standard metrics:
    `<name>/mask_fraction` (valid tokens dropped), `<name>/weight_mean|max` (kept tokens)."""
    valid_BT = inputs.valid_BT
    keep_BT = keep_BT & valid_BT
    weight_BT = zero_padding(weight_BT.expand_as(valid_BT).to(inputs.logprobs_BT.dtype), valid_BT)
    metrics = {
        f"{name}/mask_fraction": masked_fraction(~keep_BT, valid_BT),
        f"{name}/weight_mean": masked_mean(weight_BT, keep_BT),
        f"{name}/weight_max": masked_max(weight_BT, keep_BT),
    }
    metrics.update(extra_metrics or {})
    return CorrectionOutput(weight_BT.detach(), keep_BT, anchor_BT.detach(), metrics)

"""Mismatch metrics between the learner pi_theta and the behaviour policy mu, every step.

Two stages, so a distributed caller can reduce before dividing:

    stats = mismatch_metric_stats(...)        # local sums / maxima / minima (float64)
    all_reduce(stats.sums, SUM); all_reduce(stats.maxima, MAX); all_reduce(stats.minima, MIN)
    metrics = finalize_mismatch_metrics(stats)

`mismatch_metrics(...)` does both on one rank. Each dict can be reduced as one
stacked tensor: the keys are the same on every rank for the same arguments
(a rank without tokens contributes 0 to sums, -inf to maxima, +inf to minima).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from entr_megatron.algorithm.entr import ENTR_DEFAULT_EPS, entr_score
from entr_megatron.algorithm.masked_ops import float_detached, zero_padding
from entr_megatron.types import TOKEN_LABELS

# Log-spaced entropy bins in nats; a bin holds edges[i] <= H < edges[i+1]. 1e-3 nats
# is a near-deterministic position, 1 nat an open choice; ln(150k vocab) ~ 12 caps the top.
DEFAULT_ENTROPY_BIN_EDGES = (0.0, 1e-3, 1e-2, 1e-1, 1.0, 10.0, math.inf)

# A behaviour probability below this is a "rare" token: where bf16 error in
# probability space inflates |delta| like 1 / p (ENTR.md).
LOW_PROB_THRESHOLD = 1e-3


@dataclass
class MetricStats:
    """Reducible statistics: all-reduce `sums` with SUM, `maxima` with MAX, `minima` with MIN."""

    sums: dict[str, Tensor]
    maxima: dict[str, Tensor]
    minima: dict[str, Tensor]


def entropy_bin_labels(edges: tuple[float, ...]) -> list[str]:
    """Metric labels of the bins, e.g. '0.01-0.1', '10-inf'."""
    return [f"{lo:g}-{hi:g}" for lo, hi in zip(edges[:-1], edges[1:])]


def entropy_bin_index(entropy: Tensor, edges: tuple[float, ...] = DEFAULT_ENTROPY_BIN_EDGES) -> Tensor:
    """The bin of each entropy: i where edges[i] <= H < edges[i+1] (below the first edge: bin 0,
    above the last: the last bin), int64, the shape of `entropy`."""
    inner_edges = torch.tensor(edges[1:-1], dtype=entropy.dtype, device=entropy.device)
    return torch.bucketize(entropy, inner_edges, right=True)


def mismatch_metric_stats(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    keep_mask_BT: Tensor | None = None,
    weight_BT: Tensor | None = None,
    entropy_bins: tuple[float, ...] = DEFAULT_ENTROPY_BIN_EDGES,
    eps: float = ENTR_DEFAULT_EPS,
    entropy_views: dict[str, Tensor] | None = None,
    token_labels_BT: Tensor | None = None,
    entr_score_BT: Tensor | None = None,
) -> MetricStats:
    """Local sums/extrema behind `mismatch_metrics` (same arguments); float64, detached.
    `entr_score_BT`: ENTR's score of these tokens (delta and entropy as here) when the correction
    computed it; else it is computed here."""
    if len(entropy_bins) < 2 or any(b <= a for a, b in zip(entropy_bins[:-1], entropy_bins[1:])):
        raise ValueError(f"entropy_bins={entropy_bins!r} must be at least two strictly increasing edges")
    valid_BT = response_mask_BT.bool()

    def clean(t: Tensor) -> Tensor:
        return zero_padding(float_detached(t).to(torch.float64), valid_BT)

    behaviour, entropy = clean(behaviour_logprobs_BT), clean(entropy_BT)
    delta_BT = clean(logprobs_BT) - behaviour
    valid = valid_BT.to(torch.float64)
    k3_BT = torch.expm1(delta_BT) - delta_BT  # delta is 0 at padding: adds 0
    sums = {
        "tokens": valid.sum(),
        "neg_delta": (-delta_BT).sum(),
        "k3": k3_BT.sum(),
        "abs_delta": delta_BT.abs().sum(),
        "entropy": entropy.sum(),
    }
    dropped = None
    if keep_mask_BT is not None:
        dropped = zero_padding((~keep_mask_BT.bool()).to(torch.float64), valid_BT)
        sums["dropped"] = dropped.sum()
    if keep_mask_BT is not None or weight_BT is not None:
        # Dropped tokens have effective weight 0, so the ESS reflects masking as well.
        effective = valid if weight_BT is None else clean(weight_BT)
        if keep_mask_BT is not None:
            effective = zero_padding(effective, keep_mask_BT.bool())
        sums["weight"], sums["weight_sq"] = effective.sum(), effective.square().sum()

    per_bin = {
        "count": valid,
        "abs_delta": delta_BT.abs(),
        "k3": k3_BT,
        "score": zero_padding(entr_score(delta_BT, entropy, eps) if entr_score_BT is None else clean(entr_score_BT),
                              valid_BT),
        "low_prob": zero_padding((behaviour < math.log(LOW_PROB_THRESHOLD)).to(torch.float64), valid_BT),
    }
    if dropped is not None:
        per_bin["dropped"] = dropped
    sums.update(_entropy_bin_sums(entropy, per_bin, entropy_bins))
    view_stats = {k: per_bin[k] for k in ("count", "abs_delta", "low_prob", "dropped") if k in per_bin}
    for view, view_entropy_BT in (entropy_views or {}).items():
        sums.update(_entropy_bin_sums(clean(view_entropy_BT), view_stats, entropy_bins, prefix=f"entropy_bin_{view}"))
    if token_labels_BT is not None:
        sums.update(_label_sums(token_labels_BT, valid_BT, view_stats))

    # No statistic here needs MAX or MIN today (policy lag is the controller's metric); the
    # reduction keeps both so a future extremum needs no protocol change.
    maxima: dict[str, Tensor] = {}
    minima: dict[str, Tensor] = {}
    return MetricStats(sums, maxima, minima)


def _entropy_bin_sums(
    entropy_BT: Tensor, per_token: dict[str, Tensor], edges: tuple[float, ...], prefix: str = "entropy_bin"
) -> dict[str, Tensor]:
    """Sum of each per-token statistic within each entropy bin, keyed
    '<prefix>/<label>/<stat>'; vectorised with index_add over every token's bin index."""
    return _grouped_sums(entropy_bin_index(entropy_BT, edges), entropy_bin_labels(edges), per_token, prefix)


def _grouped_sums(group_BT: Tensor, names: list[str] | tuple[str, ...], per_token: dict[str, Tensor],
                  prefix: str) -> dict[str, Tensor]:
    """Sum of each per-token statistic over the tokens of each group id (0 .. len(names) - 1;
    other ids, e.g. -1 for unlabelled, are left out), keyed '<prefix>/<name>/<stat>'."""
    group = group_BT.flatten().long()
    inside = (group >= 0) & (group < len(names))
    index = torch.where(inside, group, torch.zeros_like(group))
    sums = {}
    for stat, values_BT in per_token.items():
        values = torch.where(inside, values_BT.flatten(), torch.zeros_like(values_BT.flatten()))
        grouped = values.new_zeros(len(names)).index_add_(0, index, values)
        sums.update({f"{prefix}/{name}/{stat}": value for name, value in zip(names, grouped)})
    return sums


def _label_sums(token_labels_BT: Tensor, valid_BT: Tensor, per_token: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-label sums of the statistics, 'token_label/<label>/<stat>', labels of TOKEN_LABELS
    (ids; -1 is an unlabelled token, which only the totals count)."""
    labels_BT = torch.where(valid_BT, token_labels_BT.to(valid_BT.device).long(),
                            torch.full_like(token_labels_BT, -1, dtype=torch.long, device=valid_BT.device))
    return _grouped_sums(labels_BT, TOKEN_LABELS, per_token, "token_label")


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    return numerator / denominator.clamp(min=1)


def finalize_mismatch_metrics(stats: MetricStats) -> dict[str, Tensor]:
    """Metrics from (possibly all-reduced) stats; every value is a float64 scalar tensor."""
    s = stats.sums
    tokens = s["tokens"]
    metrics = {
        "mismatch/k1": _ratio(s["neg_delta"], tokens),
        "mismatch/k3": _ratio(s["k3"], tokens),
        "mismatch/mean_abs_delta": _ratio(s["abs_delta"], tokens),
        "mismatch/tokens": tokens,
    }
    if "entropy" in s:
        metrics["policy/entropy_mean"] = _ratio(s["entropy"], tokens)
    if "dropped" in s:
        metrics["mask/fraction"] = _ratio(s["dropped"], tokens)
    if "weight" in s:
        ess = s["weight"].square() / (tokens * s["weight_sq"])
        metrics["is/ess"] = torch.where(s["weight_sq"] > 0, ess, torch.zeros_like(ess))
    for key in s:
        if key.startswith(("entropy_bin", "token_label/")) and key.endswith("/count"):
            prefix = key[: -len("count")]
            count = s[key]
            metrics[f"{prefix}count"] = count
            metrics[f"{prefix}mean_abs_delta"] = _ratio(s[f"{prefix}abs_delta"], count)
            for stat, name in (("k3", "k3"), ("score", "mean_score"), ("low_prob", "low_prob_share"),
                               ("dropped", "mask_fraction")):
                if f"{prefix}{stat}" in s:
                    metrics[f"{prefix}{name}"] = _ratio(s[f"{prefix}{stat}"], count)
            if key.startswith("token_label/"):
                metrics[f"{prefix}share"] = _ratio(count, tokens)
    return metrics


def mismatch_metrics(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    entropy_BT: Tensor,
    response_mask_BT: Tensor,
    keep_mask_BT: Tensor | None = None,
    weight_BT: Tensor | None = None,
    entropy_bins: tuple[float, ...] = DEFAULT_ENTROPY_BIN_EDGES,
    eps: float = ENTR_DEFAULT_EPS,
    entropy_views: dict[str, Tensor] | None = None,
    token_labels_BT: Tensor | None = None,
    entr_score_BT: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-step metrics over valid tokens, delta = log pi_theta - log mu:

    - mismatch/k1 = mean(-delta), mismatch/k3 = mean(exp(delta) - 1 - delta) >= 0: estimates
      of KL(mu || pi) from tokens sampled by mu; mismatch/mean_abs_delta; mismatch/tokens.
    - policy/entropy_mean: the learner's mean token entropy H(pi_theta) (collapse watch).
    - mask/fraction: valid tokens dropped (needs keep_mask_BT).
    - is/ess: (sum w)^2 / (n sum w^2) of the effective weights w * keep over the n valid
      tokens, in [0, 1] (needs weight_BT or keep_mask_BT; a missing one counts as 1). Pass
      as weight_BT the importance weight the loss applies (objective.PolicyTerms.is_weight_BT:
      the policy ratio times the correction's weight), not the correction's weight alone.
    - entropy_bin/<lo>-<hi>/{count, mean_abs_delta, k3, mean_score, mask_fraction, low_prob_share}
      per bin edges[i] <= H < edges[i+1] (H below the first edge joins the first bin, above
      the last the last bin); score S = delta^2 / (H + eps) (`entr_score_BT` when the correction
      computed it); low_prob_share: mu(y) < 1e-3.
    - entropy_bin_<view>/<lo>-<hi>/{count, mean_abs_delta, low_prob_share, mask_fraction}: the
      same bins by another entropy, one per `entropy_views` entry ({"mu": H(mu), "pi": H(pi_theta)}
      in the learner), so |delta| and the mask can be read against either entropy whichever
      one the rule divides by.
    - token_label/<label>/{count, share, mean_abs_delta, mask_fraction, low_prob_share} per label of
      types.TOKEN_LABELS (`token_labels_BT`: label ids, -1 unlabelled); share = count / tokens.

    Policy-version lag is not here: the controller computes it where the versions live
    (controller.buffer.lag_metrics).
    """
    stats = mismatch_metric_stats(
        logprobs_BT,
        behaviour_logprobs_BT,
        entropy_BT,
        response_mask_BT,
        keep_mask_BT,
        weight_BT,
        entropy_bins,
        eps,
        entropy_views,
        token_labels_BT,
        entr_score_BT,
    )
    return finalize_mismatch_metrics(stats)

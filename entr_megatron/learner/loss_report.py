"""What a micro-batch's loss tells the train step, as one record added over micro-batches and ranks.

    report = LossReport.of_microbatch(numerator, count, terms, stats)   # in loss_func (loss.py)
    total = LossReport.total(reports)                                   # the step's micro-batches
    total = total.all_reduced(groups)                                   # over data-parallel ranks
    metrics = total.metrics()                                           # exact global metrics

Every field adds up exactly: the loss's numerator and count (Megatron sums both
the same way), the mismatch statistics (sums, maxima, minima: `MetricStats`), and
the correction's and loss's own per-micro-batch means, kept as token-weighted sums
(`weighted`, divided by `tokens` at the end) or, for ``*_max`` metrics, as maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from entr_megatron.algorithm import MetricStats, finalize_mismatch_metrics
from entr_megatron.algorithm.objective import PolicyTerms

__all__ = ["LossReport"]

Number = Tensor | float


def _add(into: dict, new: dict, op) -> None:
    for key, value in new.items():
        into[key] = value if key not in into else op(into[key], value)


@dataclass
class LossReport:
    """Reducible record of one or more micro-batches (see the module docstring)."""

    numerator: Number = 0.0
    """Sum of the loss numerators (the exact loss is numerator / count)."""
    count: Number = 0.0
    """Sum of the counts Megatron divides the gradients by."""
    tokens: Number = 0.0
    """Response tokens: the weights of the per-micro-batch means in `weighted`."""
    mismatch: MetricStats = field(default_factory=lambda: MetricStats({}, {}, {}))
    """Sums, maxima and minima behind algorithm.finalize_mismatch_metrics."""
    weighted: dict[str, Number] = field(default_factory=dict)
    """Per-micro-batch means of the correction's and loss's metrics, times `tokens`."""
    maxima: dict[str, Number] = field(default_factory=dict)
    """The correction's and loss's ``*_max`` metrics."""

    @classmethod
    def of_microbatch(cls, numerator: Tensor, count: Tensor, terms: PolicyTerms, mismatch: MetricStats,
                      tokens: Tensor) -> LossReport:
        """The report of one micro-batch: its numerator and count, its mismatch statistics and
        the metrics of `terms` (detached; maxima of an empty micro-batch are -inf, neutral)."""
        tokens = tokens.double()
        weighted, maxima = {}, {}
        for key, value in terms.metrics.items():
            if key.endswith("_max"):
                maxima[key] = value.detach().double() if tokens > 0 else torch.tensor(-math.inf, dtype=torch.float64)
            else:
                weighted[key] = value.detach().double() * tokens
        return cls(numerator.detach().double(), count.double(), tokens, mismatch, weighted, maxima)

    def add(self, other: LossReport) -> LossReport:
        """The report of both (sums added, maxima and minima kept): in place, returns self."""
        self.numerator = self.numerator + other.numerator
        self.count = self.count + other.count
        self.tokens = self.tokens + other.tokens
        _add(self.mismatch.sums, other.mismatch.sums, lambda a, b: a + b)
        _add(self.mismatch.maxima, other.mismatch.maxima, _maximum)
        _add(self.mismatch.minima, other.mismatch.minima, _minimum)
        _add(self.weighted, other.weighted, lambda a, b: a + b)
        _add(self.maxima, other.maxima, _maximum)
        return self

    @classmethod
    def total(cls, reports: list[LossReport]) -> LossReport:
        """The sum of `reports`, as Python floats (one device sync for all of them)."""
        out = cls()
        for report in reports:
            out.add(report)
        return out.as_floats()

    def as_floats(self) -> LossReport:
        """The same record with every value a Python float."""
        scalars = [self.numerator, self.count, self.tokens]
        groups = [self.mismatch.sums, self.mismatch.maxima, self.mismatch.minima, self.weighted, self.maxima]
        every = scalars + [v for g in groups for v in g.values()]
        # One device sync for the whole record: Python floats join the tensors' device first.
        device = next((v.device for v in every if isinstance(v, Tensor)), torch.device("cpu"))
        flat = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in every]
        values = iter(torch.stack(flat).tolist())
        numerator, count, tokens = next(values), next(values), next(values)
        sums, maxima, minima, weighted, own_maxima = ({k: next(values) for k in g} for g in groups)
        return LossReport(numerator, count, tokens, MetricStats(sums, maxima, minima), weighted, own_maxima)

    def all_reduced(self, groups) -> LossReport:
        """The report of every data-parallel rank (a collective over `groups.dp`). Keys can differ
        between ranks (a rank with only padding micro-batches reports no metrics): the records
        travel as objects."""
        if groups.dp_size == 1:
            return self
        everyone: list[LossReport | None] = [None] * groups.dp_size
        dist.all_gather_object(everyone, self.as_floats(), group=groups.dp)
        out = LossReport()
        for report in everyone:
            out.add(report)
        return out

    def metrics(self) -> dict[str, float]:
        """``loss`` (numerator / count), ``loss/count``, the mismatch metrics, the token-weighted
        means of the correction's and loss's metrics and their maxima."""
        metrics: dict[str, float] = {
            "loss": self.numerator / self.count if self.count > 0 else 0.0,
            "loss/count": float(self.count),
        }
        if self.mismatch.sums:
            as_tensors = MetricStats(*({k: torch.tensor(v, dtype=torch.float64) for k, v in d.items()}
                                       for d in (self.mismatch.sums, self.mismatch.maxima, self.mismatch.minima)))
            metrics.update({k: float(v) for k, v in finalize_mismatch_metrics(as_tensors).items()})
        for key, value in self.weighted.items():
            metrics[key] = value / self.tokens if self.tokens > 0 else 0.0
        for key, value in self.maxima.items():
            metrics[key] = value if math.isfinite(value) else 0.0
        return metrics


def _maximum(a: Number, b: Number) -> Number:
    return torch.maximum(a, b) if isinstance(a, Tensor) else max(a, b)


def _minimum(a: Number, b: Number) -> Number:
    return torch.minimum(a, b) if isinstance(a, Tensor) else min(a, b)

"""LossReport: micro-batch records added up give the whole batch's metrics (hand-computed)."""

import math

import pytest
import torch

from entr_megatron.algorithm import MetricStats, mismatch_metric_stats, mismatch_metrics
from entr_megatron.algorithm.objective import PolicyTerms
from entr_megatron.learner.loss_report import LossReport

F64 = torch.float64


def _terms(metrics):
    empty = torch.zeros(1, 1)
    return PolicyTerms(empty, empty.bool(), empty.bool(), empty, {k: torch.tensor(v) for k, v in metrics.items()})


def test_two_microbatches_add_up_to_the_whole_batch():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.2]], dtype=F64)
    mu = lp - torch.tensor([[0.1, -0.2, 0.3], [0.05, 0.0, -0.4]], dtype=F64)
    ent = torch.ones_like(lp)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    keep = torch.tensor([[True, False, True], [True, True, False]])
    halves = []
    for rows, numerator, count, metric in ((slice(0, 1), 3.0, 3, 0.2), (slice(1, 2), 1.0, 2, 0.7)):
        stats = mismatch_metric_stats(lp[rows], mu[rows], ent[rows], mask[rows], keep_mask_BT=keep[rows])
        halves.append(LossReport.of_microbatch(torch.tensor(numerator), torch.tensor(count), _terms(
            {"entr/score_mean": metric, "entr/weight_max": 10 * metric}), stats, tokens=mask[rows].sum()))
    got = LossReport.total(halves).metrics()
    assert got["loss"] == pytest.approx(4.0 / 5) and got["loss/count"] == 5
    assert got["entr/score_mean"] == pytest.approx((0.2 * 3 + 0.7 * 2) / 5)  # token-weighted
    assert got["entr/weight_max"] == pytest.approx(7.0)
    whole = mismatch_metrics(lp, mu, ent, mask, keep_mask_BT=keep)
    for key in ("mismatch/k3", "mismatch/k1", "mask/fraction", "is/ess"):
        assert got[key] == pytest.approx(whole[key].item(), rel=1e-12), key


def test_an_empty_report_is_neutral_and_reports_no_nan():
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    stats = mismatch_metric_stats(lp, lp - 0.1, torch.ones_like(lp), torch.ones_like(lp, dtype=torch.bool))
    one = LossReport.of_microbatch(torch.tensor(2.0), torch.tensor(4), _terms({"x_max": 1.5}), stats, torch.tensor(2))
    got = LossReport.total([LossReport(), one, LossReport()]).metrics()
    assert got["loss"] == 0.5 and got["x_max"] == 1.5
    assert got["mismatch/k1"] == pytest.approx(-0.1)
    assert LossReport().metrics() == {"loss": 0.0, "loss/count": 0.0}
    # A micro-batch without tokens reports its maxima as -inf (neutral); alone it reads 0, not -inf.
    empty_max = LossReport.of_microbatch(torch.tensor(0.0), torch.tensor(0), _terms({"x_max": 3.0}),
                                         MetricStats({}, {}, {}), torch.tensor(0))
    assert LossReport.total([empty_max]).metrics()["x_max"] == 0.0
    assert all(math.isfinite(v) for v in LossReport.total([empty_max, one]).metrics().values())

"""Mismatch metrics: hand case, loop reference, and reduction of stats across "ranks"."""

import math

import pytest
import torch

from entr_megatron.algorithm import (
    DEFAULT_ENTROPY_BIN_EDGES,
    MetricStats,
    finalize_mismatch_metrics,
    mismatch_metric_stats,
    mismatch_metrics,
)
from entr_megatron.algorithm.metrics import entropy_bin_labels

F64 = torch.float64
LABELS = ["0-0.001", "0.001-0.01", "0.01-0.1", "0.1-1", "1-10", "10-inf"]


def _hand_batch():
    behaviour = torch.tensor([[-1.0, -8.0, -0.5], [-7.5, 0.0, 0.0]], dtype=F64)
    delta = torch.tensor([[0.1, -0.2, 0.5], [1.0, 0.0, 0.0]], dtype=F64)
    entropy = torch.tensor([[0.0005, 0.05, 2.0], [0.05, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    keep = torch.tensor([[True, False, True], [False, False, False]])
    weight = torch.tensor([[1.0, 2.0, 0.5], [3.0, 0.0, 0.0]], dtype=F64)
    return behaviour + delta, behaviour, entropy, mask, keep, weight


def test_hand_case():
    logprobs, behaviour, entropy, mask, keep, weight = _hand_batch()
    m = mismatch_metrics(logprobs, behaviour, entropy, mask, keep, weight)
    deltas = [0.1, -0.2, 0.5, 1.0]
    assert m["mismatch/k1"].item() == pytest.approx(-1.4 / 4)
    assert m["mismatch/k3"].item() == pytest.approx(sum(math.exp(d) - 1 - d for d in deltas) / 4)
    assert m["mismatch/mean_abs_delta"].item() == pytest.approx(1.8 / 4)
    assert m["mismatch/tokens"].item() == 4
    assert m["policy/entropy_mean"].item() == pytest.approx((0.0005 + 0.05 + 2.0 + 0.05) / 4)
    assert m["mask/fraction"].item() == pytest.approx(2 / 4)
    # Effective weights w * keep over the 4 valid tokens: [1, 0, 0.5, 0].
    assert m["is/ess"].item() == pytest.approx(1.5**2 / (4 * 1.25))
    # Bin 0.01-0.1 holds delta -0.2 (mu = e^-8) and 1.0 (mu = e^-7.5): both dropped, both rare.
    b = "entropy_bin/0.01-0.1/"
    assert m[b + "count"].item() == 2
    assert m[b + "mean_abs_delta"].item() == pytest.approx(0.6)
    assert m[b + "k3"].item() == pytest.approx((math.exp(-0.2) + 0.2 - 1 + math.exp(1.0) - 2) / 2)
    assert m[b + "mean_score"].item() == pytest.approx((0.04 / 0.06 + 1.0 / 0.06) / 2)
    assert m[b + "mask_fraction"].item() == 1.0
    assert m[b + "low_prob_share"].item() == 1.0
    assert m["entropy_bin/0-0.001/count"].item() == 1 and m["entropy_bin/0-0.001/low_prob_share"].item() == 0
    assert m["entropy_bin/1-10/mean_score"].item() == pytest.approx(0.25 / 2.01)
    assert m["entropy_bin/10-inf/count"].item() == 0 and m["entropy_bin/10-inf/mean_abs_delta"].item() == 0
    assert not any(k.startswith("policy_lag/") for k in m)  # the controller's metric (buffer.lag_metrics)


def test_optional_groups_are_absent_without_their_inputs():
    logprobs, behaviour, entropy, mask, *_ = _hand_batch()
    m = mismatch_metrics(logprobs, behaviour, entropy, mask)
    assert not any(k.startswith(("mask/", "is/", "policy_lag/")) or k.endswith("mask_fraction") for k in m)
    assert {f"entropy_bin/{label}/count" for label in LABELS} <= set(m)


def test_bin_labels():
    assert entropy_bin_labels(DEFAULT_ENTROPY_BIN_EDGES) == LABELS
    with pytest.raises(ValueError, match="entropy_bins"):
        mismatch_metrics(*_hand_batch()[:4], entropy_bins=(0.0, 1.0, 1.0))


def _loop_reference(lp, mu, H, mask, keep, weight, edges, eps=0.01):
    B, T = len(lp), len(lp[0])
    valid = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
    d = {k: lp[k[0]][k[1]] - mu[k[0]][k[1]] for k in valid}
    n = len(valid)
    out = {
        "mismatch/k1": sum(-d[k] for k in valid) / n,
        "mismatch/k3": sum(math.exp(d[k]) - 1 - d[k] for k in valid) / n,
        "mismatch/mean_abs_delta": sum(abs(d[k]) for k in valid) / n,
        "mismatch/tokens": n,
        "policy/entropy_mean": sum(H[k[0]][k[1]] for k in valid) / n,
        "mask/fraction": sum(not keep[k[0]][k[1]] for k in valid) / n,
    }
    w = [weight[k[0]][k[1]] if keep[k[0]][k[1]] else 0.0 for k in valid]
    out["is/ess"] = sum(w) ** 2 / (n * sum(x * x for x in w))
    for i, label in enumerate(LABELS):
        members = [k for k in valid if edges[i] <= H[k[0]][k[1]] < edges[i + 1]]
        c = len(members)
        out[f"entropy_bin/{label}/count"] = c
        div = max(c, 1)
        out[f"entropy_bin/{label}/mean_abs_delta"] = sum(abs(d[k]) for k in members) / div
        out[f"entropy_bin/{label}/k3"] = sum(math.exp(d[k]) - 1 - d[k] for k in members) / div
        out[f"entropy_bin/{label}/mean_score"] = sum(d[k] ** 2 / (H[k[0]][k[1]] + eps) for k in members) / div
        out[f"entropy_bin/{label}/mask_fraction"] = sum(not keep[k[0]][k[1]] for k in members) / div
        out[f"entropy_bin/{label}/low_prob_share"] = sum(math.exp(mu[k[0]][k[1]]) < 1e-3 for k in members) / div
    return out


def _random_batch(seed, B=9, T=11):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=F64) * 10
    mu = (lp + torch.randn(B, T, generator=g, dtype=F64) * 0.5).clamp(max=-1e-3)
    H = 10 ** (torch.rand(B, T, generator=g, dtype=F64) * 5.5 - 4)  # 1e-4 .. 30 nats, every bin
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # an empty sequence
    keep = torch.rand(B, T, generator=g) > 0.25
    weight = torch.rand(B, T, generator=g, dtype=F64) * 2
    return lp, mu, H, mask, keep, weight


def test_against_loop_reference():
    lp, mu, H, mask, keep, weight = _random_batch(seed=21)
    got = mismatch_metrics(lp, mu, H, mask, keep, weight)
    lists = (t.tolist() for t in (lp, mu, H, mask, keep, weight))
    expected = _loop_reference(*lists, DEFAULT_ENTROPY_BIN_EDGES)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert all(expected[f"entropy_bin/{label}/count"] > 0 for label in LABELS), "every bin should be exercised"
    assert got["mismatch/k3"].item() >= 0


def test_stats_reduced_across_ranks_equal_the_whole_batch():
    lp, mu, H, mask, keep, weight = _random_batch(seed=8)
    whole = mismatch_metrics(lp, mu, H, mask, keep, weight)
    # Three "ranks": rows 0-3, rows 4-8, and one with no valid tokens at all.
    shards = [slice(0, 4), slice(4, 9)]
    stats = [
        mismatch_metric_stats(lp[s], mu[s], H[s], mask[s], keep[s], weight[s]) for s in shards
    ]
    empty = torch.zeros_like(mask[:2])
    stats.append(mismatch_metric_stats(lp[:2], mu[:2], H[:2], empty, keep[:2], weight[:2]))
    # What all_reduce(SUM / MAX / MIN) would produce.
    reduced = MetricStats(
        sums={k: sum(s.sums[k] for s in stats) for k in stats[0].sums},
        maxima={k: torch.stack([s.maxima[k] for s in stats]).amax() for k in stats[0].maxima},
        minima={k: torch.stack([s.minima[k] for s in stats]).amin() for k in stats[0].minima},
    )
    combined = finalize_mismatch_metrics(reduced)
    assert set(combined) == set(whole)
    for key in whole:
        torch.testing.assert_close(combined[key], whole[key], msg=key)


def test_no_valid_tokens_gives_zeros_not_nan():
    lp, mu, H, mask, keep, weight = _random_batch(seed=1, B=2, T=3)
    m = mismatch_metrics(lp, mu, H, torch.zeros_like(mask), keep, weight)
    assert all(v.item() == 0.0 for v in m.values())


def test_bf16_inputs():
    lp, mu, H, mask, *_ = _random_batch(seed=3)
    m = mismatch_metrics(lp.bfloat16(), mu.bfloat16(), H.bfloat16(), mask)
    ref = mismatch_metrics(lp.bfloat16().double(), mu.bfloat16().double(), H.bfloat16().double(), mask)
    for key in ref:
        torch.testing.assert_close(m[key], ref[key], msg=key)

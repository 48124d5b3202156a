"""Paired per-seed differences (study/paired.py) on a hand-built cells frame."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from entr_megatron.study.paired import paired_differences, sign_test_p

AXES = ["controller.inter_lag", "method", "controller.seed"]


def frame(rows):
    return pd.DataFrame.from_records(
        [{"controller.inter_lag": k, "method": m, "controller.seed": s, "eval_after_sampled": v} for k, m, s, v in rows])


def test_each_cell_is_paired_with_the_reference_of_its_seed_and_lag():
    cells = frame([
        (32, "entr", 0, 0.30), (32, "entr", 1, 0.32), (32, "entr", 2, 0.28),
        (32, "none", 0, 0.31), (32, "none", 1, 0.30), (32, "none", 2, math.nan),  # seed 2 not evaluated
        (0, "none", 0, 0.50),                       # no entr at lag 0: no pair
        (32, "naive", 1, 0.00), (32, "naive", 3, 0.1),  # seed 3 has no reference
    ])
    table = paired_differences(cells, AXES, {"method": "entr"}).set_index("group")
    assert list(table.index) == ["inter_lag=32, method=naive", "inter_lag=32, method=none"]
    none = table.loc["inter_lag=32, method=none"]
    assert none.seeds == 2 and none.better == 1 and none.worse == 1
    assert none["mean"] == pytest.approx((0.01 - 0.02) / 2) and none["min"] == pytest.approx(-0.02)
    assert none.differences == "+0.010 (seed 0), -0.020 (seed 1)"
    naive = table.loc["inter_lag=32, method=naive"]
    assert naive.seeds == 1 and naive["mean"] == pytest.approx(-0.32)


def test_a_lag_reference_pairs_each_method_with_its_own_lag_zero_cell():
    cells = frame([(0, "entr", 0, 0.40), (32, "entr", 0, 0.30), (0, "none", 0, 0.35), (32, "none", 0, 0.33)])
    table = paired_differences(cells, AXES, {"controller.inter_lag": 0}).set_index("group")
    assert table.loc["inter_lag=32, method=entr", "mean"] == pytest.approx(-0.10)
    assert table.loc["inter_lag=32, method=none", "mean"] == pytest.approx(-0.02)


def test_a_reference_axis_the_cells_do_not_have_is_named():
    with pytest.raises(ValueError, match=r"\['method'\] are not axes"):
        paired_differences(frame([]), ["controller.seed"], {"method": "entr"})


def test_interval_sd_and_sign_test_by_hand():
    # differences +0.02, +0.04, +0.06, +0.08, -0.01 over five seeds: mean 0.038, sd sqrt(0.00137)
    refs = [(32, "entr", s, 0.30) for s in range(5)]
    others = [(32, "none", s, 0.30 + d) for s, d in enumerate([0.02, 0.04, 0.06, 0.08, -0.01])]
    row = paired_differences(frame(refs + others), AXES, {"method": "entr"}).iloc[0]
    sd = math.sqrt(sum((d - 0.038) ** 2 for d in [0.02, 0.04, 0.06, 0.08, -0.01]) / 4)
    assert row["mean"] == pytest.approx(0.038) and row["sd"] == pytest.approx(sd)
    half = 2.131846786 * sd / math.sqrt(5)          # t(0.95, 4), from a t table
    assert (row.ci90_low, row.ci90_high) == (pytest.approx(0.038 - half), pytest.approx(0.038 + half))
    assert row.sign_p == pytest.approx(2 * (1 + 5) / 32)   # 4 up, 1 down: 2 P(X <= 1), X ~ Bin(5, 1/2)


def test_sign_test_edge_cases():
    assert sign_test_p(5, 0) == pytest.approx(2 / 32) and sign_test_p(0, 0) == 1.0 and sign_test_p(3, 3) == 1.0
    one = paired_differences(frame([(32, "entr", 0, 0.3), (32, "none", 0, 0.4)]), AXES, {"method": "entr"}).iloc[0]
    assert math.isnan(one.sd) and math.isnan(one.ci90_low) and one.sign_p == 1.0

"""Paired per-seed differences against a reference: the comparison seed-matched cells allow.

    table = paired_differences(cells, ["method", "controller.seed"], {"method": "entr"})

`cells` is `report.load_cells`'s frame (one row per cell, a column per axis). Each cell that does
not match `reference` is paired with the cell that has the reference's values on the reference's
axes and the same value on every other axis (the same seed, the same lag): the difference is its
`column` minus the reference cell's. Same seed means the same warm-up draws, prompts and sampling
seeds, so the pair differs only in the method: the spread of these differences is the comparison's
resolution, not the spread of either method's accuracies.

The statistics of a group's n differences d_1..d_n: `sd`, their empirical standard deviation
(n - 1 in the denominator); `ci90_low` / `ci90_high`, the 90% t-interval of their mean, mean +-
t(0.95, n - 1) sd / sqrt(n) (NaN below two pairs); `sign_p`, the two-sided sign test's p-value,
P(a split at least as uneven as `better` : `worse` | each side 1/2), ties (d = 0) left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import math

import pandas as pd

from entr_megatron.study.results import SEED_AXIS, axis_label

__all__ = ["mean_interval", "paired_differences", "sign_test_p"]


def paired_differences(cells: pd.DataFrame, axes: Sequence[str], reference: Mapping[str, Any],
                       column: str = "eval_after_sampled", seed_axis: str = SEED_AXIS) -> pd.DataFrame:
    """One row per group of cells (equal on every axis but the seed) that has reference pairs:
    `group`, `seeds` (pairs), `differences` ("+0.012 (seed 0), ..."), `mean`, `sd`, `ci90_low`,
    `ci90_high`, `min`, `max`, `better` and `worse` (pairs above / below the reference), `sign_p`
    (module docstring). Cells without `column` (not run, no eval)
    pair with nothing. Raises ValueError naming a reference axis that is not an axis of `cells`."""
    missing = [k for k in reference if k not in axes]
    if missing:
        raise ValueError(f"reference axes {missing} are not axes of the cells; axes: {list(axes)}")
    rows = cells[cells[column].notna()] if column in cells else cells.iloc[0:0]
    others = [a for a in axes if a not in reference]

    def key(row: pd.Series, names: Sequence[str]) -> tuple[str, ...]:
        return tuple(axis_label(row[a]) if a in row and pd.notna(row[a]) else "" for a in names)

    is_ref = rows.apply(lambda r: all(key(r, [k]) == (axis_label(v),) for k, v in reference.items()), axis=1) \
        if len(rows) else pd.Series([], dtype=bool)
    ref_value = {key(r, others): float(r[column]) for _, r in rows[is_ref].iterrows()}
    groups: dict[tuple[str, ...], list[tuple[str, float]]] = {}
    for _, r in rows[~is_ref].iterrows():
        base = ref_value.get(key(r, others))
        if base is None:
            continue
        group = key(r, [a for a in axes if a != seed_axis])
        groups.setdefault(group, []).append((key(r, [seed_axis])[0], float(r[column]) - base))
    shown = [a for a in axes if a != seed_axis]
    records = []
    for group, pairs in sorted(groups.items()):
        pairs.sort(key=lambda p: p[0])
        diffs = [d for _, d in pairs]
        better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        records.append({
            "group": ", ".join(f"{a.split('.')[-1]}={v}" for a, v in zip(shown, group)),
            "seeds": len(pairs),
            "differences": ", ".join(f"{d:+.3f} (seed {s})" for s, d in pairs),
            **mean_interval(diffs), "min": min(diffs), "max": max(diffs),
            "better": better, "worse": worse, "sign_p": sign_test_p(better, worse),
        })
    return pd.DataFrame.from_records(records, columns=["group", "seeds", "differences", "mean", "sd", "ci90_low",
                                                       "ci90_high", "min", "max", "better", "worse", "sign_p"])


def mean_interval(diffs: Sequence[float], level: float = 0.90) -> dict[str, float]:
    """mean, empirical sd (ddof 1) and the `level` t-interval of the mean (NaN below two values)."""
    from scipy import stats

    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return {"mean": mean, "sd": math.nan, "ci90_low": math.nan, "ci90_high": math.nan}
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "ci90_low": mean - half, "ci90_high": mean + half}


def sign_test_p(better: int, worse: int) -> float:
    """Two-sided sign test: P(min(X, n - X) <= min(better, worse)) for X ~ Binomial(n, 1/2), n =
    better + worse (1.0 when n = 0)."""
    n, k = better + worse, min(better, worse)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)

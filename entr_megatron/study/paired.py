"""Paired per-seed differences against a reference: the comparison seed-matched cells allow.

    table = paired_differences(cells, ["method", "controller.seed"], {"method": "entr"})

`cells` is `report.load_cells`'s frame (one row per cell, a column per axis). Each cell that does
not match `reference` is paired with the cell that has the reference's values on the reference's
axes and the same value on every other axis (the same seed, the same lag): the difference is its
`column` minus the reference cell's. Same seed means the same warm-up draws, prompts and sampling
seeds, so the pair differs only in the method: the spread of these differences is the comparison's
resolution, not the spread of either method's accuracies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from entr_megatron.study.results import SEED_AXIS, _label

__all__ = ["paired_differences"]


def paired_differences(cells: pd.DataFrame, axes: Sequence[str], reference: Mapping[str, Any],
                       column: str = "eval_after_sampled", seed_axis: str = SEED_AXIS) -> pd.DataFrame:
    """One row per group of cells (equal on every axis but the seed) that has reference pairs:
    `group`, `seeds` (pairs), `differences` ("+0.012 (seed 0), ..."), `mean`, `min`, `max`, `better`
    and `worse` (pairs above / below the reference). Cells without `column` (not run, no eval)
    pair with nothing. Raises ValueError naming a reference axis that is not an axis of `cells`."""
    missing = [k for k in reference if k not in axes]
    if missing:
        raise ValueError(f"reference axes {missing} are not axes of the cells; axes: {list(axes)}")
    rows = cells[cells[column].notna()] if column in cells else cells.iloc[0:0]
    others = [a for a in axes if a not in reference]

    def key(row: pd.Series, names: Sequence[str]) -> tuple[str, ...]:
        return tuple(_label(row[a]) if a in row and pd.notna(row[a]) else "" for a in names)

    is_ref = rows.apply(lambda r: all(key(r, [k]) == (_label(v),) for k, v in reference.items()), axis=1) \
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
        records.append({
            "group": ", ".join(f"{a.split('.')[-1]}={v}" for a, v in zip(shown, group)),
            "seeds": len(pairs),
            "differences": ", ".join(f"{d:+.3f} (seed {s})" for s, d in pairs),
            "mean": sum(diffs) / len(diffs), "min": min(diffs), "max": max(diffs),
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs),
        })
    return pd.DataFrame.from_records(records, columns=["group", "seeds", "differences", "mean", "min", "max",
                                                       "better", "worse"])

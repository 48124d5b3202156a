"""Paired per-seed differences across one or more studies (entr_megatron/study/paired.py).

    python tools/paired_differences.py runs/studies/countdown_main runs/studies/countdown_ablations \
        --where inter_lag=32 --reference method=entr

Loads every study's cells (`study report`'s cells.csv columns), keeps the rows whose axes match
every --where (a study without that axis is kept whole: it holds the value by its overrides),
and prints, for each method, its held-out accuracy after RL minus the reference method's with
the same seed. Cells of the same method and seed in two studies are the same computation (same
config, deterministic on one machine): the first study given wins, and a differing duplicate is
reported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entr_megatron.study.paired import paired_differences  # noqa: E402
from entr_megatron.study.plots import markdown_table  # noqa: E402
from entr_megatron.study.report import load_cells  # noqa: E402
from entr_megatron.study.results import SEED_AXIS, _label  # noqa: E402


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"expected AXIS=VALUE, got {text!r}")
    return key, value


def _column(frame: pd.DataFrame, key: str) -> str | None:
    """The frame's axis column named `key` or ending in ".key" (inter_lag -> controller.inter_lag)."""
    hits = [c for c in frame.columns if c == key or c.endswith("." + key)]
    return hits[0] if hits else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("studies", nargs="+", type=Path, help="study directories (study run --out)")
    p.add_argument("--reference", type=_pair, required=True, help="AXIS=VALUE of the reference, e.g. method=entr")
    p.add_argument("--where", type=_pair, action="append", default=[], help="AXIS=VALUE filter (repeatable)")
    p.add_argument("--column", default="eval_after_sampled",
                   help="cells.csv column to compare (default: eval_after_sampled; eval_after_greedy too)")
    args = p.parse_args(argv)
    frames = []
    for study in args.studies:
        if not (study / "study.json").exists():
            p.error(f"{study}: no study.json (not a study directory)")
        frame = load_cells(study)
        for key, value in args.where:
            col = _column(frame, key)
            if col is not None:
                frame = frame[frame[col].map(_label) == value].drop(columns=[col])
        frames.append(frame.assign(_study=str(study)))
    ref_key, ref_value = args.reference
    cells = pd.concat(frames, ignore_index=True)
    ref_col = _column(cells, ref_key)
    if ref_col is None or SEED_AXIS not in cells:
        p.error(f"the studies have no axis {ref_key!r} or no seed axis {SEED_AXIS!r}")
    cells = cells[cells[args.column].notna()]
    seen = cells.drop_duplicates([ref_col, SEED_AXIS])
    for (_, row), (_, other) in ((r, o) for r in seen.iterrows() for o in cells.iterrows()
                                 if o[1][ref_col] == r[1][ref_col] and o[1][SEED_AXIS] == r[1][SEED_AXIS]
                                 and o[1]["_study"] != r[1]["_study"] and o[1][args.column] != r[1][args.column]):
        print(f"note: {ref_col}={row[ref_col]} seed {row[SEED_AXIS]}: {row[args.column]} in {row['_study']}, "
              f"{other[args.column]} in {other['_study']} (kept the first)", file=sys.stderr)
    table = paired_differences(seen, [ref_col, SEED_AXIS], {ref_col: ref_value}, column=args.column)
    print(markdown_table(table.round(4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

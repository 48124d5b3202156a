"""Paired per-seed differences across one or more studies (entr_megatron/study/paired.py).

    python tools/paired_differences.py runs/studies/countdown_main runs/studies/countdown_ablations \
        --where inter_lag=32 --reference method=entr

    python tools/paired_differences.py docs/studies/countdown/main_slice docs/studies/countdown/ablations \
        docs/studies/countdown/key_seeds --where inter_lag=32 --reference method=entr

A study is a study directory (`study run --out`, with study.json) or a committed report: its
cells.csv, or the folder that holds it (runs/ is not committed; a report's cells.csv has every
cell's axes and held-out accuracies, which is all this needs).

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
from entr_megatron.study.results import SEED_AXIS, axis_label  # noqa: E402


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
    p.add_argument("studies", nargs="+", type=Path,
                   help="study directories (study run --out) or reports' cells.csv (the file or its folder)")
    p.add_argument("--reference", type=_pair, required=True, help="AXIS=VALUE of the reference, e.g. method=entr")
    p.add_argument("--where", type=_pair, action="append", default=[], help="AXIS=VALUE filter (repeatable)")
    p.add_argument("--plot", type=Path, help="also draw the per-seed differences into this PNG")
    p.add_argument("--column", default="eval_after_sampled",
                   help="cells.csv column to compare (default: eval_after_sampled; eval_after_greedy too)")
    args = p.parse_args(argv)
    frames = []
    for study in args.studies:
        csv = study if study.suffix == ".csv" else study / "cells.csv"
        if (study / "study.json").exists():
            frame = load_cells(study)
        elif csv.is_file():
            frame = pd.read_csv(csv)
        else:
            p.error(f"{study}: neither a study directory (study.json) nor a report's cells.csv")
        for key, value in args.where:
            col = _column(frame, key)
            if col is not None:
                frame = frame[frame[col].map(axis_label) == value].drop(columns=[col])
        frames.append(frame.assign(_study=str(study)))
    ref_key, ref_value = args.reference
    cells = pd.concat(frames, ignore_index=True)
    ref_col = _column(cells, ref_key)
    if ref_col is None or SEED_AXIS not in cells:
        p.error(f"the studies have no axis {ref_key!r} or no seed axis {SEED_AXIS!r}")
    cells = cells[cells[args.column].notna()]
    for (method, seed), same in cells.groupby([ref_col, SEED_AXIS]):
        if same[args.column].nunique() > 1:
            print(f"note: {ref_col}={method} seed {seed} differs between studies: "
                  + ", ".join(f"{v} in {s}" for v, s in zip(same[args.column], same["_study"]))
                  + " (kept the first)", file=sys.stderr)
    seen = cells.drop_duplicates([ref_col, SEED_AXIS])
    table = paired_differences(seen, [ref_col, SEED_AXIS], {ref_col: ref_value}, column=args.column)
    print(markdown_table(table.round(4)))
    if args.plot is not None:
        plot_differences(table, args.plot, f"{args.column} minus {ref_key}={ref_value}'s, same seed")
    return 0


def plot_differences(table: pd.DataFrame, path: Path, label: str) -> None:
    """One row per method: each seed's difference a dot, the mean a bar; 0 = the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = table.sort_values("mean")
    fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(table) + 1.2))
    for y, row in enumerate(table.itertuples()):
        diffs = [float(d.split(" ")[0]) for d in row.differences.split(", ")]
        ax.barh(y, row.mean, color="#9ecae1", height=0.6)
        ax.scatter(diffs, [y] * len(diffs), color="#08519c", s=18, zorder=3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(table)), [g.split("=", 1)[-1] for g in table["group"]])
    ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

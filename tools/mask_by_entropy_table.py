"""Where each cell's applied mask fell, by the behaviour entropy H(mu) of the token's position: a
table for a study's report (docs/studies/lm_tail/main/masks_by_entropy.md).

    python tools/mask_by_entropy_table.py runs/studies/lm_tail_main --where inter_lag=32 \
        --out docs/studies/lm_tail/main/masks_by_entropy.md

Reads every done cell's metrics.jsonl (`entropy_bin_mu/<bin>/count` and `.../mask_fraction`, per
step; `mask/fraction`, `mask/effective_fraction`: the masked tokens the ratio clip would not have
zeroed). Per cell: each bin's share of the response tokens and the fraction of them masked, both
averaged over the cell's steps; per method: the range over seeds. A row per method.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entr_megatron.study.plots import markdown_table  # noqa: E402
from entr_megatron.utils.run_log import read_metrics  # noqa: E402

BINS = ("0-0.001", "0.001-0.01", "0.01-0.1", "0.1-1", "1-10", "10-inf")
LOSS_TRUST_REGIONS = ("dppo_tv/mask_fraction", "dppo_kl/mask_fraction")
"""Tokens a policy loss drops inside itself (DPPO's trust region): not an applied mask, so not in
the bins; a column of their own."""
IN_LOSS = "dropped by the loss's trust region"


def cell_row(cell: Path) -> dict | None:
    """One done cell's averages, or None (not done, no metrics)."""
    status = json.loads((cell / "status.json").read_text()) if (cell / "status.json").exists() else {}
    if status.get("state") != "done" or not (cell / "metrics.jsonl").exists():
        return None
    rows = read_metrics(cell / "metrics.jsonl")
    frame = pd.DataFrame(rows)
    counts = frame.reindex(columns=[f"entropy_bin_mu/{b}/count" for b in BINS]).fillna(0.0)  # a bin never seen: 0
    total = counts.sum(axis=1)
    out = {**json.loads((cell / "cell.json").read_text())["axes"], "steps": len(frame),
           "mask": frame["mask/fraction"].mean(), "effective": frame.get("mask/effective_fraction", pd.Series()).mean(),
           "loss": next((frame[c].mean() for c in LOSS_TRUST_REGIONS if c in frame), float("nan"))}
    for b in BINS:
        out[f"share {b}"] = (counts[f"entropy_bin_mu/{b}/count"] / total).mean()
        col = f"entropy_bin_mu/{b}/mask_fraction"
        out[f"masked {b}"] = frame[col].mean() if col in frame else float("nan")
    return out


def span(values: pd.Series, fmt: str) -> str:
    values = values.dropna()
    if values.empty:
        return ""
    lo, hi = values.min(), values.max()
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def in_bin_order(table: pd.DataFrame) -> pd.DataFrame:
    """The bin columns in BINS' order, whichever method's row first had a bin (rows add columns as met)."""
    bins = [f"H(mu) {b}: share / masked" for b in BINS]
    return table[[c for c in table.columns if c not in bins] + [c for c in bins if c in table.columns]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", type=Path, help="a study directory (study run --out)")
    p.add_argument("--where", action="append", default=[], help="AXIS=VALUE filter on the cells' axes (repeatable)")
    p.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    args = p.parse_args(argv)
    cells = [r for c in sorted((args.study / "cells").iterdir()) if (r := cell_row(c)) is not None]
    frame = pd.DataFrame(cells)
    for item in args.where:
        key, _, value = item.partition("=")
        col = next((c for c in frame.columns if c == key or c.endswith("." + key)), None)
        if col is None:
            p.error(f"no axis {key!r} in the cells; axes: {[c for c in frame.columns if '.' in c or c == 'method']}")
        frame = frame[frame[col].astype(str) == value]
    if frame.empty:
        p.error("no done cell matches")
    seed = next(c for c in frame.columns if c.endswith("seed"))
    rows = []
    for method, group in frame.groupby("method"):
        row = {"method": method, "seeds": group[seed].nunique(), "masked, all tokens": span(group["mask"], "{:.2%}"),
               "effective (clip would not have zeroed)": span(group["effective"], "{:.2%}"),
               IN_LOSS: span(group["loss"], "{:.2%}")}
        for b in BINS:
            if group[f"share {b}"].max() > 0:
                row[f"H(mu) {b}: share / masked"] = (f"{span(group[f'share {b}'], '{:.1%}')} / "
                                                     f"{span(group[f'masked {b}'], '{:.2%}')}")
        rows.append(row)
    in_loss = any(r[IN_LOSS] for r in rows)
    if not in_loss:  # no DPPO cell: no such column
        for r in rows:
            del r[IN_LOSS]
    where = ", ".join(args.where) or "every cell"
    text = (f"<!-- written by `python tools/mask_by_entropy_table.py {args.study} "
            f"{' '.join('--where ' + w for w in args.where)}`; do not edit by hand -->\n\n"
            f"# Where the applied mask fell, by the behaviour entropy of the position ({where})\n\n"
            "Per cell, averaged over its steps; ranges over seeds. share: the bin's part of the response "
            "tokens; masked: the part of the bin's tokens the method's rule masked. effective: masked tokens "
            "that the ratio clip would not have zeroed (the mask's own effect on the gradient)."
            + (f" {IN_LOSS}: tokens DPPO's loss gives no gradient (its "
               "`dppo_tv/mask_fraction`), inside the loss rather than an applied mask, so in no bin." if in_loss else "")
            + "\n\n"
            + markdown_table(in_bin_order(pd.DataFrame(rows))) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per seed, a grid's paired differences beside that seed's measured precondition, and their rank
correlation: does a method's gap follow how much of ENTR's case the seed's testbed has?

    python tools/paired_vs_precondition.py docs/studies/lm_tail/copy_lmprior/cells.csv \
        docs/studies/lm_tail/precondition/26_copy_common2000_lmprior0.01 --lag 32 \
        --contrast entr-none --contrast entr-dppo --out docs/studies/lm_tail/copy_lmprior/paired_vs_precondition.md

Reads `study report`'s cells.csv (method, controller.seed, controller.inter_lag and the held-out
accuracies after RL) and every seedS/precondition.json of the attempt folder (tools/tail_precondition.py).
The precondition's row is source "both" on the bf16 engine (32 steps of staleness and the engine's
numerics, as the grid's cells have them) unless --source / --engine say otherwise. A contrast A-B is
method A's accuracy minus method B's on the same seed. Spearman's rho of each contrast against the
crossings per 1k, with its exact two-sided permutation p (every ordering of the seeds: 120 for 5, so
with 5 seeds no |rho| under 0.9 reaches p < 0.1). It is a look after the fact, not a named contrast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entr_megatron.study.plots import markdown_table  # noqa: E402
from entr_megatron.study.results import axis_label, done_cells  # noqa: E402

SEED, LAG = "controller.seed", "controller.inter_lag"
MEASURES = (("eval_after_sampled", "sampled"), ("eval_after_greedy", "greedy"))
HEADER = "<!-- written by `python tools/paired_vs_precondition.py`; do not edit by hand -->"


def precondition_rows(folder: Path, source: str, engine: str) -> pd.DataFrame:
    """One row per seedS/precondition.json: seed, crossings (ENTR's, per 1k response tokens) and
    rare_low_h (rare tokens at sure positions per 1k), from the row of `source` on `engine`."""
    records = []
    for path in sorted(folder.glob("seed*/precondition.json")):
        seed = path.parent.name.removeprefix("seed")
        rows = [r for r in json.loads(path.read_text())["rows"] if r["source"] == source and r["engine"] == engine]
        if len(rows) != 1:
            raise SystemExit(f"{path}: expected one row with source {source!r} on engine {engine!r}, found {len(rows)}")
        records.append({"seed": seed, "crossings": rows[0]["rare_low_h_entr_per_1k"],
                        "rare_low_h": rows[0]["rare_low_h_per_1k"]})
    if not records:
        raise SystemExit(f"{folder}: no seed*/precondition.json (write them with tools/tail_precondition.py)")
    return pd.DataFrame.from_records(records).set_index("seed")


def contrast_columns(cells: pd.DataFrame, lag: str, contrasts: list[tuple[str, str]]) -> pd.DataFrame:
    """Per seed, for each contrast and measure, A's accuracy after RL minus B's (NaN where a side has not run)."""
    rows = done_cells(cells, {LAG: lag} if LAG in cells else None)
    rows = rows.assign(seed=rows[SEED].map(axis_label))
    tables = {column: rows.pivot_table(index="seed", columns="method", values=column, aggfunc="first")
              for column, _ in MEASURES}
    out = pd.DataFrame(index=sorted(set(rows["seed"])))
    for a, b in contrasts:
        for column, name in MEASURES:
            table = tables[column]
            if a in table and b in table:
                out[f"{a} - {b}, {name}"] = table[a] - table[b]
    return out


def spearman_exact(x: pd.Series, y: pd.Series) -> tuple[float, float]:
    """Spearman's rho and its two-sided p over every ordering of y against x (scipy's exact permutation test)."""
    def rho(values):
        return stats.spearmanr(x.to_numpy(), values).statistic

    result = stats.permutation_test((y.to_numpy(),), rho, permutation_type="pairings",
                                    n_resamples=math.factorial(len(y)), alternative="two-sided")
    return float(result.statistic), float(result.pvalue)


def report(cells: pd.DataFrame, precondition: pd.DataFrame, lag: str, contrasts: list[tuple[str, str]],
           title: str) -> str:
    diffs = contrast_columns(cells, lag, contrasts)
    joined = precondition.join(diffs, how="inner")
    missing = sorted(set(precondition.index) ^ set(diffs.index))
    parts = [HEADER, "", f"# {title}", "",
             "Per seed: ENTR's crossings (rare tokens, mu < 1e-2, at positions with H(mu) < 0.1 whose log-ratio "
             "crosses ENTR's threshold) and all such rare tokens, per 1k response tokens, beside each contrast's "
             f"held-out accuracy after RL at K = {lag} (A - B, same seed). Then Spearman's rho of each contrast "
             "against the crossings, with its exact permutation p: a look after the fact, not a named contrast.", ""]
    if missing:
        parts += [f"Seeds on one side only (left out): {', '.join(missing)}.", ""]
    parts += [markdown_table(joined.reset_index().round(4)), "", "| contrast | seeds | Spearman rho | exact p |",
              "|---|---|---|---|"]
    for column in diffs.columns:
        pair = joined[["crossings", column]].dropna()
        if len(pair) >= 3:
            rho, p = spearman_exact(pair["crossings"], pair[column])
            parts.append(f"| {column} | {len(pair)} | {rho:+.2f} | {p:.3f} |")
    return "\n".join(parts) + "\n"


def _contrast(text: str) -> tuple[str, str]:
    a, sep, b = text.partition("-")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"expected METHOD-METHOD (e.g. entr-none), got {text!r}")
    return a, b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cells", type=Path, help="a study report's cells.csv")
    p.add_argument("precondition", type=Path, help="an attempt folder with seedS/precondition.json")
    p.add_argument("--contrast", type=_contrast, action="append", required=True, help="A-B, e.g. entr-none")
    p.add_argument("--lag", default="32", help="the cells' controller.inter_lag (default 32)")
    p.add_argument("--source", default="both", choices=["numerics", "staleness", "both"])
    p.add_argument("--engine", default="bf16", help="the precondition row's engine (default bf16)")
    p.add_argument("--title", help="the table's heading (default: names the cells and the attempt folder)")
    p.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    args = p.parse_args(argv)
    if not args.cells.is_file():
        p.error(f"{args.cells}: no such file; give a study report's cells.csv")
    text = report(pd.read_csv(args.cells), precondition_rows(args.precondition, args.source, args.engine),
                  args.lag, args.contrast,
                  args.title or f"{args.cells} against the precondition in {args.precondition}, per seed")
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

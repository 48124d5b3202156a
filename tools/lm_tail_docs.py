"""Regenerate every committed table of the long-tail study from its run directory, in one command:

    python tools/lm_tail_docs.py runs/studies/lm_tail_main --out docs/studies/lm_tail/main

Writes into --out: `study report`'s report.md, cells.csv and plots (its raw results.csv and
results.parquet are removed: cells.csv holds every cell's axes and accuracies); paired.md (K = 32:
each method minus ENTR with H(mu), sampled and greedy, the per-seed plot k32_paired_vs_entr.png;
each method minus none; naive + ENTR's mask, IcePop and naive + a random mask of ENTR's size minus
naive; naive + ENTR's mask minus IcePop and, where it ran, minus the random mask); paired_k0.md (K =
0: each method minus ENTR, each minus none, the pi_old loss's masks minus naive, and for every method
run with and without staleness each K (32, and 64 where it ran) minus K = 0); masks_by_entropy.md and
masks_by_entropy_k0.md (tools/mask_by_entropy_table.py). Every paired table is computed from the
written cells.csv, so a figure the docs quote from these files is one the committed cells give.
Rerun it after each `study run` of examples/studies/lm_tail/main.yaml (or spaced.yaml, into its own
folder); it rewrites the files whole. A lag with no done cell gets a mask table that says so.
Where the run directory was not kept, `--out F --paired-only` (no study) recomputes the paired tables
from F's committed cells.csv. `--with-cells C` (either mode, repeatable) adds the cells of another
committed cells.csv to the paired tables only: new cells run on a fresh machine (their own study
directory and --out folder, whose report, cells.csv and mask tables hold only them) paired with cells
whose run directories were not kept; a cell done in two of the files is an error.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mask_by_entropy_table  # noqa: E402
from paired_differences import plot_differences  # noqa: E402

from entr_megatron.study.paired import paired_differences  # noqa: E402
from entr_megatron.study.plots import markdown_table  # noqa: E402
from entr_megatron.study.results import SEED_AXIS, done_cells  # noqa: E402

LAG = "controller.inter_lag"
METHOD = "method"
PRIMARY, STALE, FRESH = "entr", "32", "0"
PI_OLD_MASKS = ("method=naive_entr", "method=icepop", "method=naive_random")  # the masks on naive's loss, minus naive
COLUMNS = (("eval_after_sampled", "Sampled accuracy (4 samples per problem, 200 held-out problems; the primary "
                                  "measure)"),
           ("eval_after_greedy", "Greedy accuracy"))
PAIRED_PLOT = "k32_paired_vs_entr.png"
"""The per-seed plot of paired_k32 (each method minus ENTR at K = 32), in the output folder."""
HEADER = "<!-- written by `python tools/lm_tail_docs.py`; do not edit by hand -->"
LEGEND = ("Paired by seed: each row's differences are its cells' held-out accuracy after RL minus the reference "
          "cell's with the same seed (the same warm-up, prompts and sampling seeds). seeds: the pairs; sd: the "
          "empirical sd of the per-seed differences; ci90: the 90% t-interval of their mean; better / worse: pairs "
          "above / below the reference; sign_p: the two-sided sign test.")


def select(cells: pd.DataFrame, **where: str) -> pd.DataFrame:
    """The done cells whose axes carry these labels (`inter_lag="32"`: the lag axis equals 32)."""
    return done_cells(cells, {LAG if axis == "inter_lag" else axis: value for axis, value in where.items()})


def pairs(cells: pd.DataFrame, axis: str, reference: str, column: str) -> pd.DataFrame:
    """Per-seed differences against `axis` = `reference` (entr_megatron.study.paired)."""
    return paired_differences(cells, [axis, SEED_AXIS], {axis: reference}, column=column)


def table(cells: pd.DataFrame, axis: str, reference: str, column: str, keep: tuple[str, ...] | None = None,
          result: pd.DataFrame | None = None) -> str:
    """The markdown table of `pairs` (or `result`, already computed); `keep`: only those groups'
    rows, e.g. ("method=naive_entr",)."""
    result = pairs(cells, axis, reference, column) if result is None else result
    if keep is not None:
        result = result[result["group"].isin(keep)]
    return markdown_table(result.round(4)) if len(result) else "(no pairs: a side has not run)"


def _name(title: str) -> str:
    return title.split(" (")[0]


def section(heading: str, cells: pd.DataFrame, reference: str, keep: tuple[str, ...] | None = None) -> list[str]:
    """`heading`, then the sampled and the greedy table of each method minus `reference` (only `keep`'s rows)."""
    parts = [heading, ""]
    for column, title in COLUMNS:
        parts += [f"{_name(title)}:", "", table(cells, METHOD, reference, column, keep=keep), ""]
    return parts


def paired_k32(cells: pd.DataFrame, out: Path) -> str:
    stale = select(cells, inter_lag=STALE)
    parts = [HEADER, "", "# lm_tail, K = 32: each method minus ENTR (H(mu)), same seed, held-out accuracy after RL",
             "", "The primary contrasts are ENTR - none and ENTR - DPPO: the negatives of the `method=none` and "
             "`method=dppo` rows. " + LEGEND, ""]
    versus_entr = {column: pairs(stale, METHOD, PRIMARY, column) for column, _ in COLUMNS}
    for column, title in COLUMNS:
        parts += [f"## {title}", "", table(stale, METHOD, PRIMARY, column, result=versus_entr[column]), ""]
    parts += section("## Each method minus none (PPO-clip against mu, no mask), same seed", stale, "none")
    parts += section("## Does ENTR's mask rescue asynchronous GRPO? naive + ENTR's mask minus naive (PPO against "
                     "pi_old, mu ignored); IcePop, the published mask on that loss, beside it", stale, "naive",
                     keep=PI_OLD_MASKS)
    parts += section("## Two masks on the pi_old loss: naive + ENTR's mask minus IcePop (as published: PPO against "
                     "pi_old, its band on pi_old / mu)", stale, "icepop", keep=("method=naive_entr",))
    if (stale[METHOD] == "naive_random").any():  # the specs that have the control (copy_lmprior.yaml)
        parts += section("## Which tokens, or how many? naive + ENTR's mask minus naive + a random mask of its size "
                         "(as many tokens per micro-batch, chosen uniformly)", stale, "naive_random",
                         keep=("method=naive_entr",))
    plot = out / PAIRED_PLOT
    if len(versus_entr["eval_after_sampled"]):
        plot_differences(versus_entr["eval_after_sampled"], plot, "eval_after_sampled minus method=entr's, same seed")
    else:
        plot.unlink(missing_ok=True)  # an earlier run's plot would no longer match paired.md
    return "\n".join(parts).rstrip() + "\n"


def paired_k0(cells: pd.DataFrame) -> str:
    fresh = select(cells, inter_lag=FRESH)
    parts = [HEADER, "", "# lm_tail: the K = 0 cells, and what K = 32 costs each method", "", LEGEND, ""]
    parts += section("## K = 0: each method minus ENTR (H(mu)), same seed", fresh, PRIMARY)
    parts += section("## K = 0: each method minus none, same seed", fresh, "none")
    parts += section("## K = 0: naive + ENTR's mask, IcePop and naive + a random mask minus naive, same seed",
                     fresh, "naive", keep=PI_OLD_MASKS)
    stale = select(cells)[lambda f: f[LAG].astype(str) != FRESH]  # K = 32, and 64 where it ran
    lags = sorted({str(lag) for lag in stale[LAG]}, key=float) or [STALE]
    parts += [f"## What {' or '.join(lags)} versions of staleness cost: K = {', '.join(lags)} minus K = 0, same "
              "method and seed", ""]
    both = sorted(set(stale[METHOD]) & set(fresh[METHOD]))
    for method in both:
        for column, title in COLUMNS:
            parts += [f"### method={method}, {_name(title).lower()}", "",
                      table(select(cells, method=method), LAG, FRESH, column), ""]
    return "\n".join(parts).rstrip() + "\n"


def mask_tables(study: Path, cells: pd.DataFrame, out: Path) -> None:
    """masks_by_entropy.md (K = 32) and masks_by_entropy_k0.md (K = 0) by tools/mask_by_entropy_table.py;
    for a lag with no done cell (a study run with --only), a file that says so."""
    for lag, name in ((STALE, "masks_by_entropy.md"), (FRESH, "masks_by_entropy_k0.md")):
        if select(cells, inter_lag=lag).empty:
            (out / name).write_text(f"{HEADER}\n\nNo cell at K = {lag} has run in `{study}`.\n")
        else:
            mask_by_entropy_table.main([str(study), "--where", f"inter_lag={lag}", "--out", str(out / name)])


def with_cells(cells: pd.DataFrame, others: list[Path] | None) -> pd.DataFrame:
    """`cells` and the rows of each committed cells.csv in `others` (None or []: `cells` alone). A cells.csv
    lists its study's cells not run too: a cell done in one file and not in another is taken from the one
    it is done in; a cell done in two is an error (the paired tables would pair a seed with itself)."""
    for other in others or []:
        cells = _joined(cells, other)
    return cells


def _joined(cells: pd.DataFrame, other: Path) -> pd.DataFrame:
    if not other.is_file():
        raise SystemExit(f"--with-cells {other}: no such file; give a cells.csv this tool wrote")
    added = pd.read_csv(other)
    done_here, done_there = (set(done_cells(frame)["cell"]) for frame in (cells, added))
    both = sorted(done_here & done_there)
    if both:
        raise SystemExit(f"--with-cells {other}: {len(both)} cell(s) are done in it and before it "
                         f"({', '.join(both[:3])}); run the new cells into a study directory of their own")
    cells = cells[~cells["cell"].isin(done_there)]
    return pd.concat([cells, added[~added["cell"].isin(set(cells["cell"]))]], ignore_index=True)


def write_paired(cells: pd.DataFrame, out: Path) -> None:
    (out / "paired.md").write_text(paired_k32(cells, out))
    (out / "paired_k0.md").write_text(paired_k0(cells))


def paired_only(out: Path, others: list[Path] | None = None) -> int:
    """Rewrite paired.md, paired_k0.md and the paired plot from `out`'s committed cells.csv (and `others`')."""
    cells_csv = out / "cells.csv"
    if not cells_csv.is_file():
        raise SystemExit(f"{cells_csv}: no such file; --paired-only needs a folder this tool wrote before")
    write_paired(with_cells(pd.read_csv(cells_csv), others), out)
    plot = out / PAIRED_PLOT  # paired_k32 writes it, or removes a stale one
    wrote = ["paired.md", "paired_k0.md"] + ([plot.name] if plot.is_file() else [])
    print(f"wrote {out}: {', '.join(wrote)} (from cells.csv)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", type=Path, nargs="?", help="the study directory (study run --out)")
    p.add_argument("--out", type=Path, required=True, help="the committed report folder")
    p.add_argument("--paired-only", action="store_true",
                   help="recompute only the paired tables, from --out's cells.csv (when the run directory is gone)")
    p.add_argument("--with-cells", type=Path, metavar="CELLS_CSV", action="append",
                   help="another committed cells.csv whose cells join the paired tables (not the report); repeatable")
    args = p.parse_args(argv)
    if args.paired_only:
        if args.study is not None:
            p.error("--paired-only reads --out's cells.csv alone: give no study directory with it")
        return paired_only(args.out, args.with_cells)
    if args.study is None:
        p.error("give the study directory (study run --out), or --paired-only")
    if not (args.study / "study.json").is_file():
        p.error(f"{args.study}: not a study directory (no study.json); give the `study run --out` folder")
    from entr_megatron.study.report import write_report

    out = args.out
    staging = out.with_name(out.name + ".partial")  # written whole, then moved over the old files
    shutil.rmtree(staging, ignore_errors=True)
    write_report(args.study, staging)
    for raw in ("results.csv", "results.parquet"):
        (staging / raw).unlink(missing_ok=True)
    cells = pd.read_csv(staging / "cells.csv")
    write_paired(with_cells(cells, args.with_cells), staging)
    mask_tables(args.study, cells, staging)
    out.mkdir(parents=True, exist_ok=True)
    for path in staging.iterdir():
        path.replace(out / path.name)
    staging.rmdir()
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

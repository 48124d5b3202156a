"""The countdown fair test's cross-study tables, from the committed reports alone.

    python tools/countdown_tables.py            # writes docs/studies/countdown/{accuracy,masks,paired}.{csv,md}

runs/ is not committed, but every report under docs/studies/countdown/ has a cells.csv with each
cell's axes and held-out accuracies after RL (sampled: 200 problems x 4 samples at T = 1; greedy:
the 200 problems). This joins them (the main grid in two reports, the ablations, the key seeds,
clip_binds, intra_lag, tau, modes and its seed 2) and writes:

- accuracy: per setting and method, the seeds run, sampled and greedy mean [min, max] and the
  range max - min, and the collapsed cells (`collapsed`, `study report`'s rule);
- masks: the reports' "What the rules masked" tables (means over every step and seed of the
  applied mask, its effective part, the clip's binding and each rule's counterfactual mask on the
  same tokens) of the main grid, ablations and key seeds, one row per (method, K) over every seed
  run: the seed-weighted mean of the reports' rows (every cell ran 150 steps);
- paired: per named contrast A - B, the per-seed differences (same seed: the same held-out problems
  and random numbers, and every seed starts from the one shared warm-up, so the pair differs only in
  the method), their mean, empirical sd (n - 1), 90% t-interval of the mean and two-sided
  sign-test p (study/paired.py's statistics), for sampled and greedy accuracy. The sd of these differences is the noise of a paired
  comparison; a binomial sd of one accuracy is not (both cells sample with the same numbers).

Cells that two studies share (the ablations' and the intra-lag study's reference cells are the
main grid's) are taken from the main grid; the ablations and clip_binds run at K = 32, intra_lag
and tau at K = 12.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from entr_megatron.study.paired import mean_interval, sign_test_p  # noqa: E402
from entr_megatron.study.plots import markdown_table  # noqa: E402

DOCS = ROOT / "docs/studies/countdown"
# report folder -> (setting, fixed axes); a cells.csv column overrides a fixed axis
REPORTS = {
    "main_slice": ("grid", {}), "main_k0_k4_k12": ("grid", {}), "key_seeds": ("grid", {}),
    "ablations": ("grid", {"K": 32}), "clip_binds": ("clip_binds", {"K": 32}),
    "intra_lag": ("intra_lag", {"K": 12}), "tau": ("tau", {"K": 12, "method": "entr"}),
    "modes": ("modes", {"method": "entr"}), "modes/seed2": ("modes", {"method": "entr"}),
}
RENAME = {"controller.inter_lag": "K", "controller.intra_lag": "J", "algorithm.tau": "tau", "controller.mode": "mode",
          "controller.seed": "seed", "eval_after_sampled": "sampled", "eval_after_greedy": "greedy"}
METRICS = ("sampled", "greedy")


def load() -> pd.DataFrame:
    frames = []
    for folder, (setting, fixed) in REPORTS.items():
        f = pd.read_csv(DOCS / folder / "cells.csv").rename(columns=RENAME)
        f = f[f["state"] == "done"].assign(setting=setting, report=folder,
                                             **{k: v for k, v in fixed.items() if k not in f})
        if "algorithm.entropy_source" in f:
            f = f[f["algorithm.entropy_source"] == "learner"]
        frames.append(f)
    cells = pd.concat(frames, ignore_index=True)
    key = ["setting", "K", "J", "tau", "mode", "method", "seed"]
    cells = cells.reindex(columns=key + list(METRICS) + ["collapsed", "report"])
    dup = cells[cells.duplicated(key[:-1] + ["seed"], keep=False)]
    if not dup.empty:
        raise SystemExit(f"cells run in two reports:\n{dup}")
    return cells


def pick(cells: pd.DataFrame, **axes) -> pd.DataFrame:
    """The cells whose axes equal `axes`, one row per seed."""
    sel = cells
    for k, v in axes.items():
        sel = sel[sel[k] == v]
    return sel.set_index("seed")


GRID = ("none", "dppo", "matched_band", "matched_random", "entr_rollout", "icepop", "kpop",
        "naive_entr", "naive", "opsm", "reinforce", "reinforce_entr")


def contrasts(cells: pd.DataFrame):
    """(name, where, A cells, B cells) of every contrast the docs quote."""
    for K in (0, 4, 12, 32):
        entr = pick(cells, setting="grid", K=K, method="entr")
        yield "entr - none", f"K = {K}", entr, pick(cells, setting="grid", K=K, method="none")
        for m in GRID[1:]:
            other = pick(cells, setting="grid", K=K, method=m)
            if len(other):
                yield f"{m} - entr", f"K = {K}", other, entr
    for a, b in (("naive_entr", "naive"), ("reinforce_entr", "reinforce")):
        yield f"{a} - {b}", "K = 32", pick(cells, setting="grid", K=32, method=a), pick(cells, setting="grid", K=32,
                                                                                       method=b)
    cb = {m: pick(cells, setting="clip_binds", method=m) for m in ("none", "entr", "icepop", "naive")}
    yield "entr - none", "K = 32, 8 mini-batches", cb["entr"], cb["none"]
    for m in ("icepop", "naive"):
        yield f"{m} - entr", "K = 32, 8 mini-batches", cb[m], cb["entr"]
    for m, c in cb.items():
        yield f"{m}: 8 - 2 mini-batches", "K = 32", c, pick(cells, setting="grid", K=32, method=m)
    for J in (2, 5, 9):
        at = {m: pick(cells, setting="intra_lag", J=J, method=m) for m in ("none", "entr", "naive")}
        yield "entr - none", f"K = 12, J = {J}", at["entr"], at["none"]
        yield "entr - naive", f"K = 12, J = {J}", at["entr"], at["naive"]
        for m, c in at.items():
            yield f"{m}: J = {J} - J = 0", "K = 12", c, pick(cells, setting="grid", K=12, method=m)
    tau1 = pick(cells, setting="tau", tau=1.0)
    for t in (0.25, 0.5, 2.0, 4.0):
        yield f"tau {t:g} - tau 1", "K = 12", pick(cells, setting="tau", tau=t), tau1
    sync = pick(cells, setting="modes", mode="sync")
    for mode in ("one_step_off", "fully_async"):
        yield f"{mode} - sync", "modes (lag bound 4)", pick(cells, setting="modes", mode=mode), sync


def paired(cells: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for name, where, a, b in contrasts(cells):
        seeds = sorted(set(a.index) & set(b.index))
        both = pd.concat([a.loc[seeds], b.loc[seeds]])
        row = {"contrast": name, "where": where, "seeds": len(seeds),
               "collapsed_cells": int(both["collapsed"].astype(str).eq("True").sum())}
        for metric in METRICS:
            diffs = [float(a.at[s, metric] - b.at[s, metric]) for s in seeds]
            up, down = sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs)
            stats = mean_interval(diffs)
            row.update({f"{metric}_differences": ", ".join(f"{d:+.4f} (seed {s})" for s, d in zip(seeds, diffs)),
                        **{f"{metric}_{k}": v for k, v in stats.items()},
                        f"{metric}_better": up, f"{metric}_worse": down, f"{metric}_sign_p": sign_test_p(up, down)})
        rows.append(row)
    return pd.DataFrame(rows)


def accuracy(cells: pd.DataFrame) -> pd.DataFrame:
    axes = ["setting", "K", "J", "tau", "mode", "method"]
    rows = []
    for key, g in cells.groupby(axes, dropna=False, sort=True):
        row = {a: v for a, v in zip(axes, key)}
        row.update(seeds=", ".join(str(int(s)) for s in sorted(g["seed"])), n=len(g),
                   collapsed=int(g["collapsed"].astype(str).eq("True").sum()))
        for metric in METRICS:
            v = g[metric]
            row.update({f"{metric}_mean": v.mean(), f"{metric}_min": v.min(), f"{metric}_max": v.max(),
                        f"{metric}_range": v.max() - v.min()})
        rows.append(row)
    return pd.DataFrame(rows).dropna(axis=1, how="all")


GRID_REPORTS = ("main_slice", "main_k0_k4_k12", "key_seeds", "ablations")


def report_masks(folder: str) -> pd.DataFrame:
    """The "What the rules masked" table of a report.md, as numbers."""
    lines = (DOCS / folder / "report.md").read_text().splitlines()
    start = lines.index("## What the rules masked")
    rows = [line for line in lines[start:] if line.startswith("|")]
    end = next((i for i in range(1, len(rows)) if not rows[i].startswith("|---") and rows[i].count("|") !=
                rows[0].count("|")), len(rows))
    split = [[c.strip() for c in r.strip("|").split("|")] for r in rows[:end] if not r.startswith("|---")]
    table = pd.DataFrame(split[1:], columns=split[0])
    return table.apply(lambda c: pd.to_numeric(c, errors="coerce") if c.name not in ("method", "lag") else c)


def masks(cells: pd.DataFrame) -> pd.DataFrame:
    parts = []
    for folder in GRID_REPORTS:
        table = report_masks(folder)
        table["K"] = table["lag"].map(lambda v: 32 if v == "all" else int(v))
        done = cells[cells["setting"] == "grid"]
        table["n"] = [int(((done["method"] == m) & (done["K"] == k) & (done["report"] == folder)).sum())
                      for m, k in zip(table["method"], table["K"])]
        parts.append(table.assign(report=folder).drop(columns="lag"))
    rows = pd.concat(parts, ignore_index=True)
    values = [c for c in rows if c not in ("method", "K", "n", "report")]
    out = []
    for (method, K), g in rows.groupby(["method", "K"], sort=True):
        def mean(col: pd.Series) -> float:
            n = g["n"][col.notna()]
            return float((col.dropna() * n).sum() / n.sum()) if n.sum() else float("nan")

        out.append({"method": method, "K": K, "seeds": int(g["n"].sum()),
                    "reports": ", ".join(f"{r} ({n})" for r, n in zip(g["report"], g["n"])),
                    **{c: mean(g[c]) for c in values}})
    return pd.DataFrame(out)


def main() -> int:
    cells = load()
    header = ("<!-- written by `python tools/countdown_tables.py` from the committed cells.csv and report.md of "
              "docs/studies/countdown/*/; do not edit by hand -->\n\n")
    acc = accuracy(cells)
    acc.to_csv(DOCS / "accuracy.csv", index=False, float_format="%.6g")
    (DOCS / "accuracy.md").write_text(
        header + "# Countdown: held-out accuracy after RL per setting and method, every seed run\n\n"
        "sampled: 200 problems x 4 samples at T = 1; greedy: the 200 problems; range = max - min over the seeds; "
        "collapsed: cells `study report` calls collapsed. grid: main.yaml with ablations.yaml and key_seeds.yaml "
        "(K = inter-trajectory lag); clip_binds: 8 mini-batches at K = 32; intra_lag: J switches at K = 12; "
        "tau: ENTR (learner entropy) at K = 12; modes: ENTR, lag bound 4 (seed 2 from modes/seed2).\n\n"
        + markdown_table(acc, floatfmt=".4f") + "\n")
    mask = masks(cells)
    mask.to_csv(DOCS / "masks.csv", index=False, float_format="%.6g")
    (DOCS / "masks.md").write_text(
        header + "# Countdown: what each rule masked, on the same tokens, per method and lag over every seed run\n\n"
        "Fractions of the trained tokens (0.0073 = 0.73%), means over every step and seed: the seed-weighted mean of "
        "the rows of each report's \"What the rules masked\" table (reports and their seeds in `reports`). "
        "mask/fraction: the mask the run applied; mask/effective_fraction: the part PPO's clip would not have zeroed "
        "anyway; clip_frac_low / high: the ratio clip's binding; cf/<rule>: the mask that rule would have applied "
        "to the same tokens (cf/dppo: outside DPPO's TV bound; cf/tis: outside TIS's band).\n\n"
        + markdown_table(mask, floatfmt=".4g") + "\n")
    pairs = paired(cells)
    pairs.to_csv(DOCS / "paired.csv", index=False, float_format="%.6g")
    show = pairs.drop(columns=[c for c in pairs if c.endswith(("_better", "_worse"))])
    clean = pairs[pairs["collapsed_cells"] == 0]
    noise = pd.DataFrame([{"contrasts": label, "n": len(g),
                           **{f"{m}_sd": f"{g[m + '_sd'].min():.3f}-{g[m + '_sd'].max():.3f}" for m in METRICS}}
                          for label, g in (("five seeds, no collapsed cell", clean[clean["seeds"] == 5]),
                                           ("three seeds, no collapsed cell", clean[clean["seeds"] == 3]),
                                           ("two seeds, no collapsed cell", clean[clean["seeds"] == 2]))])
    (DOCS / "paired.md").write_text(
        header + "# Countdown: paired per-seed differences and their empirical noise\n\n"
        "A - B per seed (same seed: the same held-out problems and random numbers for every method; every seed "
        "starts from the one shared warm-up). "
        "sd: the empirical sd of the per-seed differences (n - 1); ci90: the 90% t-interval of their mean; "
        "sign_p: the two-sided sign test (ties left out). The paired noise is this sd, not a binomial sd of "
        "one accuracy. collapsed_cells: cells of the pair that `study report` calls collapsed.\n\n"
        "Range of the sd over the contrasts below (an sd from 2-3 seeds is itself rough):\n\n"
        + markdown_table(noise) + "\n\n" + markdown_table(show, floatfmt=".4f") + "\n")
    print(markdown_table(show, floatfmt=".4f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

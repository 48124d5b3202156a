"""`study report`: a study directory (finished or not) -> results tables, figures and report.md.

Reads a study directory with results.py (every cell of the spec, those never run as pending).
Writes STUDY_DIR/report/ (or `out_dir`): results.parquet and results.csv (one row per cell x
step, `load_results`), cells.csv (one row per cell, `load_cells`), PNG figures (plots.py) and
report.md. A figure or table without data is skipped, and report.md says so. report.md ends with
`DEFINITIONS`, written from the constants below: each threshold (collapse, speedup target) is
stated once, here, and the text cannot drift from the code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from entr_megatron.study import plots
from entr_megatron.study.fits import SigmoidFit, fit_frame, fit_groups
from entr_megatron.study.paired import paired_differences
from entr_megatron.study.plots import LAG, METHOD, final_accuracy_table, lag_order, markdown_table
from entr_megatron.study.results import (NONFINITE_GUARDED, SEED_AXIS, StudyInfo, _Cell, _results, axis_label,
                                        load_results, read_study)
from entr_megatron.study.table import key_columns, parquet_safe

__all__ = ["ACCURACY_DROP", "COLLAPSE_MIN_GAIN", "COLLAPSE_NOISE_SE", "DEFINITIONS", "StudyInfo", "detect_collapse",
           "final_accuracy_stats", "final_accuracy_table", "fit_table", "load_cells", "load_results",
           "markdown_table", "read_study", "smoothed_reward", "smoothing_window", "speedup_table", "write_report"]

REWARD = "reward/mean"
COLLAPSE_MIN_GAIN = 0.05
"""Smallest smoothed-reward gain that can collapse: below it there was nothing to lose."""
COLLAPSE_NOISE_SE = 4.0
"""A gain must also exceed this many standard errors of one smoothed reward value: the maximum
of a flat noisy curve over ~90 overlapping windows lies a few standard errors above its start."""
ACCURACY_DROP = 0.1
"""Drop of held-out sampled accuracy (absolute, after RL against before RL) that is a collapse: more
than this, not any drop (a held-out set of 200 problems x 4 samples moves by a few hundredths
between two evaluations of one model)."""
SPEEDUP_TARGET_FRACTION = 0.9
"""Target of the speedup table as a fraction of the smaller final smoothed reward."""
NO_LAG = "all"
"""Lag label of every cell when the study has no lag axis."""

DEFINITIONS = f"""\
- **Cell states** (status.json): `pending` (not started: also a cell of the spec that has no
  directory yet), `running`, `done`, `failed` (its error is the message the run ended with; the
  whole output is the cell's train.log), `interrupted` (stopped by a stop of the study, at a step
  with a checkpoint or while starting; the next `study run` resumes it).
- **Groups.** The method axis is study.json's report.method (default: the axis that is not
  {SEED_AXIS} or the lag axis; when several are, their values joined, e.g.
  `policy_loss=sapo,correction=none`), the lag axis report.lag (default: none, every cell one lag);
  cells that differ only in {SEED_AXIS} are the seeds of one (method, lag) group. A
  curve is the seeds' mean and its band their min..max; against wall-clock, x is the
  seeds' mean wall-clock at that step.
- **Wall-clock** `wall_s` is the cumulative `timing/step_s` of a cell, **compute**
  `tokens_cum` the cumulative `rollout/tokens` (prompt + response tokens).
- **Smoothed reward**: the trailing moving average of `{REWARD}` over
  w = max(3, n // 10) steps (n: the cell's steps with a reward), from the first full
  window on. A cell's final reward is its last smoothed value.
- **Collapse** (`detect_collapse`), the first of these that applies:
  (a) a non-finite {" or ".join(f"`{k}`" for k in NONFINITE_GUARDED)} at any step (metrics.jsonl stores NaN and
  inf as null; a missing key is not a value);
  (b) with S the smoothed reward of the first full window, M its maximum and gain = M - S:
  gain >= max({COLLAPSE_MIN_GAIN}, {COLLAPSE_NOISE_SE:g} * se) and every one of the last w smoothed values
  < S + gain / 2 (the run lost at least half of what it gained and did not recover). se = sigma / sqrt(w)
  is the noise of one smoothed value, sigma = std(reward[t+1] - reward[t]) / sqrt(2) the per-step
  noise of the reward (differences remove a slow trend): a smaller peak is the maximum of
  noise, not a gain (8 prompts x 8 samples per step: sigma about 0.07-0.1). On simulated
  flat curves of that noise 1.7% are called collapsed (26 of 60 without the noise floor), and
  a real rise and fall by 0.15 (0.2) is found in 89% (99%) of 300 draws;
  (c) held-out sampled accuracy after RL more than {ACCURACY_DROP} (absolute) below its value before RL
  (eval.json): after < before - {ACCURACY_DROP}. A smaller drop is not a collapse.
- **Speedup at matched reward**: a (method, lag) group against its reference cells (those
  matching report.reference and sharing the group's method and lag where the reference
  does not set them; without any, sharing the method; then any). Target = {SPEEDUP_TARGET_FRACTION:.0%} of the
  smaller of the two groups' mean final smoothed reward. Time to target = the first
  wall-clock (mean over seeds) at which the seeds' mean smoothed reward, over the steps
  every seed reached, is >= target. Speedup = reference time / time.
- **ScaleRL fit** (Khatri et al. 2025, arXiv:2510.13786, Eq. 1, fits.py):
  R_C - R_0 = (A - R_0) / (1 + (C_mid / C)^B) through every step of every seed of a group,
  C = `tokens_cum`, R_0 the mean first-step reward: A the asymptote, B the scaling
  exponent (efficiency), C_mid the compute at half the gain.
- **Entropy bins** are read from the `entropy_bin/<bin>/...` keys; a cell's per-bin value
  is its mean over steps weighted by the bin's token count, then averaged over seeds."""
"""The list report.md ends with: the definitions of everything the report computes."""


def smoothing_window(n: int) -> int:
    """Window of the trailing moving average of a curve of n steps."""
    return max(3, n // 10)


def smoothed_reward(reward: Sequence[float]) -> np.ndarray:
    """Trailing moving average over smoothing_window(n) of the finite values, one per full
    window (n - w + 1 values; empty when n < w)."""
    y = np.asarray(reward, dtype=float)
    y = y[np.isfinite(y)]
    w = smoothing_window(len(y))
    if len(y) < w:
        return np.empty(0)
    return np.lib.stride_tricks.sliding_window_view(y, w).mean(axis=1)


def _reward_curve(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, int]:
    """(steps at the end of each full window, smoothed reward, w) of one cell."""
    if REWARD not in rows or rows.empty:
        return np.empty(0), np.empty(0), 3
    part = rows[np.isfinite(pd.to_numeric(rows[REWARD], errors="coerce"))]
    part = part.sort_values("step") if "step" in part else part
    smooth = smoothed_reward(part[REWARD].to_numpy(dtype=float))
    w = smoothing_window(len(part))
    steps = part["step"].to_numpy()[w - 1:] if "step" in part else np.arange(w - 1, len(part))
    return steps[: len(smooth)], smooth, w


def _accuracy(evals: Mapping[str, Any] | None, when: str, key: str) -> float:
    value = ((evals or {}).get(when) or {}).get(key)
    try:
        return float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def detect_collapse(rows: pd.DataFrame, eval: Mapping[str, Any] | None = None) -> tuple[bool, str]:
    """(collapsed, reason) of one cell's metrics rows and its eval.json (see the module
    docstring for the definition); reason is "" when the cell did not collapse."""
    at = rows["step"] if "step" in rows else pd.Series(range(len(rows)), index=rows.index)
    hits = []
    for key in NONFINITE_GUARDED:
        flag = f"{key}:nonfinite"
        values = pd.to_numeric(rows[key], errors="coerce") if key in rows else pd.Series(0.0, index=rows.index)
        # load_results' flag tells a null (non-finite) value from a missing key; a frame
        # without the flag (built by hand) counts every NaN as non-finite.
        bad = rows[flag].eq(True) | np.isinf(values) if flag in rows else ~np.isfinite(values)
        if bad.any():
            hits.append((int(at[bad].min()), key))
    if hits:
        return True, "non-finite {1} at step {0}".format(*min(hits))
    steps, smooth, w = _reward_curve(rows)
    if smooth.size:
        start, peak = float(smooth[0]), float(smooth.max())
        gain = peak - start
        floor = max(COLLAPSE_MIN_GAIN, COLLAPSE_NOISE_SE * _step_noise(rows) / math.sqrt(w))
        if gain >= floor and bool((smooth[-w:] < start + gain / 2).all()):
            return True, (f"reward collapse: smoothed reward (window {w}) rose from {start:.3f} to {peak:.3f} "
                          f"at step {int(steps[int(smooth.argmax())])}, and its last {w} values are below "
                          f"{start + gain / 2:.3f} (final {float(smooth[-1]):.3f})")
    before = _accuracy(eval, "before_rl", "eval/sampled_accuracy")
    after = _accuracy(eval, "after_rl", "eval/sampled_accuracy")
    if math.isfinite(before) and math.isfinite(after) and after < before - ACCURACY_DROP:
        return True, f"held-out sampled accuracy fell from {before:.3f} before RL to {after:.3f} after RL"
    return False, ""


def _step_noise(rows: pd.DataFrame) -> float:
    """Per-step noise of the reward: std of its first differences / sqrt(2) (0 below 3 steps)."""
    y = pd.to_numeric(rows[REWARD], errors="coerce").to_numpy(dtype=float) if REWARD in rows else np.empty(0)
    y = y[np.isfinite(y)]
    return float(np.std(np.diff(y), ddof=1) / math.sqrt(2)) if len(y) >= 3 else 0.0


def _cells(info: StudyInfo) -> pd.DataFrame:
    records = []
    for c in info.cells:
        _, smooth, _ = _reward_curve(c.frame)
        collapsed, reason = detect_collapse(c.frame, c.eval)
        records.append({
            "cell": c.id, "state": str(c.status.get("state") or "pending"), "error": c.status.get("error"),
            "wall_s": c.status.get("wall_s"), "attempts": c.status.get("attempts"), **c.axes,
            "steps": len(c.frame),
            "eval_before_greedy": _accuracy(c.eval, "before_rl", "eval/accuracy"),
            "eval_before_sampled": _accuracy(c.eval, "before_rl", "eval/sampled_accuracy"),
            "eval_after_greedy": _accuracy(c.eval, "after_rl", "eval/accuracy"),
            "eval_after_sampled": _accuracy(c.eval, "after_rl", "eval/sampled_accuracy"),
            "final_reward": float(smooth[-1]) if smooth.size else math.nan,
            "collapsed": collapsed, "collapse_reason": reason,
        })
    if records:
        return pd.DataFrame.from_records(records)
    return pd.DataFrame(columns=["cell", "state", "error", "wall_s", "attempts", *info.axes, "steps",
                                 *(f"eval_{w}_{k}" for w in ("before", "after") for k in ("greedy", "sampled")),
                                 "final_reward", "collapsed", "collapse_reason"])


def load_cells(study_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per cell: cell, state, error, wall_s, attempts (status.json), every axis,
    steps (metrics rows), eval_{before,after}_{greedy,sampled} (eval.json), final_reward
    (last smoothed reward), collapsed and collapse_reason (`detect_collapse`)."""
    return _cells(read_study(study_dir))


# --- grouping and tables ---------------------------------------------------------------------


def _group_of(axes: Mapping[str, Any], info: StudyInfo) -> tuple[str, str]:
    """(method, lag) labels of a cell's axes."""
    return (axis_label(axes.get(info.method)) if info.method else "run",
            axis_label(axes.get(info.lag)) if info.lag else NO_LAG)


def _grouped(info: StudyInfo, frame: pd.DataFrame) -> pd.DataFrame:
    """frame (with a "cell" column) plus METHOD and LAG label columns."""
    by_id = {c.id: _group_of(c.axes, info) for c in info.cells}
    groups = frame["cell"].map(lambda cid: by_id.get(cid, ("n/a", "n/a")))
    return frame.assign(**{METHOD: groups.map(lambda g: g[0]), LAG: groups.map(lambda g: g[1])})


def final_accuracy_stats(cells: pd.DataFrame, info: StudyInfo) -> pd.DataFrame:
    """Per (method, lag) of load_cells' frame: mean, min, max and number n over the seeds of
    the held-out sampled accuracy after RL (eval.json), of the cells that have one."""
    return plots.accuracy_stats(_grouped(info, cells), "eval_after_sampled")


def _matches(axes: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    return all(k in axes and axis_label(axes[k]) == axis_label(v) for k, v in wanted.items())


def _group_curve(cells: list[_Cell]) -> tuple[pd.Series, float]:
    """(mean smoothed reward indexed by mean wall-clock, over the steps every seed reached;
    mean final smoothed reward) of a group of cells."""
    smooth_cols, wall_cols, finals = [], [], []
    for c in cells:
        steps, smooth, _ = _reward_curve(c.frame)
        if not smooth.size or "wall_s" not in c.frame or "timing/step_s" not in c.frame:
            continue
        wall = c.frame.set_index("step")["wall_s"]
        smooth_cols.append(pd.Series(smooth, index=steps))
        wall_cols.append(wall.reindex(steps))
        finals.append(float(smooth[-1]))
    if not smooth_cols:
        return pd.Series(dtype=float), math.nan
    smooth = pd.concat(smooth_cols, axis=1, join="inner").mean(axis=1)
    wall = pd.concat(wall_cols, axis=1, join="inner").mean(axis=1).reindex(smooth.index)
    return pd.Series(smooth.to_numpy(), index=wall.to_numpy()), float(np.mean(finals))


def _time_to(curve: pd.Series, target: float) -> float:
    hit = curve[curve.to_numpy() >= target]
    return float(hit.index[0]) if len(hit) else math.nan


def speedup_table(info: StudyInfo) -> tuple[pd.DataFrame | None, str]:
    """(table, note) of the wall-clock to a matched smoothed reward against the reference
    (module docstring). Columns: method, lag, reference (the reference cells' group),
    target, time_s, reference_time_s (NaN: not reached), speedup, seeds, reference_seeds.
    None, with the reason, when study.json has no reference or nothing can be compared."""
    if not info.reference:
        return None, "study.json sets no report.reference, so there is nothing to compare against."
    groups: dict[tuple[str, str], list[_Cell]] = {}
    for c in info.cells:
        groups.setdefault(_group_of(c.axes, info), []).append(c)
    records, ref = [], info.reference
    for (m, lag), members in sorted(groups.items()):
        mine = [c for c in members if not _matches(c.axes, ref)]
        if not mine:
            continue  # the group is (part of) the reference
        same = {k: mine[0].axes.get(k) for k in (info.method, info.lag) if k and k not in ref}
        candidates = [c for c in info.cells if _matches(c.axes, ref)]
        for keep in (same, {k: v for k, v in same.items() if k == info.method}, {}):
            refs = [c for c in candidates if _matches(c.axes, keep)]
            if refs:
                break
        else:
            continue
        curve, final = _group_curve(mine)
        ref_curve, ref_final = _group_curve(refs)
        if curve.empty or ref_curve.empty:
            continue
        target = SPEEDUP_TARGET_FRACTION * min(final, ref_final)
        t, t_ref = _time_to(curve, target), _time_to(ref_curve, target)
        ref_desc = ", ".join(f"{k}={axis_label(v)}" for k, v in {**ref, **keep}.items())
        records.append({"method": m, "lag": lag, "reference": ref_desc, "target": target, "time_s": t,
                        "reference_time_s": t_ref, "speedup": t_ref / t if t > 0 and t_ref > 0 else math.nan,
                        "seeds": len(mine), "reference_seeds": len(refs)})
    if not records:
        return None, (f"no (method, lag) group could be compared with the reference {ref} "
                      "(no matching cells, or no reward and timing/step_s in their metrics).")
    return pd.DataFrame.from_records(records), ""


MASK_COLUMNS = ("mask/fraction", "mask/effective_fraction", "policy_loss/clip_frac_low", "policy_loss/clip_frac_high")
"""Per-step metrics of what a method's rule did (mask_table), beside the counterfactual/<rule>/mask_fraction ones."""


def mask_table(results: pd.DataFrame, info: StudyInfo) -> pd.DataFrame:
    """Per (method, lag): the mean over every step of every seed of the applied mask, its effective
    part, the clip's binding fractions, and what each rule would have masked on the same tokens
    (`counterfactual/<rule>/mask_fraction`, metrics of the learner). Empty without those metrics."""
    wanted = [c for c in (*MASK_COLUMNS, *sorted(c for c in results.columns if c.startswith("counterfactual/")))
              if c in results.columns]
    if not wanted or results.empty:
        return pd.DataFrame()
    grouped = _grouped(info, results)
    table = grouped.groupby([METHOD, LAG])[wanted].mean().reset_index().rename(columns={METHOD: "method", LAG: "lag"})
    table.columns = [c.replace("counterfactual/", "cf/").replace("/mask_fraction", "").replace("policy_loss/", "")
                     for c in table.columns]
    return table


def fit_table(results: pd.DataFrame, info: StudyInfo) -> tuple[pd.DataFrame, dict[tuple[str, str], SigmoidFit]]:
    """ScaleRL fits per (method, lag) of reward/mean against tokens_cum, all seeds pooled
    (fits.fit_groups). (table, fits by (method, lag))."""
    if REWARD not in results or "tokens_cum" not in results or results["tokens_cum"].isna().all():
        return pd.DataFrame(), {}
    fits = fit_groups(_grouped(info, results), [METHOD, LAG], "tokens_cum", REWARD)
    return fit_frame(fits, ["method", "lag"]), fits


# --- report.md -------------------------------------------------------------------------------


def write_report(study_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, table: str = "key") -> Path:
    """Writes results.parquet, results.csv, cells.csv, the PNG figures and report.md into
    out_dir (default STUDY_DIR/report); returns the path of report.md. `table`: "key" keeps
    the columns of `key_columns` in the two results files (small enough to commit), "all" every metric."""
    if table not in ("key", "all"):
        raise ValueError(f"table must be 'key' or 'all', got {table!r}")
    study_dir = Path(study_dir)
    info = read_study(study_dir)
    out = Path(out_dir) if out_dir is not None else study_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    results, cells = _results(info), _cells(info)
    written = key_columns(results, info.axes) if table == "key" else results
    written.to_csv(out / "results.csv", index=False, float_format="%.6g")
    parquet_safe(written).to_parquet(out / "results.parquet", index=False)
    cells.to_csv(out / "cells.csv", index=False)

    stats = final_accuracy_stats(cells, info)
    fits_table, fits = fit_table(results, info)
    speed, speed_why = speedup_table(info)
    gcells = _grouped(info, cells)
    drawn, notes = plots.draw_figures(_grouped(info, results), gcells, stats, fits, out,
                                      lag_order(gcells[LAG]) or [NO_LAG], sorted(set(gcells[METHOD])))
    body: list[str] = []

    def add(title: str | None, *parts: str) -> None:
        body.extend([f"## {title}\n"] if title else [])
        for part in parts:
            why = drawn.get(part, "not drawn") if part.endswith(".png") else part
            if why is None:
                body.append(f"![{part[:-4].replace('_', ' ')}]({part})\n")
            elif why is part:
                body.append(part + "\n")
            else:
                body.append(f"_Not drawn ({part}): {why}_\n")
                notes.append(f"{part}: {why}")

    errors = cells["error"].map(lambda e: str(e)[:120] if isinstance(e, str) else "")
    add("Cells", markdown_table(cells[["cell", "state", "attempts", "wall_s", "steps", "final_reward"]]
                                .assign(error=errors)))
    add("Reward", "Training `reward/mean` per step (not smoothed).", "reward_vs_step.png", "reward_vs_wall.png")
    add("Held-out accuracy", "heldout_accuracy.png")
    add("Final accuracy vs lag", "Held-out sampled accuracy after RL (eval.json): mean [min, max] over seeds.",
        markdown_table(final_accuracy_table(stats)) if not stats.empty else "_No cell has eval.json after_rl._",
        "final_accuracy_vs_lag.png")
    add("Mask fraction", "mask_fraction.png", "Final half of each cell's steps, by token-entropy bin:",
        "mask_by_entropy_bin.png")
    add("Mismatch by entropy bin", "Mean |delta| (learner vs behaviour log-prob) per token-entropy bin.",
        "delta_by_entropy_bin.png")
    add("Training diagnostics", "diagnostics.png")
    masks = mask_table(results, info)
    add("What the rules masked", "Means over every step and seed: the applied mask and its effective part (masked "
        "tokens the clip would not have zeroed), the ratio clip's binding, and each rule's mask on the same tokens "
        "(cf/<rule>: counterfactual, computed in the same pass).",
        markdown_table(masks) if not masks.empty else "_No mask metrics in these runs._")
    if info.reference:
        paired = paired_differences(cells, info.axes, info.reference)
        add("Paired differences against the reference",
            f"Held-out sampled accuracy after RL minus that of the reference cell {info.reference} with the same "
            "seed and other axes (study/paired.py).",
            markdown_table(paired.round(4)) if not paired.empty else "_No pair has both accuracies yet._")
    done = cells[cells["state"] == "done"]  # a cell not run has no verdict (the summary counts them)
    add("Collapses", markdown_table(done[["cell", *info.axes, "collapsed", "collapse_reason"]]) if not done.empty
        else "_No cell has finished yet._")
    if speed is None:
        add("Speedup at matched reward", f"_Skipped: {speed_why}_")
        notes.append(f"speedup: {speed_why}")
    else:
        shown = speed.assign(**{c: speed[c].map(lambda t: f"{t:.4g}" if math.isfinite(t) else "not reached")
                                for c in ("time_s", "reference_time_s")})
        add("Speedup at matched reward", markdown_table(shown))
    add("ScaleRL fits", "Compute C = `tokens_cum` (cumulative rollout tokens of the cell).",
        markdown_table(fits_table) if not fits_table.empty else "_No reward with rollout/tokens to fit._",
        "sigmoid_fits.png")
    if notes:
        add("Skipped", "\n".join(f"- {n}" for n in notes))
    add("Definitions", DEFINITIONS)

    head = [f"# Study report: {info.name}\n", _summary(info, cells, stats) + "\n"]
    if not stats.empty:
        head.append(markdown_table(final_accuracy_table(stats)) + "\n")
    head.append("How to read: curves are means over seeds with min..max bands; smoothed reward, collapse, "
                "speedup and the ScaleRL fit are defined under Definitions at the end.\n")
    path = out / "report.md"
    path.write_text("\n".join(head + body), encoding="utf-8")
    return path


def _summary(info: StudyInfo, cells: pd.DataFrame, stats: pd.DataFrame) -> str:
    counts = cells["state"].value_counts()
    named = ["done", "failed", "running", "pending"]
    states = ", ".join(f"{int(counts.get(s, 0))} {s}" for s in named + sorted(set(counts.index) - set(named)))
    grouping = (f"method axis `{info.method}`" if info.method else "one method") + \
        (f", lag axis `{info.lag}`" if info.lag else ", no lag axis")
    collapsed = cells[cells["collapsed"].astype(bool)]
    col = "No cell collapsed." if collapsed.empty else f"{len(collapsed)} cell(s) collapsed: " + "; ".join(
        f"{r.cell} ({r.collapse_reason})" for r in collapsed.itertuples()) + "."
    acc = ("The table below gives the held-out sampled accuracy after RL per method and lag (eval.json)."
           if not stats.empty else "No cell has a held-out accuracy after RL yet.")
    return f"{len(cells)} cells ({states}); {grouping}. {acc} {col}"

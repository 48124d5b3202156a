"""`study report`: a study directory (finished or not) -> results tables, figures and report.md.

Reads only what the runner writes (runner.py): study.json (name, axes, report grouping) and
per cell cells/<id>/{cell.json, status.json, metrics.jsonl, eval.json}, any of them missing
or partial. Writes STUDY_DIR/report/ (or `out_dir`): results.parquet and results.csv (one
row per cell x step, `load_results`), cells.csv (one row per cell, `load_cells`), PNG
figures (plots.py) and report.md. A figure or table without data is skipped, and report.md
says so.

Definitions (report.md ends with this list, verbatim):

- **Groups.** The method axis is study.json's report.method (default: the first axis that
  is not controller.seed), the lag axis report.lag (default: none, every cell one lag);
  cells that differ only in controller.seed are the seeds of one (method, lag) group. A
  curve is the seeds' mean and its band their min..max; against wall-clock, x is the
  seeds' mean wall-clock at that step.
- **Wall-clock** `wall_s` is the cumulative `timing/step_s` of a cell, **compute**
  `tokens_cum` the cumulative `rollout/tokens` (prompt + response tokens).
- **Smoothed reward**: the trailing moving average of `reward/mean` over
  w = max(3, n // 10) steps (n: the cell's steps with a reward), from the first full
  window on. A cell's final reward is its last smoothed value.
- **Collapse** (`detect_collapse`), the first of these that applies:
  (a) a non-finite `loss` or `optim/grad_norm` at any step (metrics.jsonl stores NaN and
  inf as null; a missing key is not a value);
  (b) with S the smoothed reward of the first full window, M its maximum and gain = M - S:
  gain >= max(0.05, 4 * se) and every one of the last w smoothed values < S + gain / 2 (the
  run lost at least half of what it gained and did not recover). se = sigma / sqrt(w) is the
  noise of one smoothed value, sigma = std(reward[t+1] - reward[t]) / sqrt(2) the per-step
  noise of the reward (differences remove a slow trend): a smaller peak is the maximum of
  noise, not a gain (8 prompts x 8 samples per step: sigma about 0.07-0.1). On simulated
  flat curves of that noise 1.7% are called collapsed (26 of 60 without the noise floor), and
  a real rise and fall by 0.15 (0.2) is found in 89% (99%) of 300 draws;
  (c) held-out sampled accuracy after RL < before RL - 0.1 (absolute, from eval.json).
- **Speedup at matched reward**: a (method, lag) group against its reference cells (those
  matching report.reference and sharing the group's method and lag where the reference
  does not set them; without any, sharing the method; then any). Target = 90% of the
  smaller of the two groups' mean final smoothed reward. Time to target = the first
  wall-clock (mean over seeds) at which the seeds' mean smoothed reward, over the steps
  every seed reached, is >= target. Speedup = reference time / time.
- **ScaleRL fit** (Khatri et al. 2025, arXiv:2510.13786, Eq. 1, fits.py):
  R_C - R_0 = (A - R_0) / (1 + (C_mid / C)^B) through every step of every seed of a group,
  C = `tokens_cum`, R_0 the mean first-step reward: A the asymptote, B the scaling
  exponent (efficiency), C_mid the compute at half the gain.
- **Entropy bins** are read from the `entropy_bin/<bin>/...` keys; a cell's per-bin value
  is its mean over steps weighted by the bin's token count, then averaged over seeds.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from entr_megatron.study import plots
from entr_megatron.study.fits import SigmoidFit, fit_frame, fit_groups
from entr_megatron.study.plots import LAG, METHOD, final_accuracy_table, lag_order, markdown_table
from entr_megatron.study.table import key_columns, parquet_safe
from entr_megatron.utils.run_log import METRICS_FILE, read_metrics

__all__ = ["StudyInfo", "detect_collapse", "final_accuracy_stats", "final_accuracy_table", "fit_table",
           "load_cells", "load_results", "markdown_table", "read_study", "smoothed_reward", "smoothing_window",
           "speedup_table", "write_report"]

logger = logging.getLogger(__name__)

SEED_AXIS = "controller.seed"
REWARD = "reward/mean"
NONFINITE_GUARDED = ("loss", "optim/grad_norm")
"""Metrics whose non-finite value is a collapse; each gets a derived bool column "<key>:nonfinite"."""
COLLAPSE_MIN_GAIN = 0.05
"""Smallest smoothed-reward gain that can collapse: below it there was nothing to lose."""
COLLAPSE_NOISE_SE = 4.0
"""A gain must also exceed this many standard errors of one smoothed reward value: the maximum
of a flat noisy curve over ~90 overlapping windows lies a few standard errors above its start."""
ACCURACY_DROP = 0.1
"""Drop of held-out sampled accuracy (absolute) that counts as a collapse."""
SPEEDUP_TARGET_FRACTION = 0.9
"""Target of the speedup table as a fraction of the smaller final smoothed reward."""
NO_LAG = "all"
"""Lag label of every cell when the study has no lag axis."""


@dataclass(frozen=True)
class StudyInfo:
    """study.json with the report's grouping axes resolved, and the cells (`read_study`)."""

    name: str
    axes: list[str]
    method: str | None
    """Axis whose values are the compared methods (None: the study has one method)."""
    lag: str | None
    reference: dict[str, Any] | None
    cells: list[_Cell] = field(default_factory=list, repr=False)


@dataclass
class _Cell:
    id: str
    axes: dict[str, Any]
    status: dict[str, Any]
    frame: pd.DataFrame
    eval: dict[str, Any] | None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        logger.warning("%s: not JSON (%s); treated as missing", path, exc)
        return None


def _label(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return str(value)


def _read_info(study_dir: Path) -> StudyInfo:
    """study.json of a study directory (ValueError when it has none), without the cells."""
    meta = _read_json(study_dir / "study.json")
    if not isinstance(meta, dict):
        raise ValueError(f"{study_dir} is not a study directory: no readable study.json")
    axes = [str(a) for a in meta.get("axes") or []]
    report = meta.get("report") or {}
    method = report.get("method") or next((a for a in axes if a != SEED_AXIS), None)
    reference = report.get("reference") or None
    return StudyInfo(str(meta.get("name") or study_dir.name), axes, method, report.get("lag") or None,
                     dict(reference) if reference else None)


def _cell_frame(cell_id: str, state: str, axes: Mapping[str, Any], rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A cell's metrics rows as a frame: one row per step (the last record of a repeated step)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
            continue
        record: dict[str, Any] = {}
        for key, value in row.items():
            if key == "step" or isinstance(value, (str, list, dict)):
                continue  # metrics are numbers; anything else is not tabulated
            record[key] = math.nan if value is None else float(value)
        for key in NONFINITE_GUARDED:  # null is how metrics.jsonl stores NaN and inf
            value = row.get(key, 0.0)
            record[f"{key}:nonfinite"] = value is None or (isinstance(value, float) and not math.isfinite(value))
        by_step[int(step)] = record
    if not by_step:
        return pd.DataFrame()
    frame = pd.DataFrame.from_records([by_step[s] for s in sorted(by_step)])
    frame.insert(0, "step", sorted(by_step))
    for i, (key, value) in enumerate(axes.items()):
        frame.insert(i, key, [value] * len(frame))
    frame.insert(0, "state", state)
    frame.insert(0, "cell", cell_id)
    for source, derived in (("timing/step_s", "wall_s"), ("rollout/tokens", "tokens_cum")):
        frame[derived] = frame[source].fillna(0.0).cumsum() if source in frame else math.nan
    return frame


def read_study(study_dir: str | os.PathLike) -> StudyInfo:
    """study.json and every cell of a study directory (cells by id); ValueError without study.json."""
    study_dir = Path(study_dir)
    info = _read_info(study_dir)
    cells_dir = study_dir / "cells"
    for cell_dir in sorted(p for p in cells_dir.iterdir() if p.is_dir()) if cells_dir.is_dir() else []:
        meta = _read_json(cell_dir / "cell.json") or {}
        cell_id = str(meta.get("id") or cell_dir.name)
        axes = dict(meta.get("axes") or {})
        axes = {**{a: axes.get(a) for a in info.axes}, **axes}
        status = _read_json(cell_dir / "status.json") or {}
        state = str(status.get("state") or "pending")
        rows: list[dict[str, Any]] = []
        if (cell_dir / METRICS_FILE).is_file():
            try:
                rows = read_metrics(cell_dir / METRICS_FILE)
            except (ValueError, OSError) as exc:
                logger.warning("%s: metrics unreadable (%s); the cell has no rows", cell_dir, exc)
        evals = _read_json(cell_dir / "eval.json")
        info.cells.append(_Cell(cell_id, axes, status, _cell_frame(cell_id, state, axes, rows),
                                evals if isinstance(evals, dict) else None))
    return info


def _results(info: StudyInfo) -> pd.DataFrame:
    frames = [c.frame for c in info.cells if not c.frame.empty]
    if not frames:
        return pd.DataFrame(columns=["cell", "state", *info.axes, "step", "wall_s", "tokens_cum"])
    return pd.concat(frames, ignore_index=True, sort=False)


def load_results(study_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per cell x step: cell, state, every axis (by its dotted key), step, every
    metric of the rows, "<key>:nonfinite" flags of loss and grad norm, and the derived
    wall_s (cumulative timing/step_s) and tokens_cum (cumulative rollout/tokens) of the cell.
    Cells without metrics contribute no rows."""
    return _results(read_study(study_dir))


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
    return (_label(axes.get(info.method)) if info.method else "run",
            _label(axes.get(info.lag)) if info.lag else NO_LAG)


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
    return all(k in axes and _label(axes[k]) == _label(v) for k, v in wanted.items())


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
        ref_desc = ", ".join(f"{k}={_label(v)}" for k, v in {**ref, **keep}.items())
        records.append({"method": m, "lag": lag, "reference": ref_desc, "target": target, "time_s": t,
                        "reference_time_s": t_ref, "speedup": t_ref / t if t > 0 and t_ref > 0 else math.nan,
                        "seeds": len(mine), "reference_seeds": len(refs)})
    if not records:
        return None, (f"no (method, lag) group could be compared with the reference {ref} "
                      "(no matching cells, or no reward and timing/step_s in their metrics).")
    return pd.DataFrame.from_records(records), ""


def fit_table(results: pd.DataFrame, info: StudyInfo) -> tuple[pd.DataFrame, dict[tuple[str, str], SigmoidFit]]:
    """ScaleRL fits per (method, lag) of reward/mean against tokens_cum, all seeds pooled
    (fits.fit_groups). (table, fits by (method, lag))."""
    if REWARD not in results or "tokens_cum" not in results or results["tokens_cum"].isna().all():
        return pd.DataFrame(), {}
    fits = fit_groups(_grouped(info, results), [METHOD, LAG], "tokens_cum", REWARD)
    return fit_frame(fits, ["method", "lag"]), fits


# --- report.md -------------------------------------------------------------------------------


_DEFINITIONS = __doc__.split("(report.md ends with this list, verbatim):", 1)[1].strip()


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
    add("Collapses", markdown_table(cells[["cell", *info.axes, "collapsed", "collapse_reason"]]))
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
    add("Definitions", _DEFINITIONS)

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

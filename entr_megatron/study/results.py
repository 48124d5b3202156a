"""A study directory read for its report: study.json and every cell's status, metrics and eval.

    info = read_study(study_dir)     # StudyInfo: name, axes, report grouping, cells
    frame = load_results(study_dir)  # one row per cell x step

Reads only what the runner writes (runner.py): study.json (name, axes, report grouping, and
every cell of the spec with its axes) and per cell cells/<id>/{cell.json, status.json,
metrics.jsonl, eval.json}, any of them missing or partial. A cell that study.json lists but
that has no directory yet (never started: the study was stopped, or run with --only) is read as
pending, so a report of a partly run study shows every cell. A study.json written before it
listed the cells gives only the cells that have a directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from entr_megatron.utils.run_log import METRICS_FILE

__all__ = ["COMBINED_METHOD", "NONFINITE_GUARDED", "SEED_AXIS", "StudyDirError", "StudyInfo", "load_results",
           "read_study"]

logger = logging.getLogger(__name__)

SEED_AXIS = "controller.seed"
NONFINITE_GUARDED = ("loss", "optim/grad_norm")
"""Metrics whose non-finite value is a collapse; each gets a derived bool column "<key>:nonfinite"."""
PENDING = "pending"
COMBINED_METHOD = "method"
"""The method "axis" of a study whose grid varies several axes besides the seed and lag (and whose
spec names no report.method): each cell's values of those axes joined ("policy_loss=sapo,correction=none")."""
"""State of a cell that has not started (no status.json, or no directory yet)."""


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
    method_of: tuple[str, ...] = ()
    """When `method` is COMBINED_METHOD: the axes whose values it joins."""


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


def axis_label(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return str(value)


class StudyDirError(ValueError):
    """A study directory's study.json is missing or damaged (the message names it and the field)."""


def _read_meta(path: Path) -> dict[str, Any]:
    """study.json: StudyDirError naming it when it is missing, not UTF-8 JSON, or its fields the wrong type."""
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise StudyDirError(f"{path.parent} is not a study directory: no study.json") from None
    except UnicodeDecodeError as e:
        raise StudyDirError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise StudyDirError(f"{path}: not JSON ({e})") from None
    except OSError as e:
        raise StudyDirError(f"{path}: cannot read it: {e.strerror or e}") from None
    if not isinstance(meta, dict):
        raise StudyDirError(f"{path}: must be a JSON object with name, axes, report and cells, got {type(meta).__name__}")
    axes = meta.get("axes")
    if axes is not None and (not isinstance(axes, list) or not all(isinstance(a, str) for a in axes)):
        raise StudyDirError(f"{path}: axes={axes!r} is not valid; must be a list of dotted config fields")
    for name in ("report",):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise StudyDirError(f"{path}: {name}={meta[name]!r} is not valid; must be an object")
    report = meta.get("report") or {}
    for name in ("lag", "method"):
        if report.get(name) is not None and not isinstance(report[name], str):
            raise StudyDirError(f"{path}: report.{name}={report[name]!r} is not valid; must be an axis name")
    if report.get("reference") is not None and not isinstance(report["reference"], dict):
        raise StudyDirError(f"{path}: report.reference={report['reference']!r} is not valid; must be an object")
    return meta


def _read_info(study_dir: Path) -> StudyInfo:
    """study.json of a study directory (StudyDirError when it has none or it is damaged), without the cells."""
    meta = _read_meta(study_dir / "study.json")
    axes = [str(a) for a in meta.get("axes") or []]
    report = meta.get("report") or {}
    lag = report.get("lag") or None
    others = tuple(a for a in axes if a not in (SEED_AXIS, lag))
    method_of: tuple[str, ...] = ()
    if report.get("method"):
        method = report["method"]
    elif len(others) > 1:  # cells differing in any of them are different methods, never seeds of one
        method, method_of = COMBINED_METHOD, others
    else:
        method = others[0] if others else None
    reference = report.get("reference") or None
    return StudyInfo(str(meta.get("name") or study_dir.name), axes, method, lag,
                     dict(reference) if reference else None, method_of=method_of)


def _with_method(info: StudyInfo, axes: dict[str, Any]) -> dict[str, Any]:
    """A cell's axes, with COMBINED_METHOD's value ("policy_loss=sapo,correction=none") when the
    study's methods are combinations of several axes."""
    if not info.method_of:
        return axes
    label = ",".join(f"{a.rsplit('.', 1)[-1]}={axis_label(axes.get(a))}"
                     for a in info.method_of if axes.get(a) is not None)
    return {**axes, COMBINED_METHOD: label}


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


def _read_metric_lines(path: Path) -> list[dict[str, Any]]:
    """Every record of a cell's metrics.jsonl that reads: a line that is not UTF-8, not JSON or not an
    object is named in a warning (file:line) and skipped, the others kept; the file unreadable: no rows."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        logger.warning("%s: cannot read it (%s); the cell has no rows", path, exc.strerror or exc)
        return []
    rows = []
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        partial = number == len(lines)  # no newline after it: a write cut short by a kill
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            logger.warning("%s:%d: not UTF-8 (byte 0x%02x at column %d); line skipped", path, number,
                           raw[exc.start], exc.start + 1)
            continue
        except json.JSONDecodeError as exc:
            if not partial:
                logger.warning("%s:%d: not JSON (%s); line skipped", path, number, exc)
            continue
        if isinstance(record, dict):
            rows.append(record)
        else:
            logger.warning("%s:%d: not a JSON object; line skipped", path, number)
    return rows


def read_study(study_dir: str | os.PathLike) -> StudyInfo:
    """study.json and every cell of a study directory (cells by id), the cells study.json lists
    without a directory as pending; ValueError without study.json."""
    study_dir = Path(study_dir)
    info = _read_info(study_dir)
    cells_dir = study_dir / "cells"
    for cell_dir in sorted(p for p in cells_dir.iterdir() if p.is_dir()) if cells_dir.is_dir() else []:
        meta = _read_json(cell_dir / "cell.json") or {}
        cell_id = str(meta.get("id") or cell_dir.name)
        axes = dict(meta.get("axes") or {})
        axes = _with_method(info, {**{a: axes.get(a) for a in info.axes}, **axes})
        status = _read_json(cell_dir / "status.json") or {}
        state = str(status.get("state") or PENDING)
        rows = _read_metric_lines(cell_dir / METRICS_FILE) if (cell_dir / METRICS_FILE).is_file() else []
        evals = _read_json(cell_dir / "eval.json")
        info.cells.append(_Cell(cell_id, axes, status, _cell_frame(cell_id, state, axes, rows),
                                evals if isinstance(evals, dict) else None))
    seen = {c.id for c in info.cells}
    for cell_id, axes in _listed_cells(study_dir):
        if cell_id not in seen:
            seen.add(cell_id)
            axes = _with_method(info, {**{a: axes.get(a) for a in info.axes}, **axes})
            info.cells.append(_Cell(cell_id, axes, {"state": PENDING}, pd.DataFrame(), None))
    info.cells.sort(key=lambda c: c.id)
    return info


def _listed_cells(study_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(id, axes) of the cells study.json lists (none in a study.json written before it listed them)."""
    meta = _read_json(study_dir / "study.json")
    listed = meta.get("cells") if isinstance(meta, dict) else None
    cells = []
    for item in listed if isinstance(listed, list) else []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            cells.append((item["id"], dict(item.get("axes") or {})))
    return cells


def _results(info: StudyInfo) -> pd.DataFrame:
    frames = [c.frame for c in info.cells if not c.frame.empty]
    if not frames:
        return pd.DataFrame(columns=["cell", "state", *info.axes, "step", "wall_s", "tokens_cum"])
    # Cells log different metric sets (a correction's mask keys, the engine's): the concatenation
    # keeps a block per column that is missing somewhere; copy() joins them into one per dtype, so
    # the columns the report adds later do not each pay for (and warn about) a fragmented frame.
    return pd.concat(frames, ignore_index=True, sort=False).copy()


def load_results(study_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per cell x step: cell, state, every axis (by its dotted key), step, every
    metric of the rows, "<key>:nonfinite" flags of loss and grad norm, and the derived
    wall_s (cumulative timing/step_s) and tokens_cum (cumulative rollout/tokens) of the cell.
    Cells without metrics contribute no rows."""
    return _results(read_study(study_dir))


def done_cells(cells: pd.DataFrame, where: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """The done rows of a cells table (`study report`'s cells.csv; a table without a `state` column
    counts as all done) whose axes carry these labels, compared as axis_label writes them:
    done_cells(cells, {"controller.inter_lag": 32})."""
    rows = cells[cells["state"] == "done"] if "state" in cells else cells
    for axis, value in (where or {}).items():
        rows = rows[rows[axis].map(axis_label) == axis_label(value)]
    return rows

"""Run logging: metrics.jsonl (+ TensorBoard, + W&B with `logging.wandb`) and a progress bar.

    with MetricsLogger(run_dir, resume_from_step=start) as log, ProgressBar(total, initial=start) as bar:
        for step in range(start, total):
            metrics = {"step": step + 1, **train_step()}
            log.log(metrics)
            bar.update(metrics)

metrics.jsonl holds one JSON object per line, "step" first. Each line is flushed and
fsynced, so a killed run loses at most the line being written; readers skip such a
partial last line. Values are plain JSON: torch/numpy scalars become numbers, tensors and
arrays lists, and a non-finite float (NaN, +-inf) becomes null (TensorBoard still gets
the float itself).

Layer L0: stdlib and torch; tensorboard and tqdm are imported only when used.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from entr_megatron.utils.wandb_log import WandbSink

__all__ = ["METRICS_FILE", "PROGRESS_EVERY_S", "TENSORBOARD_DIR", "MetricsLogger", "ProgressBar", "read_metrics"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

_warned_no_tensorboard = False


# --- JSON lines ------------------------------------------------------------------------------


def _to_python(value: Any, key: str) -> Any:
    """torch/numpy scalars and arrays -> Python numbers and lists (non-finite floats kept)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _to_python(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v, key) for v in value]
    if hasattr(value, "tolist"):  # torch.Tensor, numpy arrays and numpy scalars
        return _to_python(value.tolist(), key)
    raise TypeError(f"metric {key!r} has a value of type {type(value).__name__}, which is not a number or string")


def _json_safe(value: Any) -> Any:
    """A `_to_python` value with every non-finite float replaced by None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every complete line of a metrics file.

    A last line without a newline that is not a whole JSON object is a write cut short by
    a crash: it is dropped with a warning. Any other line that does not parse is an error."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number} is not JSON ({exc}); only the last line may be partial") from exc
        out.append((line, record))
    if tail.strip():
        try:
            record = json.loads(tail)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            out.append((tail, record))
        else:
            logger.warning("%s: dropping a partial last line (%d characters; a run killed mid-write)", path, len(tail))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file (or of the one in a run directory), skipping a
    partial last line."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [record for _, record in _parse_lines(path)]


def _rewrite_atomically(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLogger:
    """Appends metrics to run_dir/metrics.jsonl and, when available, TensorBoard
    (run_dir/tensorboard).

    resume_from_step=S: the resumed run repeats steps >= S, so the file is first rewritten
    (temp file + os.replace) with only the records of step < S, and TensorBoard hides its
    events from step S on (SummaryWriter's purge_step). Without it, records are appended to
    an existing file. Either way a partial last line is dropped with a warning.
    tensorboard=False, or tensorboard not installed (one warning), logs to the file only.
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, resume_from_step: int | None = None,
                 wandb: Any = None, config: Mapping[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if self.path.exists() and (resume_from_step is not None or not _ends_with_newline(self.path)):
            records = _parse_lines(self.path)
            if resume_from_step is not None:
                records = [(line, r) for line, r in records if _step_before(r, resume_from_step)]
            _rewrite_atomically(self.path, [line for line, _ in records])
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")
        self._writer = _summary_writer(self.run_dir / TENSORBOARD_DIR, resume_from_step) if tensorboard else None
        self._wandb = None
        if wandb is not None:  # a logging.wandb section: W&B too (utils/wandb_log.py)
            self._wandb = WandbSink(self.run_dir, wandb, config)

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Write one record; `metrics` must hold an int "step"."""
        if self._file is None:
            raise RuntimeError("MetricsLogger.log after close()")
        step = metrics.get("step")
        try:
            if isinstance(step, bool):
                raise TypeError
            step = step.__index__()  # int, numpy and integer torch scalars
        except (AttributeError, TypeError, RuntimeError, ValueError):
            raise ValueError(f"MetricsLogger.log needs an int 'step' key, got {step!r}") from None
        values = {str(k): _to_python(v, str(k)) for k, v in metrics.items() if k != "step"}
        line = json.dumps({"step": step, **_json_safe(values)}, allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({**values, "step": step})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _step_before(record: dict[str, Any], step: int) -> bool:
    value = record.get("step")
    return isinstance(value, int) and not isinstance(value, bool) and value < step


def _summary_writer(log_dir: Path, purge_step: int | None) -> Any:
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            logger.warning("TensorBoard is not installed (%s); metrics go to %s only", exc, METRICS_FILE)
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)


# --- progress --------------------------------------------------------------------------------

PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines of a long command without steps (score, generate, convert)."""


class ProgressBar:
    """Training progress on stderr: a tqdm bar on a terminal (or when use_tqdm=True), else
    one plain line every `log_interval` steps (and at the last step), e.g.

        train step 12/40 | reward 0.41 | lag max 3 | 812 tok/s | 3.2 s/step

    `update(metrics)` reads "step" (default: one more than before), "reward/mean",
    "policy_lag/max" and "throughput/tokens_per_s"; missing keys are left out. s/step is
    the wall time per step since the previous line. enabled=False prints nothing."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "train",
        log_interval: int = 10,
        use_tqdm: bool | None = None,
        file: TextIO | None = None,
    ):
        self.total, self.step, self.enabled, self.desc = total, initial, enabled, desc
        self.log_interval = max(1, int(log_interval))
        self._file = file
        self._last_step, self._last_time = initial, time.monotonic()
        stream = self._stream()
        if use_tqdm is None:
            use_tqdm = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = None
        if enabled and use_tqdm:
            from tqdm import tqdm  # lazy: 30-140 ms of import, for a terminal only (light processes read metrics here)

            self._bar = tqdm(total=total, initial=initial, desc=desc, file=stream, dynamic_ncols=True)

    def _stream(self) -> TextIO:
        return self._file if self._file is not None else sys.stderr

    def update(self, metrics: Mapping[str, Any] | None = None) -> None:
        metrics = metrics or {}
        step = metrics.get("step")
        self.step = int(step) if step is not None else self.step + 1
        if not self.enabled:
            return
        parts = _summary(metrics)
        if self._bar is not None:
            self._bar.update(self.step - self._bar.n)
            if parts:
                self._bar.set_postfix_str(" | ".join(parts))
            return
        steps = self.step - self._last_step
        if steps <= 0 or (steps < self.log_interval and self.step < self.total):
            return
        now = time.monotonic()
        parts.append(f"{(now - self._last_time) / steps:.1f} s/step")
        self._last_step, self._last_time = self.step, now
        line = " | ".join([f"{self.desc} step {self.step}/{self.total}", *parts])
        print(line, file=self._stream(), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary(metrics: Mapping[str, Any]) -> list[str]:
    parts = []
    for key, fmt in (("reward/mean", "reward {:.2f}"), ("policy_lag/max", "lag max {:.0f}"),
                     ("throughput/tokens_per_s", "{:.0f} tok/s")):
        value = metrics.get(key)
        if value is not None:
            try:
                parts.append(fmt.format(float(value)))
            except (TypeError, ValueError):
                continue
    return parts

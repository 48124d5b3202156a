"""Weights & Biases sink of the run log (`logging.wandb`). Layer L0; wandb is imported only here.

    sink = WandbSink(run_dir, cfg.logging.wandb, config=plain_config)   # wandb.init, resumable
    sink.log({"step": 3, "reward/mean": 0.4, ...})
    sink.close()

The W&B run id is kept in RUN_DIR/wandb_run_id, so a resumed run continues the same W&B run
(`resume="allow"`). Every metric is defined against the custom step metric "step" (the
training step), not W&B's own monotonic `_step`: a record that arrives out of order, or a
step a resumed run repeats, is plotted at its training step.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from entr_megatron.utils.jsonl import atomic_output

__all__ = ["RUN_ID_FILE", "WandbSink"]

RUN_ID_FILE = "wandb_run_id"


def run_id(run_dir: Path) -> str:
    """The run directory's W&B id, created (atomically) on first use."""
    path = run_dir / RUN_ID_FILE
    if path.exists():
        known = path.read_text().strip()
        if known:
            return known
    new = uuid.uuid4().hex[:12]
    with atomic_output(str(path)) as f:
        f.write(new + "\n")
    return new


class WandbSink:
    """One W&B run per run directory (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, cfg: Any, config: Mapping[str, Any] | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logging.wandb needs wandb: pip install 'entr-megatron[study]' (or wandb)") from e
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group,
                              name=cfg.name or run_dir.resolve().name, id=run_id(run_dir), resume="allow",
                              mode=cfg.mode, dir=str(run_dir), config=dict(config or {}),
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: Mapping[str, Any]) -> None:
        """One record; `metrics["step"]` is the training step it belongs to."""
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

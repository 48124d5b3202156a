"""The side effects of a training run, kept out of the loop (`ControllerHooks`): a row of
metrics.jsonl (and TensorBoard, the progress bar) per step, and checkpoints.

    resume_step = resume_point(paths)                         # None: a fresh run; the newest good checkpoint
    checkpoints = RunCheckpoints(learner, paths.checkpoints, keep_last=3)
    checkpoints.resume(controller, resume_step)               # weights, optimizer, controller state
    on_step = step_recorder(cfg, paths.root, stack, pusher, done, until)
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from entr_megatron.checkpoint.directory import LATEST_FILE, iter_dir, list_steps
from entr_megatron.checkpoint.manifest import choose_checkpoint, read_manifest
from entr_megatron.config.loader import config_as_dict
from entr_megatron.config.run import RunConfig
from entr_megatron.utils.console import say
from entr_megatron.utils.faults import maybe_fault
from entr_megatron.utils.run_log import MetricsLogger, ProgressBar

__all__ = ["DiskSpaceError", "RunCheckpoints", "check_disk", "resume_point", "step_recorder"]


class DiskSpaceError(RuntimeError):
    """The run directory cannot take a checkpoint (not writable, or too little free space)."""


def check_disk(paths: Any, model_dir: Path, keep_last: int) -> None:
    """Before any process starts: the checkpoint directory is writable and its file system has room
    for one more checkpoint (the last one's size from its manifest, else about 3x the fp32 weights
    of `model_dir`: weights and Adam's two moments). Raises DiskSpaceError with the numbers."""
    root = paths.checkpoints
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".tmp_probe_{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise DiskSpaceError(f"cannot write checkpoints into {root}: {e.strerror}; use a writable "
                             "logging.run_dir (--run-dir)") from None
    steps = list_steps(root)
    manifest = read_manifest(iter_dir(root, steps[-1])) if steps else None
    if manifest is not None:
        need, basis = manifest["total_bytes"], f"the last one (step {steps[-1]}) took"
    else:
        weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
        need, basis = 3 * weights, "this model's weights and Adam states take about"
    free = shutil.disk_usage(root).free
    if free < need:
        raise DiskSpaceError(f"not enough free space for a checkpoint in {root}: {free / 2**20:.1f} MiB free, "
                             f"{basis} {need / 2**20:.1f} MiB (and keep_last_checkpoints={keep_last} are kept); "
                             "free some space or use another logging.run_dir")


def resume_point(paths: Any, restart_from_scratch: bool = False) -> int | None:
    """The step a run resumes from: its newest checkpoint that verifies against its manifest
    (damaged or missing ones named on the console); None for a fresh start. A run directory whose
    checkpoints are all unusable (or whose `latest` names one that is gone) is an error, never a
    silent fresh start, unless `restart_from_scratch`: then the checkpoints and metrics are kept
    aside as `checkpoints.discarded-<time>` and `metrics.jsonl.discarded-<time>`."""
    root = paths.checkpoints
    if restart_from_scratch:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for path in (root, paths.metrics):
            if path.exists():
                aside = path.with_name(f"{path.name}.discarded-{stamp}")
                os.replace(path, aside)
                say(f"--restart-from-scratch: kept {path.name} aside as {aside}")
        return None
    if not (root / LATEST_FILE).exists() and not list_steps(root):
        return None
    choice = choose_checkpoint(root)
    for name, problems in choice.skipped:
        say(f"skipping {root / name}: {'; '.join(problems)}")
    if choice.skipped:
        say(f"resuming from the newest good checkpoint, step {choice.step}")
    return choice.step


class RunCheckpoints:
    """The learner's dist checkpoints under `root`, each with the controller's state (its
    buffer, data position and version) as extra state; the last `keep_last` are kept."""

    def __init__(self, learner: Any, root: Path, keep_last: int | None):
        self.learner, self.root, self.keep_last = learner, root, keep_last

    def save(self, ctl: Any) -> None:
        """Checkpoints the (drained) controller `ctl` and the learner: the `on_checkpoint` hook."""
        t0 = time.perf_counter()
        self.learner.save(str(self.root), ctl.step, {"controller": ctl.state_dict()}, self.keep_last)
        say(f"checkpoint at step {ctl.step} ({time.perf_counter() - t0:.1f} s)")
        maybe_fault("driver", ctl.step, "checkpoint")  # tests only (utils/faults.py)

    def resume(self, ctl: Any, step: int) -> None:
        """Loads checkpoint `step` (verified by `resume_point`) into the learner and `ctl`."""
        step, extra = self.learner.load(str(self.root), step, verify=False)
        ctl.load_state_dict(extra["controller"])
        say(f"resumed from step {step} ({self.root})")


def step_recorder(cfg: RunConfig, run_root: Path, stack: ExitStack, pusher: Any,
                  done: int, until: int) -> Callable[[dict], None]:
    """The `on_step` hook: the step's metrics with the last waited push's report, to metrics.jsonl
    (lines of steps >= `done` dropped first: they are redone) and the progress bar, which counts
    to `until`, the last step of this start (controller.train_steps, or fewer with --max-steps);
    both are closed by `stack`."""
    c = cfg.controller
    wandb_config = config_as_dict(cfg) if cfg.logging.wandb is not None else None
    logger = stack.enter_context(MetricsLogger(run_root, tensorboard=cfg.logging.tensorboard, resume_from_step=done,
                                               wandb=cfg.logging.wandb, config=wandb_config))
    bar = ProgressBar(until, initial=done, desc=f"rl {c.mode}", enabled=cfg.logging.progress_bar,
                      log_interval=cfg.logging.log_interval)
    stack.callback(bar.close)

    def on_step(metrics: dict) -> None:
        metrics.update(pusher.last_push_report)
        logger.log(metrics)
        bar.update({**metrics, "step": metrics["step"] + 1})

    return on_step

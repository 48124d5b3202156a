"""The side effects of a training run, kept out of the loop (`ControllerHooks`): a row of
metrics.jsonl (and TensorBoard, the progress bar) per step, and checkpoints.

    resume_step = latest_checkpoint(paths.checkpoints)        # None: a fresh run
    checkpoints = RunCheckpoints(learner, paths.checkpoints, keep_last=3)
    checkpoints.resume(controller)                            # weights, optimizer, controller state
    on_step = step_recorder(cfg, paths.root, stack, pusher, done)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from entr_megatron.config.loader import config_as_dict
from entr_megatron.config.run import RunConfig
from entr_megatron.controller.console import say
from entr_megatron.utils.run_log import MetricsLogger, ProgressBar

__all__ = ["RunCheckpoints", "latest_checkpoint", "step_recorder"]


def latest_checkpoint(root: Path) -> int | None:
    """The step of the last complete checkpoint under `root`; None when there is none."""
    from entr_megatron.checkpoint.directory import latest_step

    return latest_step(root) if root.exists() else None


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

    def resume(self, ctl: Any) -> None:
        """Loads the latest checkpoint into the learner and `ctl`."""
        step, extra = self.learner.load(str(self.root))
        ctl.load_state_dict(extra["controller"])
        say(f"resumed from step {step} ({self.root})")


def step_recorder(cfg: RunConfig, run_root: Path, stack: ExitStack, pusher: Any,
                  done: int) -> Callable[[dict], None]:
    """The `on_step` hook: the step's metrics with the last waited push's report, to metrics.jsonl
    (lines of steps >= `done` dropped first: they are redone) and the progress bar; both are
    closed by `stack`."""
    c = cfg.controller
    wandb_config = config_as_dict(cfg) if cfg.logging.wandb is not None else None
    logger = stack.enter_context(MetricsLogger(run_root, tensorboard=cfg.logging.tensorboard, resume_from_step=done,
                                               wandb=cfg.logging.wandb, config=wandb_config))
    bar = ProgressBar(c.train_steps, initial=done, desc=f"rl {c.mode}", enabled=cfg.logging.progress_bar,
                      log_interval=cfg.logging.log_interval)
    stack.callback(bar.close)

    def on_step(metrics: dict) -> None:
        metrics.update(pusher.last_push_report)
        logger.log(metrics)
        bar.update({**metrics, "step": metrics["step"] + 1})

    return on_step

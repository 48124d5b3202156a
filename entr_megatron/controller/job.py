"""The jobs of the CLI: `train` (SFT warm-up once, then asynchronous RL, resumable), `sft`, `eval`.

    run_train(cfg, run_dir)    model_init -> SFT -> engines + learner ranks (wiring.connect) -> Controller.run
    run_sft(cfg, run_dir)      the warm-up alone (sft.py)
    run_eval(cfg, model_dir)   held-out accuracy of one HF model (evaluation.py)

`train` resumes where the run stopped (the layout: run_dir.py): SFT is skipped when `sft/model`
exists, RL continues from the latest checkpoint (weights, optimizer, data position, staleness
buffer, RNG); metrics.jsonl drops the lines of steps that are redone. Ctrl-C finishes the
current step, saves a checkpoint and exits; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from entr_megatron.config.run import RunConfig
from entr_megatron.controller.console import StopFlag, say
from entr_megatron.controller.evaluation import HeldOut, evaluate
from entr_megatron.controller.loop import Controller, ControllerHooks
from entr_megatron.controller.model_init import build_task, prepare_model, tokenizer_for
from entr_megatron.controller.run_dir import RunPaths, export_final_model, write_config
from entr_megatron.controller.run_hooks import RunCheckpoints, latest_checkpoint, step_recorder
from entr_megatron.controller.sft import warm_up
from entr_megatron.controller.sglang_setup import check_launch
from entr_megatron.controller.wiring import connect, make_engines

__all__ = ["RunPaths", "build_task", "check_launch", "evaluate", "make_engines", "prepare_model", "run_eval",
           "run_sft", "run_train", "tokenizer_for"]


def run_train(cfg: RunConfig, run_dir: str | os.PathLike | None = None, max_steps: int | None = None) -> dict:
    """SFT (once), then RL until `controller.train_steps` (or `max_steps` more this start); returns
    {"start_step", "eval_before", "steps", "wall_s", "step_s_mean", "stopped"} and, once the last
    step is done, "eval_after"."""
    paths = RunPaths(Path(run_dir or cfg.logging.run_dir))
    check_launch(cfg)  # before anything is written
    write_config(cfg, paths)
    tokenizer = tokenizer_for(cfg)
    task = build_task(cfg, tokenizer)
    start_dir = _start_model(cfg, paths, tokenizer, task)
    resume_step = latest_checkpoint(paths.checkpoints)
    c, done = cfg.controller, resume_step or 0
    remaining = c.train_steps - done if max_steps is None else min(c.train_steps - done, max_steps)
    out: dict[str, Any] = {"start_step": done}
    with ExitStack() as stack:
        engine, learner, pusher = connect(cfg, start_dir, stack, paths.root / "sglang")
        if resume_step is None and engine.weight_version != 0:  # servers given by URL: the learner's weights
            say("pushing the learner's weights to the engines (version 0)")
            pusher.push(0).wait()
        held_out = HeldOut(cfg, task, engine, paths)
        out["eval_before"] = held_out.before_rl(fresh=resume_step is None)
        controller = Controller(engine, learner, pusher, task, c, cfg.rollout,
                                advantage_fn=cfg.algorithm.advantage_estimator)
        checkpoints = RunCheckpoints(learner, paths.checkpoints, c.keep_last_checkpoints)
        if resume_step is not None:
            checkpoints.resume(controller)
        on_step = step_recorder(cfg, paths.root, stack, pusher, done)
        stop = stack.enter_context(StopFlag())
        controller.hooks = ControllerHooks(on_step=[on_step], checkpoint_interval=c.checkpoint_interval,
                                           on_checkpoint=checkpoints.save, eval_interval=c.eval_interval,
                                           on_eval=held_out.during_rl, should_stop=stop)
        out.update(_run_steps(controller, remaining))
        if out["steps"] and not stop() and (not c.checkpoint_interval or controller.step % c.checkpoint_interval):
            controller.drain()
            checkpoints.save(controller)
        if controller.step >= c.train_steps and not stop():
            controller.drain()
            out["eval_after"] = held_out.after_rl()
            export_final_model(learner, paths, start_dir)
            held_out.report(out["eval_before"], out["eval_after"])
        out["stopped"] = stop()
        if stop():
            say(f"stopped at step {controller.step} (checkpoint saved); run the same command to resume")
    return out


def run_sft(cfg: RunConfig, run_dir: str | os.PathLike | None = None, steps: int | None = None) -> Path:
    """The supervised warm-up alone (`sft.steps`, or `steps`); returns run_dir/sft/model."""
    paths = RunPaths(Path(run_dir or cfg.logging.run_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(cfg)
    return warm_up(cfg, paths, prepare_model(cfg, paths, tokenizer), build_task(cfg, tokenizer), steps=steps)


def run_eval(cfg: RunConfig, model: Path, n: int | None = None) -> dict:
    """Held-out accuracy of the HF model in `model` on `n` (default `task.eval_size`) problems of
    the config's task, with its own tokenizer when it has one."""
    from entr_megatron.rollout.tasks import load_tokenizer

    if cfg.rollout.engine == "embedded":  # one engine is plenty for an evaluation
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_engines=1))
    has_tokenizer = (model / "tokenizer.json").exists() or (model / "tokenizer_config.json").exists()
    task = build_task(cfg, load_tokenizer(str(model)) if has_tokenizer else tokenizer_for(cfg))
    with ExitStack() as stack:
        [engine] = make_engines(cfg, model, stack)  # SGLang: one engine over all servers
        metrics = evaluate(engine, task, n or cfg.task.eval_size, cfg.rollout.sampling, cfg.controller.seed)
    return {"model": str(model), **metrics}


def _start_model(cfg: RunConfig, paths: RunPaths, tokenizer: Any, task: Any) -> Path:
    """The HF model RL starts from: after the warm-up when the config has one."""
    model_dir = prepare_model(cfg, paths, tokenizer)
    if cfg.sft is not None and cfg.sft.steps > 0:
        return warm_up(cfg, paths, model_dir, task)
    return model_dir


def _run_steps(controller: Controller, steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    history = controller.run(steps) if steps > 0 else []
    wall = time.perf_counter() - t0
    return {"steps": len(history), "wall_s": wall, "step_s_mean": wall / len(history) if history else None}

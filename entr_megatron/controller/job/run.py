"""The jobs of the CLI: `train` (SFT warm-up once, then asynchronous RL, resumable), `sft`, `eval`.

    run_train(cfg, run_dir)    model_init -> SFT -> engines + learner ranks (wiring.connect) -> Controller.run
    run_sft(cfg, run_dir)      the warm-up alone (sft.py)
    run_eval(cfg, model_dir)   held-out accuracy of one HF model (evaluation.py)
    check_inputs(cfg, command) what a job reads, checked before anything starts or is written

`train` resumes where the run stopped (the layout: run_dir.py): SFT is skipped when `sft/model`
exists, RL continues from the newest checkpoint that verifies against its manifest (weights,
optimizer, data position, staleness buffer, RNG; a damaged or missing one is named and the one
before used, never a silent fresh start: run_hooks.resume_point); metrics.jsonl drops the lines
of steps that are redone. A learner rank that fails is replaced with the engines kept
(launcher.max_restarts times: new ranks from the last checkpoint, whose weights are pushed over
whatever the engines held; `learner_restarts` in the result, learner/restarts in metrics.jsonl).
One job per run directory (utils/run_lock.py). Ctrl-C or SIGTERM
finishes the current step, saves a checkpoint and exits 0 (SIGTERM within
controller.stop_grace_s); a second signal stops at once (console.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from entr_megatron import models
from entr_megatron.checkpoint.directory import clean_stale
from entr_megatron.config.launcher import CPU_RANKS_PER_CORE, LauncherConfig
from entr_megatron.config.run import RunConfig
from entr_megatron.config.validate import FieldError, readable_files
from entr_megatron.controller.job.evaluation import HeldOut, evaluate
from entr_megatron.controller.job.model_init import build_task, prepare_model, tokenizer_for
from entr_megatron.controller.job.run_dir import RunPaths, export_final_model, write_config
from entr_megatron.controller.job.run_hooks import RunCheckpoints, check_disk, resume_point, step_recorder
from entr_megatron.controller.job.sft import warm_up
from entr_megatron.controller.job.sglang_setup import check_launch
from entr_megatron.controller.job.wiring import connect, make_engines, relaunch_learner, with_episodes
from entr_megatron.controller.ranks.workers import WorkerError
from entr_megatron.controller.rl.loop import Controller, ControllerHooks
from entr_megatron.learner.hf_load import read_hf_config
from entr_megatron.tasks import TASK_BUILDERS, check_task_files, load_tokenizer, task_class
from entr_megatron.utils.console import StopFlag, say
from entr_megatron.utils.megatron_warnings import fallback_summary
from entr_megatron.utils.run_lock import RunLock
from entr_megatron.utils.spawn import available_cores

__all__ = ["RunPaths", "build_task", "check_inputs", "check_launch", "check_model_layout", "evaluate",
           "make_engines", "prepare_model", "run_eval", "run_sft", "run_train", "tokenizer_for"]

LEARNER_COMMANDS: Sequence[str] = ("train", "sft")
"""The jobs that build the learner from `model` on the `parallel` layout."""


def check_inputs(cfg: RunConfig, command: str = "train") -> None:
    """What the job `command` ("train", "sft" or "eval") reads, checked before anything is started
    or written: a task `train` can drive for task.name, the chosen task's data files and (train,
    sft) sft.data_files readable, or a task that generates SFT examples when there are none; for train and sft the model against the learner layout
    (`check_model_layout`); for train where SGLang servers may be launched (`check_launch`).
    Raises ValueError naming the field (the CLI prints it and exits 2)."""
    if cfg.task.name not in TASK_BUILDERS:
        raise FieldError("task", "name", cfg.task.name, f"allowed: {', '.join(TASK_BUILDERS)} (the tasks train drives)")
    options = getattr(cfg.task, cfg.task.name, None)  # the section of the chosen task: task.math, ...
    for f in dataclasses.fields(options) if options is not None else ():
        if f.name.endswith("_files"):
            readable_files(options, f.name)
    check_task_files(cfg.task)  # their contents: UTF-8, records, the held-out split
    if command in LEARNER_COMMANDS:
        if cfg.sft is not None:
            readable_files(cfg.sft, "data_files")
            if not cfg.sft.data_files and not hasattr(task_class(cfg.task.name), "sft_examples"):
                raise FieldError("sft", "data_files", [], f"task {cfg.task.name!r} generates no SFT examples: list "
                                 "JSONL files of {\"prompt\", \"response\"} records, or remove the sft section")
        check_model_layout(cfg)
        check_local_ranks(cfg.launcher)
    if command == "train":
        check_launch(cfg)


def check_local_ranks(launcher: LauncherConfig) -> None:
    """Local CPU learner ranks (kind 'local', device 'cpu') share this machine's cores: at most
    CPU_RANKS_PER_CORE per core (FieldError naming launcher.nproc_per_node)."""
    if launcher.kind != "local" or launcher.device != "cpu":
        return
    cores = available_cores()
    if launcher.nproc_per_node > CPU_RANKS_PER_CORE * cores:
        raise FieldError("launcher", "nproc_per_node", launcher.nproc_per_node,
                         f"CPU learner ranks share this machine's {cores} cores: must be at most "
                         f"{CPU_RANKS_PER_CORE * cores} ({CPU_RANKS_PER_CORE} per core)")


def check_model_layout(cfg: RunConfig) -> None:
    """The run's model, from `model.architecture` (its keys checked against transformers' config
    class: models.check_architecture) or model.path's config.json, against parallel.*: tp, pp (x vpp),
    ep and expert_tp must divide the heads, layers, experts... Megatron splits by them, and ep > 1
    needs an MoE model. Raises ValueError naming the field and both numbers."""
    if cfg.model.path is None:
        hf_config, source = models.architecture_hf_config(cfg.model.architecture), "model.architecture"
    else:
        try:
            hf_config = read_hf_config(cfg.model.path)
        except ValueError as e:
            raise FieldError("model", "path", cfg.model.path, str(e)) from None
        source = f"model.path {cfg.model.path}"
    try:
        spec = models.model_spec(hf_config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    p = cfg.parallel
    if p.ep > 1 and not spec.is_moe:
        raise FieldError("parallel", "ep", p.ep, f"needs an MoE model; the model of {source} is dense: use 1")
    conflicts = models.layout_conflicts(spec, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, expert_tp=p.expert_tp)
    if conflicts:
        size = conflicts[0].size
        same = [c for c in conflicts if c.size == size]
        divide = f"pp * vpp = {same[0].divisor} must divide" if size == "vpp" else "must divide"
        raise FieldError(
            "parallel", size, getattr(p, size),
            f"{divide} {', '.join(f'{c.field}={c.value}' for c in same)} of the model ({source}): "
            f"{models.LAYOUT_REASONS[size]}",
            when=f"parallel.pp={p.pp}" if size == "vpp" else "",
        )


def run_train(cfg: RunConfig, run_dir: str | os.PathLike | None = None, max_steps: int | None = None,
              restart_from_scratch: bool = False, *, inputs_checked: bool = False) -> dict:
    """SFT (once), then RL until `controller.train_steps` (or `max_steps` more this start); returns
    {"start_step", "eval_before", "eval_before_s", "rl_started_unix", "steps", "wall_s", "step_s_mean",
    "stopped"} and, once the last step is done, "eval_after" ("rl_started_unix": the wall clock when
    the first RL step began, so that a caller can time the start-up). The run directory is locked
    for the job (RunLockedError when another job holds it); RL resumes from its newest good
    checkpoint (`resume_point`).
    `inputs_checked`: the caller ran `check_inputs(cfg, "train")` already (the CLI does, to report
    an invalid config before anything starts), so it is not run again."""
    paths = RunPaths(Path(run_dir or cfg.logging.run_dir))
    if not inputs_checked:
        check_inputs(cfg, "train")  # before anything is written
    tokenizer = tokenizer_for(cfg)
    task = build_task(cfg, tokenizer)  # reads the data files: bad ones fail before config.yaml is rewritten
    with RunLock(paths.root, "train") as lock:
        if lock.previous.get("pid"):
            say(f"{paths.root} was last held by pid {lock.previous['pid']} on {lock.previous.get('host')}, "
                "which is gone (killed?): taking over")
        removed = clean_stale(paths.checkpoints)  # a crashed save's debris can fill the disk
        if removed:
            say(f"removed the leftovers of an interrupted checkpoint save: {', '.join(removed)}")
        write_config(cfg, paths)
        _say_fallbacks(cfg)
        return _train_restarting(cfg, paths, tokenizer, task, max_steps, restart_from_scratch)


def _say_fallbacks(cfg: RunConfig) -> None:
    """The run's one line about Megatron's missing fast paths (the warnings are silenced where
    each process starts: utils/megatron_warnings.py)."""
    line = fallback_summary(on_gpu=cfg.launcher.device == "cuda")
    if line is not None:
        say(line)


def _train_restarting(cfg: RunConfig, paths: RunPaths, tokenizer: Any, task: Any, max_steps: int | None,
                      restart_from_scratch: bool) -> dict:
    """RL on one set of engines; when a learner rank fails, new ranks take over from the last
    checkpoint, up to launcher.max_restarts times (torchrun's meaning), the engines kept: the
    groups in flight are aborted, the weight groups rebuilt with the live engines and the
    checkpoint's weights pushed over whatever (newer) version they held (wiring.relaunch_learner)."""
    start_dir = _start_model(cfg, paths, tokenizer, task)
    resume_step = resume_point(paths, restart_from_scratch)
    check_disk(paths, start_dir, cfg.controller.keep_last_checkpoints)
    c, budget = cfg.controller, cfg.launcher.max_restarts
    done = resume_step or 0
    until = c.train_steps if max_steps is None else min(c.train_steps, done + max_steps)
    with ExitStack() as stack:
        base, learner, pusher = connect(cfg, start_dir, stack, paths.root / "sglang")
        engine = with_episodes(cfg, task, base)  # tool tasks: samples are whole episodes
        restarts = 0
        while True:
            try:
                if restarts:  # a relaunch that fails counts as one more failure
                    t0 = time.perf_counter()
                    learner, pusher = relaunch_learner(cfg, start_dir, stack, base, pusher)
                    resume_step = resume_point(paths)
                    say(f"learner ranks relaunched in {time.perf_counter() - t0:.1f} s; resuming from "
                        f"{'step ' + str(resume_step) if resume_step is not None else 'the start (no checkpoint yet)'}")
                out = _train(cfg, paths, task, start_dir, (engine, learner, pusher), resume_step, until, restarts)
                return {**out, "learner_restarts": restarts}
            except WorkerError as e:
                if restarts == budget:
                    raise
                restarts += 1
                first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                say(f"a learner rank failed ({first}); relaunching the learner ranks from the last checkpoint, "
                    f"the engines kept (launcher.max_restarts: {restarts} of {budget})")


def _train(cfg: RunConfig, paths: RunPaths, task: Any, start_dir: Path, processes: tuple[Any, Any, Any],
           resume_step: int | None, until: int, learner_restarts: int) -> dict:
    """RL from `resume_step` (None: the start) to step `until` on `processes` (engine, learner,
    pusher). A learner failure (WorkerError) aborts the groups in flight before it is raised."""
    engine, learner, pusher = processes
    c, done = cfg.controller, resume_step or 0
    out: dict[str, Any] = {"start_step": done}
    with ExitStack() as stack:
        controller = Controller(engine, learner, pusher, task, c, cfg.rollout,
                                advantage_fn=cfg.algorithm.advantage_estimator, recovery=pusher.recovery)
        if resume_step is None:  # servers given by URL, or engines kept across a learner relaunch
            controller.sync_engines()  # before the held-out evaluation (a resume syncs in `run`)
        held_out = HeldOut(cfg, task, engine, paths, recover=controller.recover if pusher.recovery is not None else None)
        t_eval = time.perf_counter()
        out["eval_before"] = held_out.before_rl(fresh=resume_step is None)
        out["eval_before_s"] = time.perf_counter() - t_eval
        checkpoints = RunCheckpoints(learner, paths.checkpoints, c.keep_last_checkpoints)
        if resume_step is not None:
            checkpoints.resume(controller, resume_step)
        on_step = step_recorder(cfg, paths.root, stack, pusher, done, until)
        stop = stack.enter_context(StopFlag(grace_s=c.stop_grace_s))

        def count_restarts(metrics: dict) -> None:
            metrics["learner/restarts"] = float(learner_restarts)

        controller.hooks = ControllerHooks(on_step=[count_restarts, on_step], checkpoint_interval=c.checkpoint_interval,
                                           on_checkpoint=checkpoints.save, eval_interval=c.eval_interval,
                                           on_eval=held_out.during_rl, should_stop=stop)
        try:
            out.update(_run_steps(controller, until - done))
            if out["steps"] and not stop() and (not c.checkpoint_interval or controller.step % c.checkpoint_interval):
                controller.drain()
                checkpoints.save(controller)
            if controller.step >= c.train_steps and not stop():
                controller.drain()
                out["eval_after"] = held_out.after_rl()
                export_final_model(learner, paths, start_dir)
                held_out.report(out["eval_before"], out["eval_after"])
        except WorkerError:
            controller.abandon()  # the engines idle before new ranks take over
            raise
        out["stopped"] = stop()
        if stop():
            say(f"stopped at step {controller.step} (checkpoint saved); run the same command to resume")
    return out


def run_sft(cfg: RunConfig, run_dir: str | os.PathLike | None = None, steps: int | None = None, *,
            inputs_checked: bool = False) -> Path:
    """The supervised warm-up alone (`sft.steps`, or `steps`); returns run_dir/sft/model.
    `inputs_checked`: as for `run_train`."""
    paths = RunPaths(Path(run_dir or cfg.logging.run_dir))
    if not inputs_checked:
        check_inputs(cfg, "sft")  # before anything is written
    tokenizer = tokenizer_for(cfg)
    task = build_task(cfg, tokenizer)
    with RunLock(paths.root, "sft"):
        _say_fallbacks(cfg)
        return warm_up(cfg, paths, prepare_model(cfg, paths, tokenizer), task, steps=steps)


def run_eval(cfg: RunConfig, model: Path, n: int | None = None, split: str = "test", *,
             inputs_checked: bool = False) -> dict:
    """Accuracy of the HF model in `model` on `n` (default `task.eval_size`) problems of the config's
    task (`split`: held-out "test", or "train"), with its own tokenizer when it has one.
    `inputs_checked`: as for `run_train`."""
    if not inputs_checked:
        check_inputs(cfg, "eval")
    if cfg.rollout.engine == "embedded":  # one engine is plenty for an evaluation
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_engines=1))
    has_tokenizer = (model / "tokenizer.json").exists() or (model / "tokenizer_config.json").exists()
    task = build_task(cfg, load_tokenizer(str(model)) if has_tokenizer else tokenizer_for(cfg))
    with ExitStack() as stack:
        [engine] = make_engines(cfg, model, stack)  # SGLang: one engine over all servers
        engine = with_episodes(cfg, task, engine)
        metrics = evaluate(engine, task, n or cfg.task.eval_size, cfg.rollout.sampling, cfg.controller.seed,
                           split=split)
    return {"model": str(model), "split": split, **metrics}


def _start_model(cfg: RunConfig, paths: RunPaths, tokenizer: Any, task: Any) -> Path:
    """The HF model RL starts from: after the warm-up when the config has one."""
    model_dir = prepare_model(cfg, paths, tokenizer)
    if cfg.sft is not None and cfg.sft.steps > 0:
        return warm_up(cfg, paths, model_dir, task)
    return model_dir


def _run_steps(controller: Controller, steps: int) -> dict[str, Any]:
    started_unix, t0 = time.time(), time.perf_counter()
    history = controller.run(steps) if steps > 0 else []
    wall = time.perf_counter() - t0
    return {"steps": len(history), "wall_s": wall, "step_s_mean": wall / len(history) if history else None,
            "rl_started_unix": started_unix}

"""`entr-megatron train | sft | eval`: the main job, its warm-up, and held-out evaluation.

    entr-megatron train --config examples/cpu_demo.yaml [--run-dir DIR] [--max-steps N] \\
        [--launcher local|ray] [--restart-from-scratch] [controller.mode=sync algorithm.tau=0.3 ...]
    entr-megatron sft   --config FILE [--run-dir DIR] [--steps N] [key=value ...]
    entr-megatron eval  --config FILE (--run-dir DIR | --model HF_DIR) [--n N] [key=value ...]   (not both)

The config (YAML plus dotted overrides) is validated before anything starts, and
so is what it points to (the task's data files, the model against the parallel
layout): a bad value stops the command with the field, the value and what is
allowed (exit status 2). `model.path` may be an HF directory or a learner checkpoint
root / run directory (e.g. `convert hf-to-megatron`'s output), whose latest step is first
converted into RUN_DIR/model_init (once, streamed) and the run started from that.
`train` runs the SFT warm-up when the config has an `sft` section and the run
directory has no SFT model yet, then RL; it resumes a run directory where it
stopped, from its newest checkpoint that verifies (see controller/job/run_dir.py for
the layout; --restart-from-scratch starts over, keeping the old ones aside). A
second job on a run directory in use exits 2 naming the holder. Ctrl-C or SIGTERM
saves a checkpoint at the end of the step and exits 0; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from entr_megatron.checkpoint.directory import CheckpointError, CheckpointSaveError
from entr_megatron.config.launcher import check_ray_reachable
from entr_megatron.config.loader import load_config
from entr_megatron.controller.job.run_dir import check_run_dir
from entr_megatron.controller.job.run_hooks import DiskSpaceError
from entr_megatron.utils.ray_connect import RayConnectError
from entr_megatron.utils.run_lock import RunLockedError

__all__ = ["add_parsers"]


def _load(args) -> object:
    overrides = list(args.overrides)
    if getattr(args, "launcher", None):
        overrides.append(f"launcher.kind={args.launcher}")
    try:
        cfg = load_config(args.config, overrides)
        # lazy: torch (the job and the model's files), after the config is known good
        from entr_megatron.controller.job.run import check_inputs
        from entr_megatron.controller.job.model_init import from_learner_checkpoint

        if args.command in ("train", "sft"):  # never writing onto what it reads
            check_run_dir(cfg, args.run_dir or cfg.logging.run_dir)
        # model.path a learner checkpoint: the run starts from its HF export in run_dir/model_init
        cfg = from_learner_checkpoint(cfg, args.run_dir or cfg.logging.run_dir)
        _preflight(cfg, args.command)
        check_inputs(cfg, args.command)  # the task's files, the model against parallel.*, ...: once (the job is told)
        return cfg
    except (ValueError, FileNotFoundError) as e:
        print(f"entr-megatron {args.command}: invalid config: {e}", file=sys.stderr)
        sys.exit(2)


def _preflight(cfg, command: str) -> None:
    """Before anything starts (ValueError): the files of model.path (train, sft: config.json, every
    safetensors header, the tokenizer unless model.tokenizer names another), a local model.tokenizer,
    and with launcher.kind 'ray' that launcher.ray_address answers."""
    from entr_megatron.checkpoint.model_inputs import check_model_dir, check_tokenizer_dir  # lazy: torch

    if cfg.launcher.kind == "ray" and command in ("train", "sft"):  # seconds, not Ray's half-minute of retries
        check_ray_reachable(cfg.launcher.ray_address)
    if cfg.model.tokenizer:
        check_tokenizer_dir(cfg.model.tokenizer, "model.tokenizer")
    if cfg.model.path and command in ("train", "sft"):
        check_model_dir(cfg.model.path, "model.path", tokenizer=not cfg.model.tokenizer,
                        tokenizer_hint="set model.tokenizer to a directory that has one")


def _positive_int(text: str) -> int:
    """argparse type of a count: an integer >= 1 (a usage error naming the flag otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value} (leave --n out for task.eval_size)")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE.yaml", help="run config (see examples/)")
    p.add_argument("--run-dir", default=None, metavar="DIR", help="default: logging.run_dir of the config")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. controller.mode=sync rollout.sampling.n=4")


def _refused(command: str, job, *args, **kwargs):
    """`job(*args, **kwargs)`; a run directory another job holds, that is not writable or has no
    room for a checkpoint, or whose checkpoints are all unusable, a Ray address Ray cannot join, is
    one message and exit 2
    (nothing started); a failed save (e.g. a full disk), an engine that failed once too often or a
    learner rank's node lost (Ray) one message and exit 1."""
    # lazy: torch (the controller's modules)
    from entr_megatron.controller.rl.engines import RestartsExhausted
    from entr_megatron.controller.ranks.ray_workers import LearnerNodeLost

    try:
        return job(*args, **kwargs)
    except (RunLockedError, DiskSpaceError, RayConnectError) as e:
        print(f"entr-megatron {command}: {e}", file=sys.stderr)
        sys.exit(2)
    except LearnerNodeLost as e:  # mid-run, the node gone: the last checkpoint resumes once it is back
        print(f"entr-megatron {command}: {str(e).splitlines()[0]}\nThe run stopped. Bring the node back (or give "
              "launcher.ray_learner_resources to nodes that live) and run the same command: it resumes from the "
              "last checkpoint.", file=sys.stderr)
        sys.exit(1)
    except (CheckpointSaveError, RestartsExhausted) as e:  # mid-run: the last checkpoint resumes
        print(f"entr-megatron {command}: {e}\nRun the same command to resume from the last checkpoint.",
              file=sys.stderr)
        sys.exit(1)
    except CheckpointError as e:
        hint = ("\nNothing was loaded or overwritten. To start over anyway (checkpoints and metrics kept aside), "
                "rerun with --restart-from-scratch" if command == "train" else "")
        print(f"entr-megatron {command}: {e}{hint}", file=sys.stderr)
        sys.exit(2)


def run_train(args) -> None:
    from entr_megatron.controller.job.run import run_train as job  # lazy: torch

    cfg = _load(args)
    if args.max_steps is not None and args.max_steps < 1:
        print("entr-megatron train: --max-steps must be >= 1", file=sys.stderr)
        sys.exit(2)
    result = _refused("train", job, cfg, args.run_dir, max_steps=args.max_steps,
                      restart_from_scratch=args.restart_from_scratch, inputs_checked=True)
    print(json.dumps(result, default=str))


def run_sft(args) -> None:
    from entr_megatron.controller.job.run import run_sft as job  # lazy: torch

    cfg = _load(args)
    if cfg.sft is None:
        print("entr-megatron sft: the config has no `sft` section", file=sys.stderr)
        sys.exit(2)
    out = _refused("sft", job, cfg, args.run_dir, steps=args.steps, inputs_checked=True)
    print(json.dumps({"sft_model": str(out)}))


def run_eval(args) -> None:
    # lazy: torch and the engine's modules
    from entr_megatron.controller.job.run import RunPaths
    from entr_megatron.controller.job.run import run_eval as job

    if args.model and args.run_dir:
        print("entr-megatron eval: --run-dir and --model are exclusive: --model names the model to evaluate, "
              "--run-dir the run whose newest model is evaluated (final_model, sft/model, model_init)", file=sys.stderr)
        sys.exit(2)
    cfg = _load(args)
    if args.n is None and cfg.task.eval_size < 1:  # the evaluation would divide by its 0 problems
        print(f"entr-megatron eval: task.eval_size={cfg.task.eval_size} is not valid for eval; 0 turns off train's "
              "evaluations: pass --n N or set task.eval_size >= 1", file=sys.stderr)
        sys.exit(2)
    if args.model:
        model = Path(args.model)
    else:
        paths = RunPaths(Path(args.run_dir or cfg.logging.run_dir))
        model = paths.latest_model()
        if model is None:
            print(f"entr-megatron eval: {paths.root} holds no model (final_model, sft/model or model_init); "
                  "pass --model", file=sys.stderr)
            sys.exit(2)
    from entr_megatron.checkpoint.model_inputs import check_model_dir  # lazy: torch

    try:  # the engine reads its config and weights; the tokenizer may come from the config instead
        check_model_dir(model, "--model" if args.model else "the run's model", tokenizer=False)
    except ValueError as e:
        print(f"entr-megatron eval: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(job(cfg, model, n=args.n, split=args.split, inputs_checked=True)))


def add_parsers(sub) -> None:
    p = sub.add_parser("train", help="SFT warm-up (once) then asynchronous RL with ENTR; resumable",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after N more RL steps this start (default: until controller.train_steps)")
    p.add_argument("--launcher", choices=("local", "ray"), default=None,
                   help="learner ranks as local processes or Ray actors (default: launcher.kind)")
    p.add_argument("--restart-from-scratch", action="store_true",
                   help="start RL from step 0 even though the run directory has checkpoints (they and "
                        "metrics.jsonl are kept aside as *.discarded-<time>); without it an unusable "
                        "checkpoint is an error, never a silent fresh start")
    p.set_defaults(func=run_train)

    p = sub.add_parser("sft", help="the supervised warm-up only (writes RUN_DIR/sft/model)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--steps", type=int, default=None, metavar="N", help="default: sft.steps")
    p.set_defaults(func=run_sft)

    p = sub.add_parser("eval", help="greedy held-out accuracy of a model on the config's task",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--model", default=None, metavar="HF_DIR",
                   help="default: RUN_DIR/final_model, else sft/model, else model_init")
    p.add_argument("--n", type=_positive_int, default=None, metavar="N",
                   help="problems, an integer >= 1 (default: task.eval_size)")
    p.add_argument("--split", choices=("test", "train"), default="test",
                   help="held-out problems (default), or training ones: the success of what RL trained on")
    p.set_defaults(func=run_eval)

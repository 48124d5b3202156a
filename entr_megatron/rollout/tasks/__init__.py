"""Tasks and rewards (rollout side): prompts by split and verifiable rewards, by name.

    task = make_task("arithmetic", digits=2)      # or "math" (files=...), "calculator"
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer, cfg.model.max_prompt_len)   # what `train` runs
    check_task_files(cfg.task)                    # its data files, parsed without a tokenizer (config checks)
    pairs = task.prompts("train", n=64, seed=step)
    reward = task.reward(sample, reference)

- `arithmetic.py`: synthetic multi-digit arithmetic with a local character tokenizer
  (`char_tokenizer.py`, also writes a tiny matching model config);
- `math_data.py` + `math_reward.py`: problems from JSONL/Parquet, math-verify reward;
- `environment.py`: the multi-turn `Environment` protocol and the agent loop
  (`run_episodes`) over a `RolloutEngine`; `calculator.py`: the first tool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from entr_megatron.rollout.tasks.arithmetic import ArithmeticTask, arithmetic_reward
from entr_megatron.rollout.tasks.base import SPLITS, Task, decode_response
from entr_megatron.rollout.tasks.calculator import CalculatorEnv, CalculatorError, CalculatorTask, safe_eval
from entr_megatron.rollout.tasks.char_tokenizer import (
    build_char_tokenizer, load_tokenizer, save_char_tokenizer, write_tiny_model_config,
)
from entr_megatron.rollout.tasks.environment import OBSERVATION_LOGPROB, Environment, Episode, Step, run_episodes
from entr_megatron.rollout.tasks.math_data import MathProblem, MathTask, check_math_files, load_problems
from entr_megatron.rollout.tasks.math_reward import math_verify_reward, normalised_match_reward

if TYPE_CHECKING:
    from entr_megatron.config.run import TaskConfig

__all__ = [
    "OBSERVATION_LOGPROB", "SPLITS", "TASKS", "TASK_BUILDERS",
    "ArithmeticTask", "CalculatorEnv", "CalculatorError", "CalculatorTask", "Environment", "Episode",
    "MathProblem", "MathTask", "Step", "Task",
    "arithmetic_reward", "build_char_tokenizer", "check_task_files", "decode_response", "load_problems",
    "load_tokenizer",
    "make_task", "math_verify_reward", "normalised_match_reward", "run_episodes", "safe_eval",
    "save_char_tokenizer", "write_tiny_model_config",
]

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "math": MathTask, "calculator": CalculatorTask}
"""Task name -> class; each implements `Task` (prompts, reward, new_environment)."""


def make_task(name: str, **kwargs: Any) -> Task:
    """The task `name` built with `kwargs` (its constructor's arguments)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](**kwargs)


def _arithmetic(t: TaskConfig, tokenizer: Any, max_prompt_len: int | None = None) -> ArithmeticTask:
    a = t.arithmetic
    task = ArithmeticTask(a.digits, a.operations, tokenizer=tokenizer, reverse_answer=a.reverse_answer,
                          pad_operands=a.pad_operands, format_reward=a.format_reward)
    # Generated prompts have one shape ("99+99="): the longest is known before any is drawn.
    longest = max(len(task.tokenizer.encode(f"{'9' * a.digits}{op}{'9' * a.digits}=")) for op in a.operations)
    if max_prompt_len is not None and longest > max_prompt_len:
        raise ValueError(f"model.max_prompt_len={max_prompt_len} is shorter than the longest arithmetic prompt "
                         f"({longest} tokens with task.arithmetic.digits={a.digits}); raise it")
    return task


def _math(t: TaskConfig, tokenizer: Any, max_prompt_len: int | None = None) -> MathTask:
    m = t.math
    files = {"train": list(m.train_files)}
    if m.eval_files:
        files["test"] = list(m.eval_files)
    return MathTask(tokenizer, files, prompt_template=m.prompt_template, prompt_key=m.prompt_key,
                    answer_key=m.answer_key, max_prompt_len=max_prompt_len,
                    held_out=0 if m.eval_files else t.eval_size)


TASK_BUILDERS: dict[str, Callable[[TaskConfig, Any, int | None], Task]] = {"arithmetic": _arithmetic, "math": _math}
"""The single-turn tasks `train` drives, by `task.name` (exactly config.run.TASK_NAMES): each builds
the task from the `task` section, the policy's tokenizer and model.max_prompt_len (math leaves out
longer prompts; arithmetic refuses a limit its prompts exceed). The multi-turn calculator is not one
of them: it runs through `run_episodes`, which the training loop does not drive yet."""


def _math_files(t: TaskConfig) -> None:
    m = t.math
    check_math_files(m.train_files, m.eval_files, held_out=0 if m.eval_files else t.eval_size,
                     prompt_key=m.prompt_key, answer_key=m.answer_key)


TASK_FILE_CHECKS: dict[str, Callable[[TaskConfig], None]] = {"math": _math_files}
"""The tasks that read data files, by `task.name`: what `check_task_files` runs."""


def check_task_files(task_cfg: TaskConfig) -> None:
    """Checks the data files of the `task` section up front, without a tokenizer and before
    anything starts: raises ValueError naming the file (and line, item or row) of a missing,
    unreadable, non-UTF-8, empty or malformed file, or when task.eval_size problems cannot be held
    out of the training files (no task.math.eval_files). Parses every record once (no tokenizing);
    prompt lengths against model.max_prompt_len are checked when the task is built. A task
    without files (arithmetic) passes."""
    check = TASK_FILE_CHECKS.get(task_cfg.name)
    if check is not None:
        check(task_cfg)

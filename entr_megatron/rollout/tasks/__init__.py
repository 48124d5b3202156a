"""Tasks and rewards (rollout side): prompts by split and verifiable rewards, by name.

    task = make_task("arithmetic", digits=2)      # or "math" (files=...), "calculator"
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer)   # what `train` runs, from its config
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
from entr_megatron.rollout.tasks.math_data import MathProblem, MathTask, load_problems
from entr_megatron.rollout.tasks.math_reward import math_verify_reward, normalised_match_reward

if TYPE_CHECKING:
    from entr_megatron.config.run import TaskConfig

__all__ = [
    "OBSERVATION_LOGPROB", "SPLITS", "TASKS", "TASK_BUILDERS",
    "ArithmeticTask", "CalculatorEnv", "CalculatorError", "CalculatorTask", "Environment", "Episode",
    "MathProblem", "MathTask", "Step", "Task",
    "arithmetic_reward", "build_char_tokenizer", "decode_response", "load_problems", "load_tokenizer",
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


def _arithmetic(t: TaskConfig, tokenizer: Any) -> ArithmeticTask:
    a = t.arithmetic
    return ArithmeticTask(a.digits, a.operations, tokenizer=tokenizer, reverse_answer=a.reverse_answer,
                          pad_operands=a.pad_operands, format_reward=a.format_reward)


def _math(t: TaskConfig, tokenizer: Any) -> MathTask:
    files = {"train": list(t.math.train_files)}
    if t.math.eval_files:
        files["test"] = list(t.math.eval_files)
    return MathTask(tokenizer, files)


TASK_BUILDERS: dict[str, Callable[[TaskConfig, Any], Task]] = {"arithmetic": _arithmetic, "math": _math}
"""The single-turn tasks `train` drives, by `task.name` (exactly config.run.TASK_NAMES): each builds
the task from the `task` section and the policy's tokenizer. The multi-turn calculator is not one
of them: it runs through `run_episodes`, which the training loop does not drive yet."""

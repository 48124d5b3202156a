"""Tasks and rewards (rollout side): prompts by split and verifiable rewards, by name.

    task = make_task("arithmetic", digits=2)      # or "math" (files=...), "calculator", "countdown"
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer, cfg.model.max_prompt_len)   # what `train` runs
    check_task_files(cfg.task)                    # its data files, parsed without a tokenizer (config checks)
    pairs = task.prompts("train", n=64, seed=step)
    reward = task.reward(sample, reference)

- `arithmetic.py`: synthetic multi-digit arithmetic with a local character tokenizer
  (`char_tokenizer.py`, also writes a tiny matching model config);
- `countdown.py`: combine a few numbers into a target with a written scratchpad (40-50 token
  responses); its rules and solver (`countdown_rules.py`) and a labeller of every response token
  (forced / choice / arithmetic / answer: `countdown_labels.py`);
- `copy_lines.py`: copy a line of Python from files held out of the long-tail testbed's pretraining (every
  response token determined by the prompt; needs the model's BPE tokenizer);
- `math_data.py` + `math_reward.py`: problems from JSONL/Parquet, math-verify reward;
- `environment.py`: the multi-turn `Environment` protocol (episodes run through
  `rollout.episodes.EpisodeEngine`, or in a batch by `rollout.episode_batch.run_episodes`);
  `calculator.py`: a calculator tool task in its own `<calc>` format; `tool_env.py`: the environment of Hermes-format tool calls
  (`tasks/tools/`); `search.py`: multi-hop questions over a generated corpus with a BM25
  `search` tool (BrowseComp-Plus style).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from entr_megatron.tasks.arithmetic import ArithmeticTask, arithmetic_reward
from entr_megatron.tasks.base import SPLITS, Task, decode_response
from entr_megatron.tasks.calculator import CalculatorEnv, CalculatorError, CalculatorTask, safe_eval
from entr_megatron.tasks.char_tokenizer import (
    build_char_tokenizer, load_tokenizer, save_char_tokenizer, write_tiny_model_config,
)
from entr_megatron.tasks.copy_lines import CopyTask
from entr_megatron.tasks.countdown import CountdownProblem, CountdownTask, label_response
from entr_megatron.tasks.environment import OBSERVATION_LOGPROB, Environment, Step
from entr_megatron.tasks.math_data import MathProblem, MathTask, check_math_files, load_problems
from entr_megatron.tasks.math_reward import math_verify_reward, normalised_match_reward
from entr_megatron.tasks.search import SearchTask, search_tokenizer

if TYPE_CHECKING:
    from entr_megatron.config.run import TaskConfig

__all__ = [
    "OBSERVATION_LOGPROB", "SPLITS", "TASKS", "TASK_BUILDERS",
    "ArithmeticTask", "CalculatorEnv", "CalculatorError", "CalculatorTask", "CopyTask", "CountdownProblem",
    "CountdownTask",
    "Environment",
    "MathProblem", "MathTask", "Step", "Task",
    "arithmetic_reward", "build_char_tokenizer", "check_task_files", "decode_response", "default_tokenizer",
    "load_problems",
    "label_response", "load_tokenizer", "task_class",
    "make_task", "math_verify_reward", "normalised_match_reward", "safe_eval",
    "save_char_tokenizer", "write_tiny_model_config",
]

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "math": MathTask, "calculator": CalculatorTask,
                          "countdown": CountdownTask, "copy": CopyTask}
"""Task name -> class; each implements `Task` (prompts, reward, new_environment). The search task
(`search.py`; its BM25 index needs bm25s, the "agent" extra, imported when an index is built) is
`task_class("search")`, made by `make_task("search")`."""


def task_class(name: str) -> type:
    """The class of task `name` (TASKS, and the search task imported on use)."""
    if name == "search":
        return SearchTask
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS) + ['search']}, got {name!r}")
    return TASKS[name]


def make_task(name: str, **kwargs: Any) -> Task:
    """The task `name` built with `kwargs` (its constructor's arguments)."""
    return task_class(name)(**kwargs)


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


def _check_prompts(task: Any, name: str, max_prompt_len: int | None) -> None:
    """Refuses a model.max_prompt_len that the task's longest prompt exceeds (its prompts are
    generated: a sample of both splits is measured)."""
    if max_prompt_len is None:
        return
    longest = max(len(ids) for split in ("train", "test") for ids, _ in task.prompts(split, 64, 0))
    if longest > max_prompt_len:
        raise ValueError(f"model.max_prompt_len={max_prompt_len} is shorter than the {name} task's prompts "
                         f"(up to {longest} tokens); raise it")


def _calculator(t: TaskConfig, tokenizer: Any, max_prompt_len: int | None = None) -> CalculatorTask:
    task = CalculatorTask(t.calculator.digits, tokenizer=tokenizer)
    _check_prompts(task, "calculator", max_prompt_len)
    return task


def _countdown(t: TaskConfig, tokenizer: Any, max_prompt_len: int | None = None) -> CountdownTask:
    c = t.countdown
    task = CountdownTask(c.num_operands, c.min_number, c.max_number, max_value=c.max_value, min_target=c.min_target,
                         max_target=c.max_target, ops=c.operations, format_reward=c.format_reward, tokenizer=tokenizer,
                         separator_variants=c.separator_variants, variant_set=c.variant_set,
                         layout=c.layout)
    _check_prompts(task, "countdown", max_prompt_len)
    return task


def _copy(t: TaskConfig, tokenizer: Any, max_prompt_len: int | None = None) -> CopyTask:
    c = t.copy
    if max_prompt_len is not None and c.max_tokens + 2 > max_prompt_len:
        raise ValueError(f"model.max_prompt_len={max_prompt_len} is shorter than the copy task's longest prompt "
                         f"(task.copy.max_tokens={c.max_tokens} + BOS and newline); raise it to {c.max_tokens + 2}")
    return CopyTask(tokenizer, min_tokens=c.min_tokens, max_tokens=c.max_tokens, sft_split_prob=c.sft_split_prob,
                    max_token_id=c.max_token_id)


def _search(t: TaskConfig, tokenizer: Any, max_prompt_len: int | None = None) -> Task:
    s = t.search
    task = SearchTask(num_entities=s.num_entities, hops=s.hops, top_k=s.top_k, corpus_seed=s.corpus_seed,
                      python_tool=s.python_tool, python_tool_allow_weak_containment=s.python_tool_allow_weak_containment,
                      sft_questions=s.sft_questions, fuzzy_search=s.fuzzy_search,
                      tokenizer=tokenizer, world=s.world, name_pool=s.name_pool)
    _check_prompts(task, "search", max_prompt_len)
    return task


def default_tokenizer(task_name: str) -> Any:
    """The tokenizer a task runs with when the config names none (model.path / model.tokenizer):
    the character tokenizer, with the task's tool markers; None for tasks that need the model's."""
    if task_name in ("arithmetic", "calculator", "countdown"):
        return build_char_tokenizer()
    if task_name == "search":
        return search_tokenizer()
    return None


TASK_BUILDERS: dict[str, Callable[[TaskConfig, Any, int | None], Task]] = {
    "arithmetic": _arithmetic, "math": _math, "calculator": _calculator, "search": _search, "countdown": _countdown,
    "copy": _copy,
}
"""The tasks `train` drives, by `task.name` (exactly config.task.TASK_NAMES): each builds the task from
the `task` section, the policy's tokenizer and model.max_prompt_len (math leaves out longer prompts;
the generated tasks refuse a limit their prompts exceed). The multi-turn ones (config.task.MULTI_TURN_TASKS:
calculator, search) return an environment from `new_environment()`: `train` drives their episodes
through `rollout.episodes.EpisodeEngine`."""


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

"""Math problems from JSONL or Parquet files, with a math-verify reward.

    task = MathTask(tokenizer, {"train": ["train.jsonl"], "test": ["test.parquet"]})
    task.prompts("train", 8, seed=step)      # [(prompt ids, reference answer), ...]

Each record needs a problem (field `prompt` or `problem`) and a reference (field
`answer`, else `solution`, whose last \\boxed{...} is the answer). A bad record
stops loading with the file, the line (JSONL, 1-based) or row (Parquet, 0-based)
and the missing field. Parquet needs pyarrow (imported only for .parquet files).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from entr_megatron.rollout.tasks.base import SPLITS, check_split, decode_response
from entr_megatron.rollout.tasks.math_reward import (
    MATH_EXTRA_HINT, math_verify_available, math_verify_reward, normalised_match_reward,
)
from entr_megatron.types import Sample

__all__ = ["DEFAULT_TEMPLATE", "REWARD_BACKENDS", "MathProblem", "MathTask", "load_problems"]

PROMPT_FIELDS = ("prompt", "problem")
ANSWER_FIELDS = ("answer", "solution")
REWARD_BACKENDS = ("auto", "math_verify", "normalise")
DEFAULT_TEMPLATE = "{problem}\nPut your final answer within \\boxed{{}}."


@dataclass(frozen=True)
class MathProblem:
    problem: str
    answer: str
    source: str
    """"file:line" (JSONL) or "file:row N" (Parquet), for error messages and debugging."""


def _record(obj: Any, where: str) -> MathProblem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {PROMPT_FIELDS[0]!r}/{PROMPT_FIELDS[1]!r} "
                         f"and {ANSWER_FIELDS[0]!r}/{ANSWER_FIELDS[1]!r}, got {type(obj).__name__}")
    fields = {}
    for kind, names in (("problem", PROMPT_FIELDS), ("answer", ANSWER_FIELDS)):
        value = next((obj[n] for n in names if obj.get(n) not in (None, "")), None)
        if value is None:
            raise ValueError(f"{where}: missing field {names[0]!r} (or {names[1]!r}); fields present: {sorted(obj)}")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: field for the {kind} must be a string or number, got {type(value).__name__}")
        fields[kind] = str(value)
    return MathProblem(fields["problem"], fields["answer"], where)


def _load_jsonl(path: str) -> list[MathProblem]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            out.append(_record(obj, f"{path}:{lineno}"))
    return out


def _load_parquet(path: str) -> list[MathProblem]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from e
    rows = pq.read_table(path).to_pylist()
    return [_record(row, f"{path}: row {i}") for i, row in enumerate(rows)]


def load_problems(paths: str | Sequence[str]) -> list[MathProblem]:
    """Problems of one or more .jsonl / .parquet files, in file order."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    out = []
    for path in paths:
        if not os.path.exists(path):
            raise ValueError(f"math data file {path!r} does not exist")
        if path.endswith((".jsonl", ".json")):
            problems = _load_jsonl(path)
        elif path.endswith(".parquet"):
            problems = _load_parquet(path)
        else:
            raise ValueError(f"{path}: unknown format; use .jsonl or .parquet")
        if not problems:
            raise ValueError(f"{path}: no problems in the file")
        out += problems
    return out


class MathTask:
    """Math word problems with verifiable final answers (see module docstring)."""

    name = "math"

    def __init__(
        self,
        tokenizer: Any,
        files: dict[str, str | Sequence[str]],
        *,
        prompt_template: str = DEFAULT_TEMPLATE,
        chat_template: bool = False,
        reward_backend: str = "auto",
    ):
        """tokenizer: the policy's HF tokenizer; files: split -> file(s), "train" required
        ("test" for held-out evaluation); prompt_template: formats `{problem}`;
        chat_template: wrap the prompt as a user turn with the tokenizer's chat template;
        reward_backend: "math_verify", "normalise" (weaker) or "auto" (math-verify when installed)."""
        if reward_backend not in REWARD_BACKENDS:
            raise ValueError(f"reward_backend must be one of {REWARD_BACKENDS}, got {reward_backend!r}")
        if reward_backend == "math_verify" and not math_verify_available():
            raise ImportError(f"reward_backend='math_verify' needs math-verify: {MATH_EXTRA_HINT}")
        if "train" not in files:
            raise ValueError(f"files needs a 'train' entry (splits: {SPLITS}), got {sorted(files)}")
        for split in files:
            check_split(split)
        if "{problem}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{problem}}', got {prompt_template!r}")
        self.tokenizer = tokenizer
        self.problems_by_split = {split: load_problems(p) for split, p in files.items()}
        self.prompt_template, self.chat_template = prompt_template, chat_template
        use_mv = reward_backend == "math_verify" or (reward_backend == "auto" and math_verify_available())
        self.reward_backend = "math_verify" if use_mv else "normalise"
        self._score = math_verify_reward if use_mv else normalised_match_reward

    def encode_prompt(self, problem: str) -> list[int]:
        text = self.prompt_template.format(problem=problem)
        if self.chat_template:
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            ))
        return self.tokenizer.encode(text)

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], str]]:
        """`n` problems of `split` (distinct while the split has enough), a pure function of the arguments."""
        check_split(split)
        if split not in self.problems_by_split:
            raise ValueError(f"no files given for split {split!r}")
        pool = self.problems_by_split[split]
        rng = random.Random(f"{split}:{seed}")
        picks = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
        return [(self.encode_prompt(p.problem), p.answer) for p in picks]

    def reward(self, sample: Sample, reference: str) -> float:
        """1.0 when the response's final answer equals the reference (see `reward_backend`)."""
        return self._score(decode_response(self.tokenizer, sample.response_ids), reference)

    def new_environment(self) -> None:
        return None

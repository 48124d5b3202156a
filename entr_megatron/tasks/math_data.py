"""Math problems from JSONL, JSON or Parquet files, with a math-verify reward.

    check_math_files(["train.jsonl"], eval_files=[], held_out=200)   # parse only: no tokenizer
    task = MathTask(tokenizer, {"train": ["train.jsonl"], "test": ["test.parquet"]}, max_prompt_len=1024)
    task.prompts("train", 8, seed=step)      # [(prompt ids, reference answer), ...]
    task.skipped_too_long                    # problems left out: prompt over max_prompt_len tokens

Each record needs a problem (field `prompt` or `problem`, or the `prompt_key` given)
and a reference (field `answer`, else `solution`, whose last \\boxed{...} is the
answer; or the `answer_key` given). Files are UTF-8: `.jsonl` (one JSON object a
line; blank lines are skipped), `.json` (the same, or one JSON array of objects) or
`.parquet` (needs pyarrow, imported only for them). A missing, unreadable, non-UTF-8
or empty file, or a bad record, stops loading with the file, the line (JSONL,
1-based), item (JSON array, 0-based) or row (Parquet, 0-based), and what is expected.

Held-out split: the "test" files when given; else, with `held_out=N`, the N problems
of the training files with the smallest hash of their text (the same N whatever the
file order, seed or number of files' other problems) leave the training split
(every copy of them), so the splits never share a problem. Prompts longer than
`max_prompt_len` tokens are left out of both splits when the task is built (before the
held-out problems are chosen, so the test split still has N problems that fit),
counted in `skipped_too_long` and reported in one warning line; the run fails only
when a split has no problem left.
"""

from __future__ import annotations

import json
import logging
import os
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from entr_megatron.config.task import MathTaskConfig
from entr_megatron.tasks.base import SPLITS, check_split, decode_response, stable_hash
from entr_megatron.tasks.math_reward import (
    MATH_EXTRA_HINT, math_verify_available, math_verify_reward, normalised_match_reward,
)
from entr_megatron.types import Sample

__all__ = [
    "DEFAULT_TEMPLATE", "REWARD_BACKENDS", "MathProblem", "MathTask", "check_math_files", "hold_out",
    "load_problems",
]

logger = logging.getLogger(__name__)

PROMPT_FIELDS = ("prompt", "problem")
ANSWER_FIELDS = ("answer", "solution")
REWARD_BACKENDS = ("auto", "math_verify", "normalise")
DEFAULT_TEMPLATE = MathTaskConfig.prompt_template
"""The bare problem (the config's default, task.math.prompt_template): it costs no tokens and
leaves instructions to the data, which often carries its own (DAPO's prompts do)."""
BOXED_TEMPLATE = "{problem}\nPut your final answer within \\boxed{{}}."
"""The usual instruction for instruction-tuned models (~12 tokens with a BPE tokenizer)."""
HELD_OUT_SALT = "math-held-out"
"""Mixed into the hash that picks the held-out problems: a fixed value, so every seed of a
study is scored on the same problems."""


@dataclass(frozen=True)
class MathProblem:
    problem: str
    answer: str
    source: str
    """"file:line" (JSONL), "file: item N" (JSON array) or "file: row N" (Parquet), for errors."""


def _keys(key: str | None, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """The field names tried in order: the configured one first, then the usual ones."""
    return defaults if key is None else (key, *(d for d in defaults if d != key))


def _either(names: tuple[str, ...]) -> str:
    return repr(names[0]) + (f" (or {', '.join(map(repr, names[1:]))})" if len(names) > 1 else "")


def _expected(fields: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    return f"records with a problem field {_either(fields[0])} and an answer field {_either(fields[1])}"


def _record(obj: Any, where: str, fields: tuple[tuple[str, ...], tuple[str, ...]]) -> MathProblem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with a problem field {_either(fields[0])} and an "
                         f"answer field {_either(fields[1])}, got {type(obj).__name__}")
    values = {}
    for kind, names in zip(("problem", "answer"), fields):
        value = next((obj[n] for n in names if obj.get(n) not in (None, "")), None)
        if value is None:
            raise ValueError(f"{where}: missing field {_either(names)}; fields present: {sorted(obj)}")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: field for the {kind} must be a string or number, got {type(value).__name__}")
        values[kind] = str(value)
    return MathProblem(values["problem"], values["answer"], where)


def _utf8(path: str, lineno: int, raw: bytes, fields) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                         f"math data files must be UTF-8 JSONL/JSON ({_expected(fields)}) or Parquet") from None


def _load_json_lines(path: str, lines: list[bytes], fields) -> list[MathProblem]:
    out = []
    for lineno, raw in enumerate(lines, 1):
        line = _utf8(path, lineno, raw, fields).rstrip("\r\n")  # else an unclosed line errs at "column 1"
        if lineno == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); expected one "
                             f"JSON object a line, {_expected(fields)}") from None
        out.append(_record(obj, f"{path}:{lineno}", fields))
    return out


def _load_json_array(path: str, lines: list[bytes], fields) -> list[MathProblem]:
    text = "".join(_utf8(path, i, raw, fields) for i, raw in enumerate(lines, 1)).removeprefix("\ufeff")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); expected a JSON "
                         f"array of objects or one object a line, {_expected(fields)}") from None
    return [_record(obj, f"{path}: item {i}", fields) for i, obj in enumerate(items)]


def _load_json(path: str, fields) -> list[MathProblem]:
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"math data file {path!r} cannot be read ({e.strerror or e})") from None
    head = b"".join(lines[:8]).lstrip(b"\xef\xbb\xbf \t\r\n")  # an array opens on the first non-blank line
    if path.endswith(".json") and head.startswith(b"["):
        return _load_json_array(path, lines, fields)
    return _load_json_lines(path, lines, fields)


def _load_parquet(path: str, fields) -> list[MathProblem]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from e
    try:
        columns = pq.read_schema(path).names
        for names in fields:
            if not any(n in columns for n in names):
                raise ValueError(f"{path}: no column {_either(names)}; columns: {columns}")
        wanted = [n for names in fields for n in names if n in columns]
        rows = pq.read_table(path, columns=list(dict.fromkeys(wanted))).to_pylist()
    except (pa.ArrowException, OSError) as e:  # not our ValueError above: it is neither
        raise ValueError(f"{path}: not a readable Parquet file ({e}); expected {_expected(fields)}") from None
    return [_record(row, f"{path}: row {i}", fields) for i, row in enumerate(rows)]


def load_problems(paths: str | Sequence[str], prompt_key: str | None = None,
                  answer_key: str | None = None) -> list[MathProblem]:
    """Problems of one or more .jsonl / .json / .parquet files, in file order. `prompt_key` /
    `answer_key`: the field tried first (then `prompt`/`problem`, `answer`/`solution`)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    fields = (_keys(prompt_key, PROMPT_FIELDS), _keys(answer_key, ANSWER_FIELDS))
    out = []
    for path in paths:
        if not os.path.exists(path):
            raise ValueError(f"math data file {path!r} does not exist; expected a .jsonl, .json or .parquet file "
                             f"of {_expected(fields)}")
        if os.path.isdir(path):
            raise ValueError(f"math data file {path!r} is a directory; expected a .jsonl, .json or .parquet file")
        if path.endswith((".jsonl", ".json")):
            problems = _load_json(path, fields)
        elif path.endswith(".parquet"):
            problems = _load_parquet(path, fields)
        else:
            raise ValueError(f"{path}: unknown format; use .jsonl, .json or .parquet")
        if not problems:
            raise ValueError(f"{path}: no problems in the file (it is empty or blank); expected {_expected(fields)}")
        out += problems
    return out


def hold_out(problems: Sequence[MathProblem], n: int, where: str = "the training files") -> tuple[
        list[MathProblem], list[MathProblem]]:
    """(train, test): the `n` distinct problem texts with the smallest salted hash form the test
    split (first copy of each, in file order); every copy of them leaves the training split."""
    texts = sorted({p.problem for p in problems}, key=lambda t: (stable_hash(f"{HELD_OUT_SALT}:{t}"), t))
    if not 1 <= n < len(texts):
        raise ValueError(f"task.eval_size={n} problems cannot be held out of {where}: they hold {len(texts)} "
                         f"distinct problems and at least one must stay for training; set task.eval_files "
                         f"(a held-out file), or task.eval_size below {len(texts)} (0: no evaluation)")
    held = set(texts[:n])
    test, seen = [], set()
    for p in problems:
        if p.problem in held and p.problem not in seen:
            seen.add(p.problem)
            test.append(p)
    return [p for p in problems if p.problem not in held], test


def check_math_files(train_files: Sequence[str], eval_files: Sequence[str] = (), held_out: int = 0,
                     prompt_key: str | None = None, answer_key: str | None = None) -> None:
    """What `MathTask` would refuse in its files, without a tokenizer: raises ValueError naming the
    file (and line) of a missing, unreadable, non-UTF-8, empty or malformed file, or when
    `held_out` problems cannot be cut from the training files (no `eval_files`). Prompt lengths
    are checked when the task is built (they need the tokenizer)."""
    if not train_files:
        raise ValueError("task.math.train_files is empty: the math task needs at least one file")
    train = load_problems(train_files, prompt_key, answer_key)
    if eval_files:
        load_problems(eval_files, prompt_key, answer_key)
    elif held_out:
        hold_out(train, held_out, f"task.math.train_files ({', '.join(train_files)})")


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
        prompt_key: str | None = None,
        answer_key: str | None = None,
        max_prompt_len: int | None = None,
        held_out: int = 0,
    ):
        """tokenizer: the policy's HF tokenizer; files: split -> file(s), "train" required
        ("test" for held-out evaluation); prompt_template: formats `{problem}`;
        chat_template: wrap the prompt as a user turn with the tokenizer's chat template;
        reward_backend: "math_verify", "normalise" (weaker) or "auto" (math-verify when installed);
        prompt_key / answer_key: the record fields tried first; max_prompt_len: prompts longer
        than this many tokens are left out (None: all kept); held_out: without "test" files,
        this many training problems form the test split (0: no test split)."""
        if reward_backend not in REWARD_BACKENDS:
            raise ValueError(f"reward_backend must be one of {REWARD_BACKENDS}, got {reward_backend!r}")
        if reward_backend == "math_verify" and not math_verify_available():
            raise ImportError(f"reward_backend='math_verify' needs math-verify: {MATH_EXTRA_HINT}")
        if "train" not in files:
            raise ValueError(f"files needs a 'train' entry (splits: {SPLITS}), got {sorted(files)}")
        for split in files:
            check_split(split)
        _check_template(prompt_template)
        self.tokenizer = tokenizer
        self.prompt_template, self.chat_template = prompt_template, chat_template
        self.max_prompt_len = max_prompt_len
        self.skipped_too_long = 0  # problems left out, their prompt over max_prompt_len tokens (all splits)
        pools, ids_by_text, longest = {}, {}, 0
        for split, paths in files.items():
            paths = [paths] if isinstance(paths, str) else list(paths)
            pools[split], skipped, split_longest = self._fitting(
                load_problems(paths, prompt_key, answer_key), paths, ids_by_text)
            self.skipped_too_long += skipped
            longest = max(longest, split_longest)
        if self.skipped_too_long:
            total = self.skipped_too_long + sum(map(len, pools.values()))
            logger.warning(f"math task: skipped {self.skipped_too_long} of {total} problems whose prompt is longer "
                           f"than model.max_prompt_len={max_prompt_len} tokens (the longest: {longest} tokens)")
        if "test" not in pools and held_out:
            paths = [files["train"]] if isinstance(files["train"], str) else list(files["train"])
            where = f"task.math.train_files ({', '.join(paths)})"
            pools["train"], pools["test"] = hold_out(
                pools["train"], held_out, where + (" after skipping long prompts" if self.skipped_too_long else ""))
        self.problems_by_split = pools
        self._prompt_ids = {split: [ids_by_text[p.problem] for p in problems] for split, problems in pools.items()}
        use_mv = reward_backend == "math_verify" or (reward_backend == "auto" and math_verify_available())
        self.reward_backend = "math_verify" if use_mv else "normalise"
        self._score = math_verify_reward if use_mv else normalised_match_reward

    def _fitting(self, problems: list[MathProblem], paths: list[str], ids_by_text: dict[str, array]) -> tuple[
            list[MathProblem], int, int]:
        """(the problems whose prompt fits max_prompt_len, how many did not, the longest prompt) of
        one split; the prompt ids of those kept go into `ids_by_text`."""
        encoded = self.encode_prompts([p.problem for p in problems])
        lengths = [len(ids) for ids in encoded]
        limit = self.max_prompt_len
        keep = [i for i, n in enumerate(lengths) if limit is None or n <= limit]
        if not keep:
            raise ValueError(f"model.max_prompt_len={limit}: every one of the {len(problems)} problems of "
                             f"{', '.join(paths)} has a longer prompt; the shortest is {min(lengths)} tokens "
                             f"(problem and prompt template): raise model.max_prompt_len (and model.max_seq_len "
                             f"to cover it plus rollout.sampling.max_new_tokens) or use shorter problems")
        for i in keep:
            ids_by_text.setdefault(problems[i].problem, array("i", encoded[i]))
        return [problems[i] for i in keep], len(problems) - len(keep), max(lengths)

    def encode_prompt(self, problem: str) -> list[int]:
        """The prompt ids of one problem: the template, then the chat template if set."""
        return self.encode_prompts([problem])[0]

    def encode_prompts(self, problems: list[str]) -> list[list[int]]:
        """`encode_prompt` of many problems (one batched tokenizer call without a chat template)."""
        texts = [self.prompt_template.format(problem=p) for p in problems]
        if self.chat_template:
            return [list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )) for text in texts]
        return [list(ids) for ids in self.tokenizer(texts)["input_ids"]] if texts else []

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], str]]:
        """`n` problems of `split` (distinct while the split has enough), a pure function of the arguments."""
        check_split(split)
        if split not in self.problems_by_split:
            raise ValueError(f"the math task has no {split!r} split: set task.math.eval_files, or a task.eval_size "
                             f"> 0 to hold problems out of the training files")
        pool, ids = self.problems_by_split[split], self._prompt_ids[split]
        rng = random.Random(f"{split}:{seed}")
        picks = rng.sample(range(len(pool)), n) if n <= len(pool) else rng.choices(range(len(pool)), k=n)
        return [(list(ids[i]), pool[i].answer) for i in picks]

    def reward(self, sample: Sample, reference: str) -> float:
        """1.0 when the response's final answer equals the reference (see `reward_backend`)."""
        return self._score(decode_response(self.tokenizer, sample.response_ids), reference)

    def new_environment(self) -> None:
        return None


def _check_template(template: str) -> None:
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"prompt_template must format with only {{problem}} (write literal braces as {{{{ }}}}), "
                         f"got {template!r} ({type(e).__name__}: {e})") from None
    if "\0" not in template.format(problem="\0"):
        raise ValueError(f"prompt_template must contain '{{problem}}', got {template!r}")

"""Countdown: combine a few numbers into a target, writing every step out; long, checkable responses.

    task = CountdownTask(num_operands=4)                # builds its character tokenizer
    task.prompts("train", 2, seed=0)                    # [([<s> 3 7 9 1 ...], CountdownProblem(...)), ...]
    task.reward(sample, problem)                        # 1.0 iff every step is valid and the value is the target
    label_response(problem, "9*7=63:3 1 63,...")        # one TOKEN_LABELS entry per character

A problem is a list of numbers and a target; the prompt is "3 7 9 1 to 59:". The response is a
scratchpad of steps, each combining two of the numbers still available with one operator and
restating the list that remains (the two operands' first occurrences removed, the result appended
at the end), then the answer:

    9*7=63:3 1 63,63-1=62:3 62,62-3=59:59,ans 59</s>

`A{op}B=R:L` is one step (steps are joined by ","), `ans V` the answer. Every number must be used
exactly once, so a response has num_operands - 1 steps (4 operands: 40-60 characters with EOS,
the character tokenizer writes one token per character). The rules of a step: A and B are in the
current list (B in what is left once A is taken), `op` is one of the task's operations, R is an
integer in [0, max_value] ("-" only when A >= B; "/" only when B divides A), and L is exactly the
list that remains. The answer comes once one number is left, and must be that number and the
target. Reward: 1 when all of that holds and the response ends with EOS; else `format_reward` (0
by default) for a response of the right shape (steps, then "ans" and an integer, then EOS); else 0.

Token labels (`label_response`, TOKEN_LABELS), one per response token, for metrics split by what
a token does:
- `choice`: a position in a step's "A{op}B=" where the rules leave more than one legal next
  character (which number starts the step, whether it has more digits, which operator, which
  second operand, whether that operand ends: the real decisions, H ~ 1-2 nats in a sampled policy);
  also every position of a step that has already broken the rules (no legal continuation: the
  rules no longer determine anything);
- `forced`: a position the rules and what came before determine: a "A{op}B=" position with one
  legal next character (the second digit of "63" when only 63 starts with 6, "=" after the second
  operand), the ":" after a result, the restated list, the "," between steps, "ans ", and the EOS
  token (after the answer nothing else is legal);
- `arithmetic`: the characters of a step's result R (determined, but computed);
- `answer`: the characters of the answer V.
The labeller reads any text (sampled responses that break the rules too): a step's roles are
found by its separators ("=" ends the operands, ":" the result, "," the list), and after a step the
list the response wrote (when it is a list of integers) is what the next step is judged against,
since that is what the model conditions on.

SFT traces (`sft_examples`) are drawn uniformly among ALL solutions of a problem (the count of
solutions is memoised per multiset of numbers), so the choice tokens of the warm-up's policy stay
multi-modal; `solutions` enumerates them (small problems). Problems are drawn as the end of a random
legal walk from random numbers (targets with many solutions are more common), kept when the target
is in [min_target, max_target]; each belongs to train or test by a hash of its prompt text
(`base.split_of`), as in the arithmetic task.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from entr_megatron.rollout.tasks.base import check_split, decode_response, split_of
from entr_megatron.types import Sample

__all__ = [
    "ANSWER", "ARITHMETIC", "CHOICE", "FORCED", "OPS", "TOKEN_LABELS",
    "CountdownProblem", "CountdownTask", "Step", "apply_step", "check_response", "count_solutions",
    "countdown_reward", "format_trace", "label_response", "label_tokens", "legal_steps", "sample_solution",
    "solutions",
]

OPS = ("+", "-", "*", "/")
"""Operators a task may allow ("/" only where it divides exactly)."""

FORCED, CHOICE, ARITHMETIC, ANSWER = "forced", "choice", "arithmetic", "answer"
TOKEN_LABELS: tuple[str, ...] = (FORCED, CHOICE, ARITHMETIC, ANSWER)
"""Every label `label_response` gives (module docstring: what each means)."""

ANSWER_MARK = "ans "
"""What introduces the answer."""

MAX_DRAWS_PER_PROBLEM = 1000
"""Draws (random walks) tried per problem before the settings are declared unsatisfiable."""

_STEP_RE = re.compile(r"(\d+)([-+*/])(\d+)=(\d+):(\d+(?: \d+)*)")
_ANSWER_RE = re.compile(r"ans (\d+)")


@dataclass(frozen=True)
class CountdownProblem:
    """One problem and the rules it is judged by (the reference `prompts` pairs with a prompt)."""

    numbers: tuple[int, ...]
    """The starting list, in prompt order."""
    target: int
    ops: tuple[str, ...] = ("+", "-", "*")
    """The operators a step may use."""
    max_value: int = 99
    """The largest value a step may produce."""

    @property
    def text(self) -> str:
        """The prompt text, e.g. "3 7 9 1 to 59:"."""
        return f"{_join(self.numbers)} to {self.target}:"


Step = tuple[int, str, int]
"""(A, op, B) of one step."""


def _join(values: tuple[int, ...] | list[int]) -> str:
    return " ".join(str(v) for v in values)


def _result(a: int, op: str, b: int, max_value: int) -> int | None:
    """A op B, or None when the rules refuse it (negative, inexact division, above max_value)."""
    if op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    elif op == "*":
        r = a * b
    elif op == "/":
        if b == 0 or a % b:
            return None
        r = a // b
    else:
        return None
    return r if 0 <= r <= max_value else None


def _remove(values: tuple[int, ...], *taken: int) -> tuple[int, ...] | None:
    """`values` without the first occurrence of each of `taken`, or None when one is missing."""
    out = list(values)
    for t in taken:
        if t not in out:
            return None
        out.remove(t)
    return tuple(out)


def apply_step(
    values: tuple[int, ...], step: Step, ops: tuple[str, ...], max_value: int,
) -> tuple[int, tuple[int, ...]] | None:
    """(R, the list that remains) of a legal step on `values`, or None when the step breaks a rule."""
    a, op, b = step
    if op not in ops:
        return None
    rest = _remove(values, a, b)
    r = _result(a, op, b, max_value)
    if rest is None or r is None:
        return None
    return r, rest + (r,)


@functools.lru_cache(maxsize=4096)
def legal_steps(values: tuple[int, ...], ops: tuple[str, ...], max_value: int) -> tuple[Step, ...]:
    """Every legal step on `values`, distinct as text (equal numbers give one step), in a fixed order."""
    out = []
    distinct = sorted(set(values))
    for a in distinct:
        for b in distinct:
            if a == b and values.count(a) < 2:
                continue
            for op in ops:
                if _result(a, op, b, max_value) is not None:
                    out.append((a, op, b))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _heads(values: tuple[int, ...], ops: tuple[str, ...], max_value: int) -> tuple[str, ...]:
    """The legal texts of the next step's head ("A{op}B="), or ("ans ",) once one number is left."""
    if len(values) == 1:
        return (ANSWER_MARK,)
    return tuple(f"{a}{op}{b}=" for a, op, b in legal_steps(values, ops, max_value))


@functools.lru_cache(maxsize=200_000)
def _final_counts(values: tuple[int, ...], ops: tuple[str, ...], max_value: int) -> dict[int, int]:
    """Final value -> number of distinct traces from the sorted multiset `values` reaching it (shared by
    every target: a problem's count is one lookup once its multiset has been seen). Do not mutate."""
    if len(values) == 1:
        return {values[0]: 1}
    out: dict[int, int] = {}
    for step in legal_steps(values, ops, max_value):
        _, rest = apply_step(values, step, ops, max_value)  # type: ignore[misc]
        for value, count in _final_counts(tuple(sorted(rest)), ops, max_value).items():
            out[value] = out.get(value, 0) + count
    return out


def count_solutions(values: tuple[int, ...], target: int, ops: tuple[str, ...], max_value: int) -> int:
    """Number of distinct solution traces (texts) from the numbers `values` (in any order) to `target`."""
    return _final_counts(tuple(sorted(values)), ops, max_value).get(target, 0)


def solutions(problem: CountdownProblem) -> list[tuple[Step, ...]]:
    """Every solution (its steps) of `problem`, by exhaustive search; for small problems and tests."""
    out: list[tuple[Step, ...]] = []

    def walk(values: tuple[int, ...], steps: tuple[Step, ...]) -> None:
        if len(values) == 1:
            if values[0] == problem.target:
                out.append(steps)
            return
        for step in legal_steps(values, problem.ops, problem.max_value):
            _, rest = apply_step(values, step, problem.ops, problem.max_value)  # type: ignore[misc]
            walk(rest, steps + (step,))

    walk(tuple(problem.numbers), ())
    return out


def sample_solution(problem: CountdownProblem, rng: random.Random) -> tuple[Step, ...] | None:
    """One solution drawn uniformly among all of `problem`'s (`solutions`), or None when it has none."""
    ops, mv = problem.ops, problem.max_value
    values = tuple(problem.numbers)
    if count_solutions(values, problem.target, ops, mv) == 0:
        return None
    steps: list[Step] = []
    while len(values) > 1:
        options, weights = [], []
        for step in legal_steps(values, ops, mv):
            _, rest = apply_step(values, step, ops, mv)  # type: ignore[misc]
            w = count_solutions(rest, problem.target, ops, mv)
            if w:
                options.append((step, rest))
                weights.append(w)
        step, values = rng.choices(options, weights=weights)[0]
        steps.append(step)
    return tuple(steps)


def format_trace(problem: CountdownProblem, steps: tuple[Step, ...]) -> str:
    """The response text of `steps` (without EOS), e.g. "9*7=63:3 1 63,...,ans 59"."""
    values, parts = tuple(problem.numbers), []
    for a, op, b in steps:
        applied = apply_step(values, (a, op, b), problem.ops, problem.max_value)
        if applied is None:
            raise ValueError(f"step {a}{op}{b} is not legal on {list(values)}")
        r, values = applied
        parts.append(f"{a}{op}{b}={r}:{_join(values)}")
    if len(values) != 1:
        raise ValueError(f"{len(steps)} steps leave {list(values)}: a trace uses every number")
    return ",".join(parts + [f"{ANSWER_MARK}{values[0]}"])


def check_response(problem: CountdownProblem, text: str) -> tuple[bool, bool]:
    """(well formed, correct) of a response text (up to its EOS): well formed when it is steps
    "A{op}B=R:L" joined by "," and then "ans V"; correct when also every step is legal, each R is
    right, each L is exactly the list that remains, one number is left and V is it and the target."""
    parts = text.split(",")
    if not parts:
        return False, False
    steps = [_STEP_RE.fullmatch(p) for p in parts[:-1]]
    answer = _ANSWER_RE.fullmatch(parts[-1])
    if answer is None or any(m is None for m in steps):
        return False, False
    values = tuple(problem.numbers)
    for m in steps:
        a, op, b, r, listed = int(m[1]), m[2], int(m[3]), m[4], m[5]  # type: ignore[index]
        applied = apply_step(values, (a, op, b), problem.ops, problem.max_value)
        if applied is None or r != str(applied[0]) or listed != _join(applied[1]):
            return True, False
        values = applied[1]
    return True, len(values) == 1 and answer[1] == str(values[0]) == str(problem.target)


def countdown_reward(problem: CountdownProblem, text: str, *, ended: bool, format_reward: float = 0.0) -> float:
    """1.0 for a correct response (`check_response`) that ended with EOS; `format_reward` for a
    well-formed one that did; else 0.0. text: the response decoded up to its first EOS."""
    if not ended:
        return 0.0
    well_formed, correct = check_response(problem, text)
    return 1.0 if correct else format_reward if well_formed else 0.0


def _parse_list(text: str) -> tuple[int, ...] | None:
    items = text.split(" ")
    if not items or not all(i.isdigit() for i in items):
        return None
    return tuple(int(i) for i in items)


def label_response(problem: CountdownProblem, text: str, *, eos: bool = False) -> list[str]:
    """One label of TOKEN_LABELS per character of `text` (a response, sampled or not, up to its EOS),
    plus one `forced` label for the EOS token when `eos` (the character tokenizer writes one token
    per character, so this is one label per response token). Pure; linear in len(text).
    The module docstring says what each label means."""
    labels: list[str] = []
    values = tuple(problem.numbers)
    ops, mv = problem.ops, problem.max_value
    i, n = 0, len(text)
    while i < n:
        # The head: "A{op}B=" (or "ans "); each position labelled by the legal next characters.
        heads, head = _heads(values, ops, mv), ""
        while i < n:
            nexts = {h[len(head)] for h in heads if len(h) > len(head) and h.startswith(head)}
            labels.append(FORCED if len(nexts) == 1 else CHOICE)
            head += text[i]
            i += 1
            if head == ANSWER_MARK or text[i - 1] == "=":
                break
        if head == ANSWER_MARK:
            labels.extend(ANSWER for _ in range(n - i))
            break
        # The result, up to ":" (or a "," that skips the list).
        while i < n and text[i] not in ":,":
            labels.append(ARITHMETIC)
            i += 1
        # ":", the restated list, "," (all forced), then the list the next step is judged against.
        listed = i < n and text[i] == ":"
        start = i + 1
        while i < n and text[i] != ",":
            labels.append(FORCED)
            i += 1
        written = _parse_list(text[start:i]) if listed else None
        if i < n:
            labels.append(FORCED)
            i += 1
        if written is not None:
            values = written
        else:
            m = re.fullmatch(r"(\d+)([-+*/])(\d+)=", head)
            applied = apply_step(values, (int(m[1]), m[2], int(m[3])), ops, mv) if m else None
            if applied is not None:
                values = applied[1]
    if eos:
        labels.append(FORCED)
    assert len(labels) == n + int(eos)
    return labels


def label_tokens(
    problem: CountdownProblem, response_ids: list[int], pieces: list[str], eos_id: int | None,
) -> list[str]:
    """One label per id of `response_ids`: `pieces[id]` is each id's text (see CountdownTask.token_labels).
    EOS is `forced`; so is every id after it (the engine stops there; nothing after it counts). A token
    of several characters takes its first character's label; one that decodes to nothing (a special
    token other than EOS) is `choice` (the rules never call for it)."""
    end = response_ids.index(eos_id) if eos_id is not None and eos_id in response_ids else len(response_ids)
    texts = [pieces[t] for t in response_ids[:end]]
    chars = label_response(problem, "".join(texts))
    out, pos = [], 0
    for piece in texts:
        out.append(chars[pos] if piece else CHOICE)
        pos += len(piece)
    return out + [FORCED] * (len(response_ids) - end)


def _walk(values: tuple[int, ...], ops: tuple[str, ...], max_value: int, rng: random.Random) -> int | None:
    """The value a random legal walk from `values` ends at (None: stuck, no legal step)."""
    while len(values) > 1:
        steps = legal_steps(values, ops, max_value)
        if not steps:
            return None
        _, values = apply_step(values, rng.choice(steps), ops, max_value)  # type: ignore[misc]
    return values[0]


class CountdownTask:
    """Countdown with a scratchpad, on a character tokenizer (see module docstring)."""

    name = "countdown"

    def __init__(
        self,
        num_operands: int = 4,
        min_number: int = 1,
        max_number: int = 9,
        *,
        max_value: int = 99,
        min_target: int = 10,
        max_target: int = 99,
        ops: tuple[str, ...] | list[str] = ("+", "-", "*"),
        format_reward: float = 0.0,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        tokenizer: Any = None,
    ):
        """num_operands: numbers per problem (each used exactly once); min_number..max_number: their range;
        max_value: the largest value a step may produce; min_target..max_target: the targets' range;
        ops: from "+", "-", "*", "/"; format_reward: reward of a well-formed wrong response (0 disables);
        test_fraction: share of problems held out; split_seed: which ones; tokenizer: an HF tokenizer
        knowing digits, the operators, " :,=" and "a" "n" "s" "t" "o" (default: `build_char_tokenizer()`)."""
        ops = tuple(ops)

        def integer(name: str, value: Any, low: int, high: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")

        integer("num_operands", num_operands, 2, 6)
        integer("max_value", max_value, 1, 10**6)
        integer("min_number", min_number, 0, max_value)
        integer("max_number", max_number, min_number, max_value)
        integer("max_target", max_target, 0, max_value)
        integer("min_target", min_target, 0, max_target)
        if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"ops must be a non-empty subset of {OPS} without repeats, got {ops!r}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward!r}")
        if tokenizer is None:
            from entr_megatron.rollout.tasks.char_tokenizer import build_char_tokenizer

            tokenizer = build_char_tokenizer()
        self.num_operands, self.min_number, self.max_number = num_operands, min_number, max_number
        self.max_value, self.min_target, self.max_target, self.ops = max_value, min_target, max_target, ops
        self.format_reward, self.test_fraction, self.split_seed = format_reward, test_fraction, split_seed
        self.tokenizer = tokenizer
        self._pieces: list[str] | None = None

    def _draws(self, rng: random.Random) -> Iterator[CountdownProblem]:
        for _ in range(MAX_DRAWS_PER_PROBLEM):
            numbers = tuple(rng.randint(self.min_number, self.max_number) for _ in range(self.num_operands))
            target = _walk(numbers, self.ops, self.max_value, rng)
            if target is not None and self.min_target <= target <= self.max_target:
                yield CountdownProblem(numbers, target, self.ops, self.max_value)

    def problems(self, split: str, n: int, seed: int) -> list[CountdownProblem]:
        """`n` distinct problems of `split`, a pure function of the arguments."""
        check_split(split)
        rng = random.Random(f"countdown:{split}:{seed}")
        out: list[CountdownProblem] = []
        seen: set[CountdownProblem] = set()
        while len(out) < n:
            for p in self._draws(rng):
                if p not in seen and split_of(p.text, self.test_fraction, self.split_seed) == split:
                    break
            else:
                raise ValueError(
                    f"no new {split!r} countdown problem in {MAX_DRAWS_PER_PROBLEM} draws (num_operands="
                    f"{self.num_operands}, numbers {self.min_number}..{self.max_number}, targets {self.min_target}.."
                    f"{self.max_target}, max_value={self.max_value}, ops={self.ops}): widen the ranges")
            seen.add(p)
            out.append(p)
        return out

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], CountdownProblem]]:
        """(prompt ids starting with BOS, the problem) pairs."""
        return [(self.tokenizer.encode(p.text), p) for p in self.problems(split, n, seed)]

    def sft_examples(self, split: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, target ids = a solution drawn uniformly among all of the problem's + EOS)."""
        rng = random.Random(f"countdown-sft:{split}:{seed}")
        out = []
        for p in self.problems(split, n, seed):
            steps = sample_solution(p, rng)
            assert steps is not None, "a problem is drawn as the end of a legal walk"
            out.append((self.tokenizer.encode(p.text),
                        self.tokenizer.encode(format_trace(p, steps), add_special_tokens=False)
                        + [self.tokenizer.eos_token_id]))
        return out

    def reward(self, sample: Sample, reference: CountdownProblem) -> float:
        """`countdown_reward` of the response up to its first EOS."""
        ended = self.tokenizer.eos_token_id in sample.response_ids
        text = decode_response(self.tokenizer, sample.response_ids)
        return countdown_reward(reference, text, ended=ended, format_reward=self.format_reward)

    def token_labels(self, sample: Sample, reference: CountdownProblem) -> list[str]:
        """One TOKEN_LABELS entry per response token of `sample` (`label_tokens`)."""
        if self._pieces is None:
            self._pieces = [self.tokenizer.decode([i], skip_special_tokens=True) for i in range(len(self.tokenizer))]
        return label_tokens(reference, list(sample.response_ids), self._pieces, self.tokenizer.eos_token_id)

    def new_environment(self) -> None:
        """Single turn: no environment."""
        return None

"""Countdown's rules and solver: legal steps, the trace format, the checker, all solutions and a uniform draw.

    legal_steps((3, 7, 9, 1), ("+", "-", "*"), 99)     # every (A, op, B) the rules allow on that list
    solutions(problem)                                 # every solution, by exhaustive search
    sample_solution(problem, rng)                      # one of them, uniformly (memoised counts)
    check_response(problem, "9*7=63:3 1 63,...")       # (well formed, correct)
    spaced("9*7=63:3 1 63,ans 5")                      # "9 * 7 = 63 : 3 1 63 , ans 5" (the spaced layout)

The format and the rules are described in countdown.py's docstring and docs/tasks.md.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

__all__ = [
    "ANSWER_MARK", "LAYOUTS", "MARKS", "OPS", "CountdownProblem", "Step", "apply_step", "check_response", "compact",
    "count_solutions", "format_trace", "legal_heads", "legal_steps", "random_walk", "sample_solution", "solutions",
    "spaced",
]

OPS = ("+", "-", "*", "/")
"""Operators a task may allow ("/" only where it divides exactly)."""

ANSWER_MARK = "ans "
"""What introduces the answer."""

LAYOUTS = ("compact", "spaced")
"""How a response is written: "compact" ("9*7=63:3 1 63,ans 59"), or "spaced", with one space on each
side of every operator and of "=" ":" "," ("9 * 7 = 63 : 3 1 63 , ans 59"): on a BPE that merges a
space with the character after it, spaces and space-led marks at positions the text before them
determines are then 45% of a 3-operand trace's tokens (docs/tasks.md)."""
MARKS = "+-*/=:,"
"""The characters the spaced layout writes with a space on each side."""
_MARK = f"[{re.escape(MARKS)}]"
_SPACED_RE = re.compile(f"({_MARK})")
_COMPACT_RE = re.compile(f" ({_MARK}) ")
_LOOSE_RE = re.compile(f" {_MARK}|{_MARK} ")
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
def legal_heads(values: tuple[int, ...], ops: tuple[str, ...], max_value: int) -> tuple[str, ...]:
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


def spaced(text: str) -> str:
    """A compact response in the spaced layout (LAYOUTS): one space each side of every mark."""
    return _SPACED_RE.sub(r" \1 ", text)


def compact(text: str) -> str | None:
    """A spaced response in the compact layout, or None when it is not exactly `spaced` of one (a
    mark without its two spaces, a doubled space): such a response is not well formed."""
    out = _COMPACT_RE.sub(r"\1", text)
    return out if spaced(out) == text and _LOOSE_RE.search(out) is None else None


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


def random_walk(values: tuple[int, ...], ops: tuple[str, ...], max_value: int, rng: random.Random) -> int | None:
    """The value a random legal walk from `values` ends at (None: stuck, no legal step)."""
    while len(values) > 1:
        steps = legal_steps(values, ops, max_value)
        if not steps:
            return None
        _, values = apply_step(values, rng.choice(steps), ops, max_value)  # type: ignore[misc]
    return values[0]

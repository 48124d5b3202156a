"""The calculator tool: a safe arithmetic evaluator, its environment and a task that needs it.

    safe_eval("12*7")                       # "84"   (ast walk; never eval)
    policy:  12*34+56=<calc>12*34+56</calc>
    env:     <result>464</result>           # appended, loss mask False
    policy:  464</s>                        # reward 1.0

Only numbers, + - * / // % ** and parentheses are accepted; names, calls,
attributes, strings and the like are refused, as are exponents and results
beyond `MAX_DIGITS` digits (no `9**9**9` hang). Arithmetic is exact (fractions);
non-integer results print with 10 significant digits.

The tool markers must be single tokens of the tokenizer (the character tokenizer
has them; for another tokenizer add them with `tokenizer.add_tokens`), because
the engine ends a turn on a stop token id.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import time
from fractions import Fraction
from typing import Any

from entr_megatron.tasks.base import (
    answer_after, check_fractions, check_split, final_answer_reward, single_token_id, split_of,
)
from entr_megatron.tasks.char_tokenizer import build_char_tokenizer
from entr_megatron.tasks.environment import Step
from entr_megatron.tasks.tools.calls import ToolOutcome
from entr_megatron.types import Sample

__all__ = ["CALL_CLOSE", "CALL_OPEN", "CalculatorEnv", "CalculatorError", "CalculatorTask", "safe_eval"]

CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<calc>", "</calc>", "<result>", "</result>"
CALC_MARKERS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100
"""Largest result (and intermediate value) in decimal digits: bounds time and memory."""
ERROR_TEXT = "error"
TOOL_NAME = "calculator"
"""The tool's name in the per-tool metrics (agent/tool_calls/calculator)."""

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is too large or undefined."""


def _check_size(x: Fraction) -> Fraction:
    for part in (x.numerator, x.denominator):
        if abs(part) >= 10**MAX_DIGITS:
            raise CalculatorError(f"value has more than {MAX_DIGITS} digits")
    return x


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are supported")
    e = exponent.numerator
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    size = max(abs(base.numerator), abs(base.denominator))
    if size > 1 and abs(e) * math.log10(size) > MAX_DIGITS:
        raise CalculatorError(f"power has more than {MAX_DIGITS} digits")
    return base**e


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise CalculatorError("non-finite number")
        return _check_size(Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
        if fn in (operator.truediv, operator.floordiv, operator.mod) and right == 0:
            raise CalculatorError("division by zero")
        return _check_size(Fraction(fn(left, right)))
    raise CalculatorError(f"{type(node).__name__} is not allowed (only numbers, + - * / // % ** and parentheses)")


def format_number(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.10g}"


def safe_eval(expression: str) -> str:
    """The value of an arithmetic expression as text; raises `CalculatorError` otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    expression = expression.replace("^", "**")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from e
    return format_number(_eval(tree))


def final_answer(text: str) -> str:
    """What follows the last tool result (the whole text when no tool was used), stripped."""
    return answer_after(text, RESULT_CLOSE)


class CalculatorEnv:
    """One episode with the calculator: runs each `<calc>...</calc>` call, then scores the answer.

    A turn that ends with the `</calc>` token is a call: the observation is
    `<result>VALUE</result>` (`<result>error</result>` for a bad expression), reward 0.
    Any other turn ends the episode: reward = exact match of the final answer.
    """

    def __init__(self, tokenizer: Any, answer_reward: Any):
        self.tokenizer = tokenizer
        self.close_id = single_token_id(tokenizer, CALL_CLOSE, "the calculator", CALC_MARKERS)
        self.stop_token_ids = (self.close_id,)
        self._answer_reward = answer_reward
        self.reference: Any = None
        self.history: list[int] = []
        self.calls = 0

    def reset(self, prompt_ids: list[int], reference: Any) -> list[int]:
        self.reference, self.history, self.calls = reference, [], 0
        return list(prompt_ids)

    def step(self, generated_ids: list[int]) -> Step:
        self.history += generated_ids
        if generated_ids and generated_ids[-1] == self.close_id:
            text = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
            expression = text.rsplit(CALL_OPEN, 1)[-1].removesuffix(CALL_CLOSE) if CALL_OPEN in text else ""
            t0, error = time.perf_counter(), None
            try:
                value = safe_eval(expression)
            except CalculatorError as e:
                value, error = ERROR_TEXT, str(e)
            self.calls += 1
            obs = self.tokenizer.encode(f"{RESULT_OPEN}{value}{RESULT_CLOSE}", add_special_tokens=False)
            self.history += obs  # the response as the Sample will hold it
            return Step(obs, False, 0.0, (ToolOutcome(TOOL_NAME, value, error, time.perf_counter() - t0),))
        return Step([], True, self._answer_reward(self.history, self.reference))


class CalculatorTask:
    """Arithmetic too long to do in one's head ("a*b+c=" with multi-digit operands), solved
    with the calculator tool. Same splits and prompt format as the arithmetic task."""

    name = "calculator"

    def __init__(self, digits: int = 3, *, test_fraction: float = 0.1, split_seed: int = 0, tokenizer: Any = None):
        """digits: operands are drawn from [0, 10**digits)."""
        if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= 9:
            raise ValueError(f"digits must be an int in [1, 9], got {digits!r}")
        check_fractions(test_fraction)
        if tokenizer is None:
            tokenizer = build_char_tokenizer()
        single_token_id(tokenizer, CALL_CLOSE, "the calculator", CALC_MARKERS)
        self.digits, self.test_fraction, self.split_seed = digits, test_fraction, split_seed
        self.tokenizer = tokenizer

    def problems(self, split: str, n: int, seed: int) -> list[tuple[str, str]]:
        """(prompt text, answer) pairs: "a*b+c=" (distinct within a draw)."""
        check_split(split)
        rng = random.Random(f"calc:{split}:{seed}")
        hi, out, seen = 10**self.digits, [], set()
        for _ in range(100 * n + 10_000):
            if len(out) == n:
                break
            a, b, c = rng.randrange(hi), rng.randrange(hi), rng.randrange(hi)
            text = f"{a}*{b}+{c}="
            if text not in seen and split_of(text, self.test_fraction, self.split_seed) == split:
                seen.add(text)
                out.append((text, str(a * b + c)))
        if len(out) < n:
            raise ValueError(f"the {split!r} split has too few distinct problems for n={n} (digits={self.digits})")
        return out

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], str]]:
        return [(self.tokenizer.encode(text), answer) for text, answer in self.problems(split, n, seed)]

    def sft_examples(self, split: str, n: int, seed: int) -> list[tuple[list[int], list[int], list[bool]]]:
        """(prompt ids, target ids, target mask) tool traces for a warm-up: the call, the calculator's
        answer (mask False: the environment's, not the policy's), the answer and EOS."""
        out = []
        for text, answer in self.problems(split, n, seed):
            call = self.tokenizer.encode(f"{CALL_OPEN}{text[:-1]}{CALL_CLOSE}", add_special_tokens=False)
            obs = self.tokenizer.encode(f"{RESULT_OPEN}{safe_eval(text[:-1])}{RESULT_CLOSE}", add_special_tokens=False)
            final = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append((self.tokenizer.encode(text), call + obs + final,
                        [True] * len(call) + [False] * len(obs) + [True] * len(final)))
        return out

    def answer_reward(self, response_ids: list[int], reference: str) -> float:
        """1.0 iff the text after the last tool result, up to EOS, is the reference and EOS was written."""
        return final_answer_reward(self.tokenizer, response_ids, reference, RESULT_CLOSE)

    def reward(self, sample: Sample, reference: str) -> float:
        """Exact match of the final answer; tool outputs in the response are skipped."""
        return self.answer_reward(sample.response_ids, reference)

    def new_environment(self) -> CalculatorEnv:
        return CalculatorEnv(self.tokenizer, self.answer_reward)

"""Synthetic multi-digit arithmetic: "12+34=" -> "46", generated locally, exactly verifiable.

    task = ArithmeticTask(digits=2)                     # builds its character tokenizer
    task.prompts("train", 4, seed=0)                    # [([<s> 1 2 + 3 4 =], "46"), ...]
    task.reward(sample, "46")                           # 1.0 iff the response is "46" then </s>

Sized for a tiny model (hidden 64-128, 2-4 layers) trained in minutes on CPU:
with `digits=2` a short SFT warm-up gets part of the way and RL visibly raises
held-out accuracy. `reverse_answer=True` writes the answer least significant
digit first, which is far easier for a small causal model (carries then flow
left to right); the reference is then the reversed string too. `pad_operands=True`
writes operands with leading zeros to `digits` places ("07+45="), so every digit
sits at a fixed position: a tiny model then needs far fewer warm-up steps.

Splits: each problem ("a+b") belongs to train or test by a hash of its text and
`split_seed` (see `base.split_of`), so the splits never overlap and each draw is
a pure function of (split, n, seed).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from entr_megatron.tasks.base import check_fractions, check_split, decode_response, split_of
from entr_megatron.tasks.char_tokenizer import build_char_tokenizer
from entr_megatron.types import Sample

__all__ = ["OPS", "ArithmeticTask", "Problem", "arithmetic_reward", "draw_problems"]

OPS = ("+", "-", "*")
ENUMERATE_LIMIT = 200_000
"""Problem spaces up to this size are listed in full (exact sampling without replacement);
larger ones are sampled by rejection."""


@dataclass(frozen=True)
class Problem:
    text: str
    """The prompt text, e.g. "12+34="."""
    answer: str
    """The reference answer as the model must write it, e.g. "46"."""


def _make(a: int, op: str, b: int, reverse: bool, width: int = 0) -> Problem:
    value = a + b if op == "+" else a - b if op == "-" else a * b
    answer = str(value)
    if reverse:
        answer = answer[::-1] if value >= 0 else "-" + answer[1:][::-1]
    return Problem(f"{a:0{width}d}{op}{b:0{width}d}=" if width else f"{a}{op}{b}=", answer)


def _valid(a: int, op: str, b: int, split: str, allow_negative: bool, test_fraction: float, split_seed: int) -> bool:
    return (allow_negative or op != "-" or a >= b) and split_of(f"{a}{op}{b}", test_fraction, split_seed) == split


@functools.lru_cache(maxsize=8)
def _pool(split: str, digits: int, ops: tuple[str, ...], allow_negative: bool, test_fraction: float,
          split_seed: int) -> tuple[tuple[int, str, int], ...]:
    """Every problem of a listable split, in a fixed order; listed once per process (hashing
    10^4 texts takes ~40 ms, and the controller draws a chunk of prompts every step)."""
    hi = 10**digits
    return tuple((a, op, b) for op in ops for a in range(hi) for b in range(hi)
                 if _valid(a, op, b, split, allow_negative, test_fraction, split_seed))


def draw_problems(
    split: str, n: int, seed: int, *, digits: int, ops: tuple[str, ...], allow_negative: bool,
    reverse: bool, test_fraction: float, split_seed: int, pad_operands: bool = False,
) -> list[Problem]:
    """`n` problems of `split`: distinct when the split holds at least `n` of them."""
    check_split(split)
    hi = 10**digits
    width = digits if pad_operands else 0
    rng = random.Random(f"{split}:{seed}")
    if hi * hi * len(ops) <= ENUMERATE_LIMIT:
        pool = _pool(split, digits, tuple(ops), allow_negative, test_fraction, split_seed)
        if not pool:
            raise ValueError(f"the {split!r} split is empty (digits={digits}, test_fraction={test_fraction})")
        picks = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
        return [_make(a, op, b, reverse, width) for a, op, b in picks]
    out, seen = [], set()
    while len(out) < n:
        a, op, b = rng.randrange(hi), rng.choice(ops), rng.randrange(hi)
        if _valid(a, op, b, split, allow_negative, test_fraction, split_seed) and (a, op, b) not in seen:
            seen.add((a, op, b))
            out.append(_make(a, op, b, reverse, width))
    return out


def arithmetic_reward(text: str, reference: str, *, ended: bool, format_reward: float = 0.0) -> float:
    """1.0 for exactly the reference answer; else `format_reward` for a well-formed attempt
    (an integer, then the end of the response); else 0.0.

    text: the response decoded up to its first EOS; ended: whether that EOS was there.
    """
    answer = text.strip()
    if ended and answer == reference:
        return 1.0
    well_formed = ended and answer.lstrip("-").isdigit()
    return format_reward if well_formed else 0.0


class ArithmeticTask:
    """Multi-digit arithmetic with a character tokenizer (see module docstring)."""

    name = "arithmetic"

    def __init__(
        self,
        digits: int = 2,
        ops: tuple[str, ...] | list[str] = ("+",),
        *,
        reverse_answer: bool = False,
        pad_operands: bool = False,
        allow_negative: bool = False,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        format_reward: float = 0.0,
        tokenizer: Any = None,
    ):
        """digits: operands are drawn from [0, 10**digits); ops: from "+", "-", "*";
        allow_negative: "-" problems may have a negative result (else a >= b);
        pad_operands: operands with leading zeros to `digits` places ("07+45=");
        test_fraction: share of all problems held out; split_seed: which ones;
        format_reward: reward of a wrong but well-formed answer (0 disables the format term);
        tokenizer: an HF tokenizer knowing digits, ops and "=" (default: `build_char_tokenizer()`)."""
        ops = tuple(ops)
        if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= 9:
            raise ValueError(f"digits must be an int in [1, 9], got {digits!r}")
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")
        check_fractions(test_fraction, format_reward)
        if tokenizer is None:
            tokenizer = build_char_tokenizer()
        self.digits, self.ops, self.reverse_answer, self.pad_operands = digits, ops, reverse_answer, pad_operands
        self.allow_negative, self.test_fraction, self.split_seed = allow_negative, test_fraction, split_seed
        self.format_reward = format_reward
        self.tokenizer = tokenizer

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """The problems behind `prompts` (text and answer), e.g. for SFT targets."""
        return draw_problems(
            split, n, seed, digits=self.digits, ops=self.ops, allow_negative=self.allow_negative,
            reverse=self.reverse_answer, test_fraction=self.test_fraction, split_seed=self.split_seed,
            pad_operands=self.pad_operands,
        )

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], str]]:
        """(prompt ids starting with BOS, reference answer) pairs."""
        return [(self.tokenizer.encode(p.text), p.answer) for p in self.problems(split, n, seed)]

    def sft_examples(self, split: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, target ids = answer + EOS) pairs for a supervised warm-up."""
        return [
            (self.tokenizer.encode(p.text), self.tokenizer.encode(p.answer, add_special_tokens=False)
             + [self.tokenizer.eos_token_id])
            for p in self.problems(split, n, seed)
        ]

    def reward(self, sample: Sample, reference: str) -> float:
        """Exact match of the response (up to its first EOS) with the reference answer."""
        ended = self.tokenizer.eos_token_id in sample.response_ids
        text = decode_response(self.tokenizer, sample.response_ids)
        return arithmetic_reward(text, reference, ended=ended, format_reward=self.format_reward)

    def new_environment(self) -> None:
        """Single turn: no environment."""
        return None

"""Countdown: combine a few numbers into a target, writing every step out; long, checkable responses.

    task = CountdownTask(num_operands=4)                # builds its character tokenizer
    task.prompts("train", 2, seed=0)                    # [([<s> 3 7 9 1 ...], CountdownProblem(...)), ...]
    task.reward(sample, problem)                        # 1.0 iff every step is valid and the value is the target
    label_response(problem, "9*7=63:3 1 63,...")        # one TOKEN_LABELS entry per character
    CountdownTask(layout="spaced")                      # responses as "9 * 7 = 63 : 3 1 63 , ans 59"

The rules and the solver are in countdown_rules.py, the labeller in countdown_labels.py; this
module is the task (problems, prompts, SFT examples, reward) and re-exports both.

A problem is a list of numbers and a target; the prompt is "3 7 9 1 to 59:". The response is a
scratchpad of steps, each combining two of the numbers still available with one operator and
restating the list that remains (the two operands' first occurrences removed, the result appended
at the end), then the answer:

    9*7=63:3 1 63,63-1=62:3 62,62-3=59:59,ans 59</s>

`A{op}B=R:L` is one step (steps are joined by ","), `ans V` the answer. The "spaced" layout
(`layout`, countdown_rules.LAYOUTS) writes one space on each side of every operator and of "=" ":"
",": "9 * 7 = 63 : 3 1 63 , 63 - 1 = 62 : 3 62 , 62 - 3 = 59 : 59 , ans 59"; the reward reads it back
to the compact text and refuses any other spacing, and the labels are the compact text's
(`label_spaced`). Every number must be used
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

import random
from collections.abc import Iterator
from typing import Any

from entr_megatron.tasks.base import check_fractions, check_split, decode_response, split_of
from entr_megatron.tasks.char_tokenizer import build_char_tokenizer
from entr_megatron.tasks.countdown_labels import (
    ANSWER, ARITHMETIC, CHOICE, FORCED, TOKEN_LABELS, label_response, label_spaced, label_tokens,
)
from entr_megatron.tasks.countdown_rules import (
    LAYOUTS, OPS, CountdownProblem, Step, apply_step, check_response, compact, count_solutions, format_trace,
    legal_steps, random_walk, sample_solution, solutions, spaced,
)
from entr_megatron.types import Sample

__all__ = [
    "ANSWER", "ARITHMETIC", "CHOICE", "FORCED", "LAYOUTS", "OPS", "TOKEN_LABELS",
    "CountdownProblem", "CountdownTask", "Step", "apply_step", "check_response", "compact", "count_solutions",
    "countdown_reward", "format_trace", "label_response", "label_spaced", "label_tokens", "legal_steps",
    "sample_solution", "solutions", "spaced",
]

MAX_DRAWS_PER_PROBLEM = 1000
"""Draws (random walks) tried per problem before the settings are declared unsatisfiable."""
_STRUCTURAL = {",": (";", "&"), ":": ("|", "!"), " ": ("_", "#"), "=": ("~", "@")}
_DIGITS = {str(d): (chr(ord("A") + d), chr(ord("K") + d)) for d in range(10)}
VARIANT_SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "separators": {",": (";",), ":": ("|",), " ": ("_",)},
    "structural": _STRUCTURAL,
    "structural_digits": {**_STRUCTURAL, **_DIGITS},
    "structural_forced_digits": {**_STRUCTURAL, **_DIGITS},
    "spaces": {" ": ("_", "#")},
}
"""Other ways of writing a structural character (`separator_variants`, `variant_set`): warm-up traces
use each variant at a small rate, so a model sure of the character keeps rare alternatives there (the
long-tail testbed). "separators": one variant of each separator; "structural": two variants of each
separator and of "=", each at the rate (a 3-operand trace: 8 positions with two variants each, against
"separators"' 6 with one); "structural_digits": those and two of each digit, "A"-"J" and "K"-"T" for
0-9 (every character but the operators and "ans": the digits a trace restates, computes and answers
are sure positions too); "structural_forced_digits": the same table, but a digit is varied only where
the text before it determines it (`forced` or `answer` in `label_response`: the restated list, the
answer, an operand's digit with one legal continuation), never where the policy chooses or computes;
"spaces": two variants of the space alone, "_" and "#" (with the spaced layout, every space-led token
has two rare alternatives, and no other character is touched)."""
_SURE_ONLY = {"structural_forced_digits": frozenset(_DIGITS)}
"""Characters a set varies only at positions the labeller calls forced or answer."""
_CANONICAL = {name: str.maketrans({v: c for c, vs in table.items() for v in vs})
              for name, table in VARIANT_SETS.items()}


def countdown_reward(problem: CountdownProblem, text: str, *, ended: bool, format_reward: float = 0.0) -> float:
    """1.0 for a correct response (`check_response`) that ended with EOS; `format_reward` for a
    well-formed one that did; else 0.0. text: the response decoded up to its first EOS."""
    if not ended:
        return 0.0
    well_formed, correct = check_response(problem, text)
    return 1.0 if correct else format_reward if well_formed else 0.0


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
        separator_variants: float = 0.0,
        variant_set: str = "separators",
        layout: str = "compact",
    ):
        """num_operands: numbers per problem (each used exactly once); min_number..max_number: their range;
        max_value: the largest value a step may produce; min_target..max_target: the targets' range;
        ops: from "+", "-", "*", "/"; format_reward: reward of a well-formed wrong response (0 disables);
        test_fraction: share of problems held out; split_seed: which ones; tokenizer: an HF tokenizer
        knowing digits, the operators, " :,=" and "a" "n" "s" "t" "o" (default: `build_char_tokenizer()`);
        separator_variants: the chance that a warm-up trace writes a character of `variant_set` as each
        of its variants (`VARIANT_SETS`; "separators": ",", ":" and " " as ";", "|" and "_"); with it
        above 0 the reward and the labels read a variant as its character (the tokenizer must know the
        variants); variant_set: which characters have variants, a key of `VARIANT_SETS`; layout: how a
        response is written, one of countdown_rules.LAYOUTS (module docstring)."""
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
        check_fractions(test_fraction, format_reward)
        if not isinstance(separator_variants, (int, float)) or not 0.0 <= separator_variants < 0.5:
            raise ValueError(f"separator_variants must be a number in [0, 0.5), got {separator_variants!r}")
        if variant_set not in VARIANT_SETS:
            raise ValueError(f"variant_set must be one of {sorted(VARIANT_SETS)}, got {variant_set!r}")
        if separator_variants * max(map(len, VARIANT_SETS[variant_set].values())) >= 0.5:
            raise ValueError(f"separator_variants={separator_variants} with variant_set={variant_set!r} writes a "
                             f"character as one of its variants half the time or more: it must stay the rarer way")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if tokenizer is None:
            tokenizer = build_char_tokenizer()
        self.num_operands, self.min_number, self.max_number = num_operands, min_number, max_number
        self.max_value, self.min_target, self.max_target, self.ops = max_value, min_target, max_target, ops
        self.format_reward, self.test_fraction, self.split_seed = format_reward, test_fraction, split_seed
        self.tokenizer = tokenizer
        self.separator_variants, self.variant_set, self.layout = float(separator_variants), variant_set, layout
        self._label_text = label_spaced if layout == "spaced" else label_response
        """One label per character of a response written in this task's layout."""
        self._pieces: list[str] | None = None

    def _draws(self, rng: random.Random) -> Iterator[CountdownProblem]:
        for _ in range(MAX_DRAWS_PER_PROBLEM):
            numbers = tuple(rng.randint(self.min_number, self.max_number) for _ in range(self.num_operands))
            target = random_walk(numbers, self.ops, self.max_value, rng)
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
        sure_only = _SURE_ONLY.get(self.variant_set, frozenset())
        out = []
        for p in self.problems(split, n, seed):
            steps = sample_solution(p, rng)
            assert steps is not None, "a problem is drawn as the end of a legal walk"
            text = format_trace(p, steps)
            if self.layout == "spaced":
                text = spaced(text)
            if self.separator_variants > 0:
                labels = self._label_text(p, text) if sure_only else []
                text = "".join(c if c in sure_only and labels[i] not in (FORCED, ANSWER) else self._vary(c, rng)
                               for i, c in enumerate(text))
            out.append((self.tokenizer.encode(p.text),
                        self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]))
        return out

    def _vary(self, c: str, rng: random.Random) -> str:
        """`c`, or one of its variants, each with chance `separator_variants` (one draw per character
        that has variants, so "separators" traces are those of a one-variant rule)."""
        variants = VARIANT_SETS[self.variant_set].get(c)
        if not variants:
            return c
        u, rate = rng.random(), self.separator_variants
        return variants[min(int(u / rate), len(variants) - 1)] if u < rate * len(variants) else c

    def _canonical(self, text: str) -> str:
        """`text` with each variant read as its character (when the task writes them)."""
        return text.translate(_CANONICAL[self.variant_set]) if self.separator_variants > 0 else text

    def reward(self, sample: Sample, reference: CountdownProblem) -> float:
        """`countdown_reward` of the response up to its first EOS."""
        ended = self.tokenizer.eos_token_id in sample.response_ids
        text = self._canonical(decode_response(self.tokenizer, sample.response_ids))
        if self.layout == "spaced":
            read = compact(text)
            if read is None:             # not in the layout: not well formed
                return 0.0
            text = read
        return countdown_reward(reference, text, ended=ended, format_reward=self.format_reward)

    def token_labels(self, sample: Sample, reference: CountdownProblem) -> list[str]:
        """One TOKEN_LABELS entry per response token of `sample` (`label_tokens`)."""
        if self._pieces is None:
            self._pieces = [self._canonical(self.tokenizer.decode([i], skip_special_tokens=True))
                            for i in range(len(self.tokenizer))]
        return label_tokens(reference, list(sample.response_ids), self._pieces, self.tokenizer.eos_token_id,
                            spaced=self.layout == "spaced")

    def new_environment(self) -> None:
        """Single turn: no environment."""
        return None

"""Rewards for math answers: `math-verify` (symbolic equivalence), or a weaker string normaliser.

    math_verify_reward("... so the answer is \\boxed{\\frac12}", "0.5")     # 1.0
    normalised_match_reward("... \\boxed{1/2}", "\\frac{1}{2}")            # 1.0 (numeric values)

`math-verify` (pip extra "math": `pip install 'entr-megatron[math]'`, i.e.
`math-verify`) parses LaTeX and plain expressions with sympy and compares them
symbolically; use it for real math data. The fallback normaliser only extracts
the last \\boxed{...} (else the last number), strips LaTeX decoration and compares
strings, or values when both sides are plain numbers/fractions: it misses
equivalent forms (2\\sqrt{2} vs \\sqrt{8}, intervals, sets, reordered terms), so it
under-counts correct answers. It never credits a wrong one it can parse.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

__all__ = [
    "MATH_EXTRA_HINT", "extract_boxed", "math_verify_available", "math_verify_reward",
    "normalise_answer", "normalised_match_reward",
]

MATH_EXTRA_HINT = "install the 'math' extra: pip install 'entr-megatron[math]' (the package math-verify)"


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns on every call made with timeouts off; off-main-thread that is every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_FILTER = _NoTimeoutWarning()


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_verify_reward(response: str, reference: str) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to the reference, else 0.0.

    The reference may be a bare answer ("\\frac{1}{2}", "0.5") or a full solution with
    \\boxed{...}. math-verify's timeouts use SIGALRM, which only works on the main thread:
    elsewhere they are switched off.
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError(f"the math-verify reward needs math-verify: {MATH_EXTRA_HINT}") from e
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    for name in ("math_verify.parser", "math_verify.grader"):
        if _FILTER not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_FILTER)
    if "\\boxed" not in reference and "$" not in reference:
        reference = f"${reference}$"
    gold = parse(reference, parsing_timeout=timeout)
    if not gold:
        return 0.0
    pred = parse(response, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}", "\\%", "%")


def normalise_answer(answer: str) -> str:
    """A canonical string for simple answers (see module docstring for what it misses)."""
    s = answer.strip()
    for d in _DROP:
        s = s.replace(d, "")
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^\(([^()]*)\)/\(([^()]*)\)$", r"\1/\2", s)
    if s.startswith(("x=", "y=", "n=", "k=")):
        s = s[2:]
    return s


def _value(s: str) -> Fraction | None:
    if not re.fullmatch(r"-?\(?-?[\d,]*\.?\d+\)?(/\(?\d+\)?)?", s):
        return None
    try:
        return Fraction(s.replace(",", "").replace("(", "").replace(")", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _final_answer(text: str) -> str | None:
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalised_match_reward(response: str, reference: str) -> float:
    """The weaker fallback: 1.0 if the final answers match after normalisation, else 0.0."""
    pred = _final_answer(response)
    gold = extract_boxed(reference) if "\\boxed" in reference else reference
    if pred is None or gold is None:
        return 0.0
    p, g = normalise_answer(pred), normalise_answer(gold)
    if p == g and p:
        return 1.0
    vp, vg = _value(p), _value(g)
    return 1.0 if vp is not None and vp == vg else 0.0

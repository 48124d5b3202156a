"""The validators every config section uses, and the one error they raise.

Each section class names where it sits in a run with a `SECTION` class attribute
(`"rollout.sglang"`); a validator takes the section instance and a field name, so a
message reads `rollout.sglang.tp_size=0 is not valid; must be an integer >= 1`.
Sections that are also used on their own (AlgorithmConfig, LearnerConfig) say their
class name (`AlgorithmConfig.tau`); the loader, which knows the dotted path it builds,
re-homes the error with `FieldError.at` (`algorithm.tau`). Choices are `Literal` types:
`choice` reads the allowed values from the type itself. Numbers are finite: YAML's .inf, -.inf
and .nan are refused in every float field (by the loader, and by `number` for sections built in
Python); the one place .inf means something, the upper end of AlgorithmConfig's ratio bands
("no upper bound"), says so in its doc. Layer L0.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any, get_args
from urllib.parse import urlsplit


class FieldError(ValueError):
    """A config value a user got wrong: the field's dotted path, the value and what is allowed."""

    def __init__(self, section: str, name: str, value: Any, rule: str, when: str = "") -> None:
        # The parts are the exception's args, so it pickles across processes like any ValueError.
        super().__init__(section, name, value, rule, when)
        self.section, self.name, self.value, self.rule, self.when = section, name, value, rule, when

    @property
    def path(self) -> str:
        """The field's dotted path, e.g. rollout.sglang.tp_size."""
        return f"{self.section}.{self.name}" if self.section else self.name

    def __str__(self) -> str:
        when = f" with {self.when}" if self.when else ""
        return f"{self.path}={self.value!r} is not valid{when}; {self.rule}"

    def at(self, section: str) -> FieldError:
        """The same error for its section placed at the dotted path `section` of a run."""
        return FieldError(section, self.name, self.value, self.rule, self.when)


def bad(obj: Any, name: str, value: Any, rule: str, when: str = "") -> FieldError:
    """The error for field `name` (dotted below `obj`'s section) of section `obj` holding `value`.

    `when` names what makes the value invalid when it is valid on its own ("correction='tis'")."""
    return FieldError(type(obj).SECTION, name, value, rule, when)


NOT_FINITE = "must be a finite number (not .inf or .nan)"
"""The rule of a float field given YAML's .inf, -.inf or .nan (the loader and `number` say it alike)."""


def is_number(value: Any) -> bool:
    """A finite int or float: not NaN or +-inf (YAML's .nan, .inf), and not a bool (an int subclass,
    but `lr: true` in YAML is a typo, not 1.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def is_non_finite(value: Any) -> bool:
    """A float that is NaN or +-inf."""
    return isinstance(value, float) and not math.isfinite(value)


def choice(obj: Any, name: str, options: Any) -> None:
    """Field `name` must be one of the values of the `Literal` type `options`."""
    value, allowed = getattr(obj, name), get_args(options)
    if value not in allowed:
        raise bad(obj, name, value, f"allowed: {', '.join(allowed)}")


def integer(obj: Any, name: str, low: int = 0, high: int | None = None, optional: bool = False) -> None:
    """Field `name` must be an integer in [low, high] (high None: no upper bound), or None if optional."""
    value = getattr(obj, name)
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(obj, name, value, f"must be {'null or ' if optional else ''}an integer {span}")


def number(
    obj: Any, name: str, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False
) -> None:
    """Field `name` must be a finite number in the interval from `low` to `high` (a `high` of inf: no
    upper bound, but .inf itself is refused); the bounds print as given (0 or 0.0)."""
    value = getattr(obj, name)
    rule = f"must be a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if is_non_finite(value):
        raise bad(obj, name, value, NOT_FINITE)
    if not is_number(value):
        raise bad(obj, name, value, rule)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        raise bad(obj, name, value, rule)


def boolean(obj: Any, name: str, optional: bool = False) -> None:
    """Field `name` must be true or false (or None if optional)."""
    value = getattr(obj, name)
    if not isinstance(value, bool) and not (optional and value is None):
        raise bad(obj, name, value, f"must be {'null, ' if optional else ''}true or false")


def string(obj: Any, name: str, optional: bool = False) -> None:
    """Field `name` must be a non-empty string (or None if optional)."""
    value = getattr(obj, name)
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise bad(obj, name, value, f"must be {'null or ' if optional else ''}a non-empty string")


def str_tuple(obj: Any, name: str, options: Any = None) -> None:
    """Field `name` must be a list of strings (each a value of the `Literal` type `options` if given).

    Lists from YAML become tuples (frozen, hashable)."""
    value, allowed = getattr(obj, name), get_args(options) if options is not None else None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise bad(obj, name, value, "must be a list of strings")
    for item in value:
        if not isinstance(item, str) or (allowed is not None and item not in allowed):
            extra = f" from: {', '.join(allowed)}" if allowed else ""
            raise bad(obj, name, value, f"must be a list of strings{extra}")
    object.__setattr__(obj, name, tuple(value))


def url_tuple(obj: Any, name: str) -> None:
    """Field `name` must be a non-empty list of distinct http(s)://host[:port] URLs, stored as a
    tuple without trailing '/'."""
    value = getattr(obj, name)
    rule = "must be null or a non-empty list of distinct http:// or https:// URLs (e.g. http://10.0.0.2:30000)"
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise bad(obj, name, value, rule)
    urls = []
    for item in value:
        if not isinstance(item, str):
            raise bad(obj, name, value, rule)
        try:
            parts = urlsplit(item)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise bad(obj, name, value, f"{rule}; {item!r} is not a URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise bad(obj, name, value, f"{rule}; {item!r} is not one")
        urls.append(item.rstrip("/"))
    if len(set(urls)) != len(urls):
        raise bad(obj, name, value, f"{rule}; a server is listed twice")
    object.__setattr__(obj, name, tuple(urls))


def readable_files(obj: Any, name: str) -> None:
    """Every path of the list field `name` must be a regular file this process can read. Not run when a
    section is built (a config is also loaded where its files are not, e.g. to plan a study):
    the job calls it before it starts (controller/job/run.py `check_inputs`)."""
    value = getattr(obj, name)
    for path in value:
        if os.path.isdir(path):
            problem = "is a directory, not a file"
        elif not os.path.exists(path):
            problem = "does not exist"
        elif not os.access(path, os.R_OK):
            problem = "is not readable (permissions)"
        elif not stat.S_ISREG(os.stat(path).st_mode):  # /dev/zero: read without end
            problem = "is not a regular file (a device, pipe or socket)"
        else:
            continue
        raise bad(obj, name, value, f"{path} {problem}")

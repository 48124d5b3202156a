"""Parameter-name templates: `decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}`.

A template names one parameter per (layer, expert) index. It matches a concrete
name only as a whole (anchored), so a name is resolved by which template it *is*,
never by which substring it happens to contain first.
"""

from __future__ import annotations

import functools
import re
import string

INDEX_FIELDS = ("layer", "expert")
_INDEX_PATTERN = r"(?P<{}>0|[1-9][0-9]*)"  # no leading zeros: one spelling per index


class Template:
    """A compiled name template with `{layer}` / `{expert}` placeholders."""

    __slots__ = ("text", "fields", "_regex")

    def __init__(self, text: str):
        fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
        unknown = set(fields) - set(INDEX_FIELDS)
        assert not unknown, f"template {text!r} has unknown fields {sorted(unknown)}"
        assert len(fields) == len(set(fields)), f"template {text!r} repeats a field"
        self.text = text
        self.fields = tuple(fields)
        pattern = "".join(
            re.escape(literal) + (_INDEX_PATTERN.format(field) if field else "")
            for literal, field, _, _ in string.Formatter().parse(text)
        )
        self._regex = re.compile(pattern)

    def match(self, name: str) -> dict[str, int] | None:
        """Indices if `name` is an instance of this template, else None."""
        m = self._regex.fullmatch(name)
        if m is None:
            return None
        return {k: int(v) for k, v in m.groupdict().items()}

    def format(self, **indices: int) -> str:
        """The concrete name for these indices (extra indices are ignored)."""
        return self.text.format(**{f: indices[f] for f in self.fields})

    def __repr__(self) -> str:
        return f"Template({self.text!r})"


@functools.lru_cache(maxsize=None)
def compile_template(text: str) -> Template:
    """Cached `Template(text)`."""
    return Template(text)


def resolve(name: str, templates: tuple[str, ...]) -> tuple[str, dict[str, int]] | None:
    """The single template in `templates` that `name` instantiates, with its indices.

    Returns None when none matches. Two matches mean the table is ambiguous, which
    is a bug in the table, not in the caller's input.
    """
    found = []
    for text in templates:
        indices = compile_template(text).match(name)
        if indices is not None:
            found.append((text, indices))
    assert len(found) <= 1, f"{name!r} matches several templates: {[t for t, _ in found]}"
    return found[0] if found else None

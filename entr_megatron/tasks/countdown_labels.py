"""Countdown's token labeller: one label per response token, for metrics split by what a token does.

    label_response(problem, "9*7=63:3 1 63,...", eos=True)   # ["choice", "choice", "choice", "forced", ...]
    label_tokens(problem, response_ids, pieces, eos_id)       # the same from token ids
    label_spaced(problem, "9 * 7 = 63 : 3 1 63 , ...")        # the same for the spaced layout

What each label means is in countdown.py's docstring and docs/tasks.md ("Token labels").
"""

from __future__ import annotations

import re

from entr_megatron.tasks.countdown_rules import ANSWER_MARK, MARKS, CountdownProblem, apply_step, legal_heads
from entr_megatron.types import TOKEN_LABELS

__all__ = ["ANSWER", "ARITHMETIC", "CHOICE", "FORCED", "TOKEN_LABELS", "label_response", "label_spaced", "label_tokens"]

FORCED, CHOICE, ARITHMETIC, ANSWER = TOKEN_LABELS
"""The labels `label_response` gives (module docstring: what each means), types.TOKEN_LABELS in order."""


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
        heads, head = legal_heads(values, ops, mv), ""
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


def label_spaced(problem: CountdownProblem, text: str, *, eos: bool = False) -> list[str]:
    """`label_response` for a response in the spaced layout (countdown_rules.LAYOUTS), one label per
    character: the space before a mark takes the mark's label (a BPE writes " =" as one token, and
    whether "=" comes next is the mark's question), the space after it is `forced`; every other
    character has its label in the compact text. Reads any text: a mark missing a space loses only
    that space."""
    n = len(text)
    dropped: dict[int, int | None] = {}          # dropped space -> the mark it precedes (None: it follows one)
    for i, c in enumerate(text):
        if c in MARKS:
            if i > 0 and text[i - 1] == " " and i - 1 not in dropped:
                dropped[i - 1] = i
            if i + 1 < n and text[i + 1] == " ":
                dropped[i + 1] = None
    kept = [i for i in range(n) if i not in dropped]
    chars = label_response(problem, "".join(text[i] for i in kept), eos=eos)
    at = dict(zip(kept, chars))
    out = [FORCED if i in dropped and dropped[i] is None else at[dropped.get(i, i)] for i in range(n)]
    return out + chars[len(kept):]


def label_tokens(
    problem: CountdownProblem, response_ids: list[int], pieces: list[str], eos_id: int | None, *,
    spaced: bool = False,
) -> list[str]:
    """One label per id of `response_ids`: `pieces[id]` is each id's text (see CountdownTask.token_labels).
    EOS is `forced`; so is every id after it (the engine stops there; nothing after it counts). A token
    of several characters takes its first character's label; one that decodes to nothing (a special
    token other than EOS) is `choice` (the rules never call for it)."""
    end = response_ids.index(eos_id) if eos_id is not None and eos_id in response_ids else len(response_ids)
    texts = [pieces[t] for t in response_ids[:end]]
    chars = (label_spaced if spaced else label_response)(problem, "".join(texts))
    out, pos = [], 0
    for piece in texts:
        out.append(chars[pos] if piece else CHOICE)
        pos += len(piece)
    return out + [FORCED] * (len(response_ids) - end)

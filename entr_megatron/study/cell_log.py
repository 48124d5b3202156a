"""What a failed study cell recorded as its error: the message a user needs, read from its train.log.

    error = cell_error(log_text, returncode)   # "exit 1: ValueError: model.path ... has no tokenizer"

A cell's train.log holds every attempt, each after a header line `===== <time> entr-megatron ...`
(runner.run_command). Only the last attempt counts. Its message is, whichever comes last:
- the exception of the last Python traceback (the `Type: message` lines after the frames, a
  multi-line message whole), or
- a command's own error line (`entr-megatron train: ...`, how the CLI reports bad input),
and otherwise the attempt's last lines. A traceback's frames are never the message: they are in
train.log, which the report names.
"""

from __future__ import annotations

__all__ = ["ATTEMPT_HEADER", "MAX_ERROR_CHARS", "cell_error"]

ATTEMPT_HEADER = "===== "
"""Start of the line run_command writes before each attempt's output."""
MAX_ERROR_CHARS = 2000
"""Longest recorded message (an exception message may hold a whole config)."""
MAX_ERROR_LINES = 12
"""Most lines of one message (a multi-line exception message or the attempt's last lines)."""
TRACEBACK = "Traceback (most recent call last):"


def _last_attempt(text: str) -> list[str]:
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]  # a progress bar's last state
    starts = [i for i, line in enumerate(lines) if line.startswith(ATTEMPT_HEADER)]
    return lines[starts[-1] + 1:] if starts else lines


def _exception(lines: list[str], start: int) -> tuple[int, list[str]]:
    """(index, lines) of the exception that ends the traceback starting at `start`: the first
    unindented lines after its frames, up to a blank line."""
    i = start + 1
    while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i]):
        i += 1
    first, found = i, []
    while i < len(lines) and lines[i] and len(found) < MAX_ERROR_LINES:
        found.append(lines[i])
        i += 1
    return first, found


def cell_error(log_text: str, returncode: int) -> str:
    """The error recorded for a cell attempt that exited with `returncode` (see the module docstring)."""
    lines = _last_attempt(log_text)
    candidates: list[tuple[int, list[str]]] = []
    tracebacks = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK)]
    if tracebacks:
        at, found = _exception(lines, tracebacks[-1])
        if found:
            candidates.append((at, found))
    commands = [i for i, line in enumerate(lines) if line.startswith("entr-megatron ") and ": " in line]
    if commands:
        candidates.append((commands[-1], [lines[commands[-1]]]))
    if candidates:
        message = max(candidates, key=lambda c: c[0])[1]
    else:
        message = [line for line in lines if line.strip()][-MAX_ERROR_LINES:] or ["(no output; see train.log)"]
    text = "\n".join(message)
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + " ..."
    return f"exit {returncode}: {text}"

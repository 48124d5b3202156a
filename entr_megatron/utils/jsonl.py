"""JSONL files for the CLI and data loaders: numbered input lines, token-id checks, atomic output.

Errors are `ValueError`s that start with "FILE:LINE:" so a user can jump to the bad
line; the wording matches `score` (whose own copies predate this module).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_output", "check_output_path", "check_token_ids", "read_jsonl_objects"]


def read_jsonl_objects(path: str, flag: str = "--input") -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, "path:line", object) for every non-blank line; ValueError names the line
    that is not UTF-8 (the byte and column), not JSON or not an object, and `flag` when the file
    cannot be read or is not a regular file. A UTF-8 byte-order mark before the first line is allowed."""
    try:
        f = open(path, "rb")  # bytes: a line that is not UTF-8 is named, not a decoder traceback
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # /dev/zero would be one endless line
        f.close()
        raise ValueError(f"{flag}: {path} is not a regular file (a device, pipe or socket); give a JSONL file")
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                 "JSONL files are UTF-8") from None
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, where, obj


def check_token_ids(ids: Any, where: str, field: str, vocab_size: int | None) -> list[int]:
    """`ids` as a non-empty list of token ids in [0, vocab_size) (no upper bound when None)."""
    if not isinstance(ids, list) or not ids:
        raise ValueError(f'{where}: "{field}" must be a non-empty list of token ids')
    for k, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{where}: {field}[{k}]={t!r} is not an integer token id")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = "" if vocab_size is None else f" [0, {vocab_size})"
            raise ValueError(f"{where}: {field}[{k}]={t} is outside the model's vocabulary{bound}")
    return ids


def check_output_path(path: str, flag: str = "--output") -> None:
    """Refuse an output whose directory is missing or read-only before any work is done."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {directory} does not exist or is not writable")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[IO[str]]:
    """A text file that appears at `path` only if the block succeeds (temp file in the same
    directory, fsync, rename); on any error or interrupt the temp file is removed."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

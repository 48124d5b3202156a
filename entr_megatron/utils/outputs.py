"""No command writes onto what it reads: an output path that is, lies inside or contains one of
the command's inputs is refused before anything is read or written.

    check_output("--output", args.output, [("--input", args.input), ("--model", args.model)])

Paths are compared as real paths (symlinks followed; an output that does not exist yet by the real
path of its nearest existing parent). Every command that takes inputs and writes outputs calls it:
convert (--out), score and generate (--output), study report (--out), train and sft (the run
directory against the files its config reads). Layer L0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["check_output", "relation"]


def relation(out: str | os.PathLike, src: str | os.PathLike) -> str | None:
    """How the output path `out` stands to the input path `src`: "is", "is inside", "contains" or
    None (apart), by their real paths."""
    o, s = os.path.realpath(out), os.path.realpath(src)
    if o == s:
        return "is"
    if o.startswith(s.rstrip(os.sep) + os.sep):
        return "is inside"
    if s.startswith(o.rstrip(os.sep) + os.sep):
        return "contains"
    return None


def check_output(out_flag: str, out: str | os.PathLike, sources: Iterable[tuple[str, str | os.PathLike | None]],
                 refused: tuple[str, ...] = ("is", "is inside", "contains"), instead: str | None = None) -> None:
    """Raises ValueError naming both when `out` (given as `out_flag`) stands to a source (flag,
    path; None paths skipped) in one of the `refused` relations; `instead`: what to do (default:
    choose another `out_flag`)."""
    for flag, path in sources:
        if path is None:
            continue
        how = relation(out, path)
        if how is None or how not in refused:
            continue
        real = (os.path.realpath(out), os.path.realpath(path))
        shown = f" (real paths {real[0]} and {real[1]})" if real != (os.path.abspath(out), os.path.abspath(path)) else ""
        raise ValueError(f"{out_flag} {out} {how} the source {flag} {path}{shown}: writing it would replace or mix "
                         f"with what is being read; {instead or 'choose another ' + out_flag}")

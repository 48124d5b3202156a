"""Checkpoints you can trust: a manifest of every file's size and SHA-256, written last, checked
before a checkpoint is loaded; choosing the newest good checkpoint of a root.

    digests = digest_files(tmp_dir, names)              # each rank: the files it wrote
    write_manifest(tmp_dir, step, digests)              # rank 0, the last file of a save
    problems = verify_checkpoint(iter_dir)              # [] when every file is as saved
    choice = choose_checkpoint(root)                    # newest good one; what was skipped and why

``iter_<step>/manifest.json``::

    {"format": 1, "step": 100, "total_bytes": 9828631,
     "files": {"common.pt": {"size": 14626, "sha256": "..."}, "__0_0.distcp": {...}, ...}}

A save is published (``directory.commit``) only once its manifest exists, so a checkpoint with a
manifest was complete when written; verification then catches what happened to it since: a
flipped byte, a truncated or deleted shard, an extra or renamed file. Checkpoints written before
manifests existed load with a warning (they can only be checked for completeness).

Hashing runs in a thread pool (hashlib releases the GIL), about 1 GB/s per core; the learner's
ranks each hash the files they wrote, so a save costs one extra read of its own shards.

Nothing here imports torch or megatron.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from entr_megatron.checkpoint import directory
from entr_megatron.checkpoint.directory import (
    MANIFEST_FILE,
    CheckpointError,
    fsync_dir,
    missing_markers,
    iter_dir,
    latest_step,
    list_steps,
)

__all__ = ["MANIFEST_FILE", "CheckpointChoice", "choose_checkpoint", "digest_files", "read_manifest",
           "verify_checkpoint", "write_manifest"]

logger = logging.getLogger(__name__)

FORMAT = 1
_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    # One buffer read into again and again (a new 4 MiB block per read: 17-21 MB at the peak with
    # two hashing threads, 8.5 MB this way, measured on the 2.2 GB bench model).
    h, view = hashlib.sha256(), memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def digest_files(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files ``names`` under ``directory`` (hashed in parallel)."""
    directory = Path(directory)
    names = sorted(set(names))
    with concurrent.futures.ThreadPoolExecutor(_threads()) as pool:
        hashes = list(pool.map(lambda n: _sha256(directory / n), names))
    return {n: {"size": (directory / n).stat().st_size, "sha256": h} for n, h in zip(names, hashes)}


def data_files(directory: str | os.PathLike) -> list[str]:
    """Every file a manifest covers: all regular files of the checkpoint directory but the manifest."""
    return sorted(e.name for e in Path(directory).iterdir() if e.is_file() and e.name != MANIFEST_FILE)


def write_manifest(directory: str | os.PathLike, step: int, digests: dict[str, dict]) -> Path:
    """Writes ``directory/manifest.json`` (atomically, fsynced) covering exactly the files in
    ``directory``; raises ``CheckpointError`` when ``digests`` miss one or name one not there."""
    directory = Path(directory)
    present = set(data_files(directory))
    missing, extra = sorted(present - set(digests)), sorted(set(digests) - present)
    if missing or extra:
        raise CheckpointError(f"manifest of {directory} does not match its files: not hashed {missing}, "
                              f"hashed but absent {extra}")
    manifest = {"format": FORMAT, "step": step, "total_bytes": sum(d["size"] for d in digests.values()),
                "files": {n: digests[n] for n in sorted(digests)}}
    tmp = directory / f".tmp_{MANIFEST_FILE}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)
    fsync_dir(directory)
    return directory / MANIFEST_FILE


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The manifest of a checkpoint directory; None when it has none (an older checkpoint).
    Raises ``CheckpointError`` naming the file when it is not a manifest."""
    path = Path(directory) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("size"), int)
                                              and isinstance(v.get("sha256"), str) for v in files.values()):
        raise CheckpointError(f"{path}: not a checkpoint manifest (expected {{'files': {{name: {{size, sha256}}}}}})")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: manifest format {manifest.get('format')!r}, this version reads {FORMAT}")
    return manifest


def verify_checkpoint(directory: str | os.PathLike, *, checksums: bool = True) -> list[str]:
    """What is wrong with the checkpoint ``directory`` against its manifest ([] when nothing is):
    missing, extra, resized or changed files (``checksums=False``: sizes only). A directory
    without a manifest is checked for completeness only (a logged warning)."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory.name} does not exist"]
    try:
        manifest = read_manifest(directory)
    except CheckpointError as e:
        return [str(e)]
    if manifest is None:
        missing = missing_markers(directory)
        if missing:
            return [f"incomplete: {', '.join(missing)} missing"]
        logger.warning("%s has no %s (saved by an older version): checked for completeness only",
                       directory, MANIFEST_FILE)
        return []
    problems = []
    want = manifest["files"]
    present = set(data_files(directory))
    problems += [f"{n}: missing" for n in sorted(set(want) - present)]
    problems += [f"{n}: not in the manifest" for n in sorted(present - set(want))]
    same_size = []
    for n in sorted(set(want) & present):
        size = (directory / n).stat().st_size
        if size != want[n]["size"]:
            problems.append(f"{n}: {size} bytes, the manifest says {want[n]['size']} (truncated or rewritten)")
        else:
            same_size.append(n)
    if checksums and same_size:
        got = digest_files(directory, same_size)
        problems += [f"{n}: SHA-256 differs from the manifest (damaged)" for n in same_size
                     if got[n]["sha256"] != want[n]["sha256"]]
    return problems


@dataclasses.dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint to resume from and what was passed over on the way."""

    step: int
    path: Path
    skipped: list[tuple[str, list[str]]]
    """(checkpoint or file name, its problems) of every newer candidate rejected, newest first."""


def _candidates(root: Path) -> tuple[list[int], list[tuple[str, list[str]]]]:
    steps = list_steps(root)
    notes: list[tuple[str, list[str]]] = []
    try:
        latest = latest_step(root)
    except CheckpointError as e:
        latest = None
        notes.append(("latest", [str(e)]))
    else:
        if latest is None and steps:
            notes.append(("latest", ["missing (deleted?): choosing among the iter_* directories"]))
    if latest is None:
        return sorted(steps, reverse=True), notes
    if latest not in steps:
        notes.append((iter_dir(root, latest).name, ["missing: 'latest' names it"]))
    # a rollback can leave higher steps from an abandoned line: never newer than `latest`
    return sorted((s for s in steps if s <= latest), reverse=True), notes


def choose_checkpoint(root: str | os.PathLike, step: int | None = None, *, checksums: bool = True) -> CheckpointChoice:
    """The checkpoint to load from ``root``: ``step`` (which must be good), or the one ``latest``
    names, or when that one is missing or damaged the newest good older one. Raises
    ``CheckpointNotFoundError`` when the root holds no checkpoint at all and ``CheckpointError``,
    listing every candidate with its problems, when none is good."""
    root = Path(root)
    if step is not None:
        path = directory.resolve_checkpoint_dir(root, step)[1]  # missing or incomplete: its own message
        problems = verify_checkpoint(path, checksums=checksums)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems)
                                  + f" (steps there: {list_steps(root)})")
        return CheckpointChoice(step, path, [])
    if not root.is_dir() or not list_steps(root):
        directory.resolve_checkpoint_dir(root)  # raises the not-found message, naming what is there
    steps, skipped = _candidates(root)
    for s in steps:
        problems = verify_checkpoint(iter_dir(root, s), checksums=checksums)
        if not problems:
            return CheckpointChoice(s, iter_dir(root, s), skipped)
        skipped.append((iter_dir(root, s).name, problems))
    listing = "\n".join(f"  {name}: {'; '.join(p)}" for name, p in skipped)
    raise CheckpointError(f"no usable checkpoint in {root}:\n{listing}")

"""The on-disk layout of learner checkpoints, and the renames that make a save atomic.

    ckpt_root/
      latest                  the step of the last complete checkpoint (text)
      model_config.json       the HF config of the model saved here (optional: ``save_checkpoint(model_config=)``)
      iter_0000100/           a complete checkpoint (Megatron dist checkpointing, torch_dist), its last
                              file manifest.json: every file's size and SHA-256 (checkpoint/manifest.py)
      iter_0000200/
      .tmp_iter_0000300/      a save in progress, or the leftovers of one that crashed

A save writes everything into ``.tmp_iter_<step>``, the manifest last, and only then, on rank 0,
renames the directory to ``iter_<step>`` and replaces ``latest`` (written to
``.tmp_latest`` first). Both are single ``rename`` calls, so at every instant
``latest`` names a complete directory: a crash at any point leaves the previous
checkpoint as it was, plus ``.tmp_*`` debris that the next save or load removes
(and logs). Every name starting with ``.tmp_`` belongs to this module.

Nothing here imports megatron or torch.distributed: these functions run on one
rank (rank 0 for anything that writes) and the caller synchronises ranks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

__all__ = [
    "COMPLETE_MARKERS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "LATEST_FILE",
    "MODEL_CONFIG_FILE",
    "clean_stale",
    "commit",
    "fsync_dir",
    "is_learner_checkpoint",
    "iter_dir",
    "latest_step",
    "learner_checkpoint_roots",
    "list_steps",
    "missing_markers",
    "model_config_text",
    "prepare_tmp_dir",
    "read_model_config",
    "resolve_checkpoint_dir",
    "write_model_config",
]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
# The HF config.json contents of the model the checkpoints of a root belong to
# (so tools can build the model from the root alone, e.g. `entr-megatron score`).
MODEL_CONFIG_FILE = "model_config.json"
# Written by Megatron's torch_dist save: the common (rank-0) state, the DCP
# metadata, and metadata.json, which dist checkpointing writes last.
COMPLETE_MARKERS = ("common.pt", ".metadata", "metadata.json")
# Every file's size and checksum (checkpoint/manifest.py), the last file of a save: a directory is
# published only with it.
MANIFEST_FILE = "manifest.json"
_TMP = ".tmp_"
_ITER = re.compile(r"^iter_(\d{7,})$")
_OLD = re.compile(r"^\.tmp_old_(iter_\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked (the message says why and where)."""


class CheckpointSaveError(CheckpointError):
    """A save that failed (the message says why, e.g. ENOSPC); its partial files are gone and the
    previous checkpoint is intact."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given root (or not the requested step)."""


def iter_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/iter_<step:07d>``: where the checkpoint of ``step`` lives once complete."""
    return Path(root) / f"iter_{step:07d}"


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f"{_TMP}iter_{step:07d}"


def fsync_dir(path: Path) -> None:
    """Makes a rename in ``path`` durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step in ``root/latest`` (the last complete checkpoint), or None if there is none.

    Raises ``CheckpointError`` when the file exists but does not hold a step.
    """
    path = Path(root) / LATEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        step = int(text.strip())
    except ValueError:
        raise CheckpointError(f"{path}: expected a step number, found {text[:80]!r}") from None
    if step < 0:
        raise CheckpointError(f"{path}: expected a non-negative step, found {step}")
    return step


def list_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the ``iter_*`` directories under ``root``, ascending (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for e in root.iterdir() if (m := _ITER.match(e.name)) and e.is_dir())


def learner_checkpoint_roots(path: str | os.PathLike) -> list[tuple[Path, Path | None]]:
    """(checkpoint root, run directory or None) for each way `path` holds learner checkpoints: a run
    directory's checkpoints/, and `path` itself as a root (`latest`, iter_NNNNNNN/ directories)."""
    path = Path(path)
    return [(root, run) for root, run in ((path / "checkpoints", path), (path, None))
            if (root / LATEST_FILE).is_file() or list_steps(root)]


def is_learner_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a checkpoint root (`latest`, iter_NNNNNNN/) or a run directory with checkpoints/.
    Cheap (a few stat calls, no torch): `train` asks it of every model.path before anything loads."""
    return Path(path).is_dir() and bool(learner_checkpoint_roots(path))


def missing_markers(path: Path) -> list[str]:
    """The files of a finished torch_dist save that ``path`` lacks."""
    return [name for name in COMPLETE_MARKERS if not (path / name).exists()]


def resolve_checkpoint_dir(root: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """``(step, directory)`` of the checkpoint to load: ``step``, or the one ``latest`` names.

    Raises ``CheckpointNotFoundError`` naming ``root`` and what it holds when there
    is no such checkpoint, and ``CheckpointError`` when the directory is incomplete.
    """
    root = Path(root)
    if not root.is_dir():
        what = "it is a file" if root.exists() else "it does not exist"
        raise CheckpointNotFoundError(f"no checkpoint in {root}: {what}")
    if step is None:
        step = latest_step(root)
        if step is None:
            entries = sorted(e.name for e in root.iterdir())
            found = ", ".join(entries[:20]) + (f", ... ({len(entries)} entries)" if len(entries) > 20 else "")
            raise CheckpointNotFoundError(
                f"no checkpoint in {root}: no '{LATEST_FILE}' file (found: {found or 'an empty directory'})"
            )
    path = iter_dir(root, step)
    if not path.is_dir():
        steps = list_steps(root)
        raise CheckpointNotFoundError(
            f"no checkpoint for step {step} in {root}: {path.name} does not exist "
            f"(complete steps there: {steps or 'none'}; latest: {latest_step(root)})"
        )
    missing = missing_markers(path)
    if missing:
        raise CheckpointError(
            f"incomplete checkpoint {path}: {', '.join(missing)} missing (it was not written by a finished "
            "save; load another step)"
        )
    return step, path


def clean_stale(root: str | os.PathLike) -> list[str]:
    """Remove the ``.tmp_*`` leftovers of interrupted saves under ``root`` (rank 0 only); returns their names.

    A checkpoint moved aside to be overwritten (``.tmp_old_iter_X``) is put back
    when the save that replaces it never finished.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(_TMP):
            continue
        m = _OLD.match(entry.name)
        if m and not (root / m.group(1)).exists():
            logger.warning("restoring checkpoint %s, moved aside by a save that did not finish", root / m.group(1))
            os.replace(entry, root / m.group(1))
            continue
        logger.warning("removing %s, left by a checkpoint save that did not finish", entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    if removed:
        fsync_dir(root)
    return removed


def prepare_tmp_dir(root: str | os.PathLike, step: int) -> Path:
    """Create ``root`` if needed, clean stale leftovers, and return an empty ``.tmp_iter_<step>`` (rank 0)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    tmp = _tmp_dir(root, step)
    tmp.mkdir()
    return tmp


def _write_latest(root: Path, step: int) -> None:
    tmp = root / f"{_TMP}{LATEST_FILE}"
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)
    fsync_dir(root)


def _remove_checkpoint(root: Path, step: int) -> None:
    # Rename first: a crash mid-rmtree leaves .tmp_ debris, never a half-deleted iter_ directory.
    doomed = root / f"{_TMP}del_{iter_dir(root, step).name}"
    os.replace(iter_dir(root, step), doomed)
    shutil.rmtree(doomed)
    logger.info("removed checkpoint %s (keep_last)", iter_dir(root, step))


def commit(root: str | os.PathLike, step: int, keep_last: int | None = None) -> Path:
    """Publish the finished ``.tmp_iter_<step>`` as ``iter_<step>`` and point ``latest`` at it (rank 0).

    An existing ``iter_<step>`` is replaced (moved aside first, restored by
    ``clean_stale`` if this crashes half way). With ``keep_last=N`` this one and
    the N-1 highest steps below it are kept; higher steps (left by a rollback, or
    a damaged checkpoint the run fell back from) are neither counted nor deleted.
    """
    root = Path(root)
    tmp, final = _tmp_dir(root, step), iter_dir(root, step)
    missing = missing_markers(tmp) + ([] if (tmp / MANIFEST_FILE).exists() else [MANIFEST_FILE])
    if missing:
        raise CheckpointError(f"refusing to publish {tmp}: {', '.join(missing)} missing")
    aside = None
    if final.exists():
        aside = root / f"{_TMP}old_{final.name}"
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(root)
    _write_latest(root, step)
    if aside is not None:
        shutil.rmtree(aside)
    if keep_last is not None:
        # Steps above this one (abandoned by a rollback, or a damaged checkpoint the run went back
        # from) are neither counted nor deleted: the newest keep_last up to this step stay.
        older = [s for s in list_steps(root) if s < step]
        for old in older[:max(0, len(older) - (keep_last - 1))]:
            _remove_checkpoint(root, old)
    return final


def model_config_text(config) -> str:
    """``config`` (an HF config dict or transformers config) as the text of ``model_config.json``.

    Raises ``CheckpointError`` when it is not a JSON-serialisable mapping.
    """
    if callable(getattr(config, "to_dict", None)):  # a transformers config
        config = config.to_dict()
    try:
        return json.dumps(dict(config), indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"model_config must be a JSON-serialisable HF config dict: {e}") from None


def write_model_config(root: str | os.PathLike, config) -> None:
    """Write ``config`` (an HF config dict) as ``root/model_config.json``, atomically (rank 0); None: nothing.

    Written to ``.tmp_model_config.json`` first and renamed, so readers see the
    old file or the new one, never a partial one.
    """
    if config is None:
        return
    text = model_config_text(config)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP}{MODEL_CONFIG_FILE}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MODEL_CONFIG_FILE)
    fsync_dir(root)


def read_model_config(root: str | os.PathLike) -> dict | None:
    """The HF config dict in ``root/model_config.json``, or None when the root has none.

    Raises ``CheckpointError`` naming the file when it is not a JSON object.
    """
    path = Path(root) / MODEL_CONFIG_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object (an HF config), found {type(config).__name__}")
    return config

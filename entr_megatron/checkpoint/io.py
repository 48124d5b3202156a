"""Learner checkpoints: Megatron dist checkpointing (torch_dist) of model, optimizer, scheduler, RNG and step.

    save_checkpoint(root, step, chunks, optimizer, scheduler, extra_state={"data_pos": 17})
    ...                                   # a later run, possibly with another TP/PP layout
    step, extra = load_checkpoint(root, chunks, optimizer, scheduler)

What a checkpoint holds (``root/iter_<step>/``) is listed in ``checkpoint.state``;
``checkpoint.directory`` is the directory protocol that makes a save atomic.
File-system decisions are taken on rank 0 and their outcome (or exception)
broadcast to every rank (``_on_rank0``).

With ``model_config=`` (the HF config dict) the root also holds ``model_config.json``
(``directory.read_model_config``): the model the checkpoints belong to, so a tool
can build it from the root alone (``entr-megatron score --model ckpt_root``).

RNG across layouts: the RNG streams are per rank and only mean something in the
layout that produced them, so they are restored only when the loading layout
(world size and every parallel size) equals the saved one. Otherwise the
current states, i.e. those ``initialize_model_parallel(seed=...)`` set, are
kept and a line is logged: weights, optimizer and scheduler resume exactly,
dropout masks from then on differ from the uninterrupted run's.

Resume is bit-identical on CPU in the same layout: weights, optimizer state,
Adam's step, the LR schedule and every RNG stream continue where they were.

Saving runs Megatron's torch_dist writer synchronously, which imports ``psutil`` and
forks writer processes; its results queue is an in-process one (``_writer_results_queue``:
Megatron would start a spawned manager process for it). A small model's save takes ~1 s.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import queue
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core.utils import unwrap_model

from entr_megatron.checkpoint import directory, manifest, state
from entr_megatron.checkpoint.compat import load_optimizer_state, prime_distributed_optimizer
from entr_megatron.checkpoint.directory import CheckpointError, CheckpointSaveError
from entr_megatron.checkpoint.state import DISTRIBUTED_OPTIMIZER_FORMATS, INFO_KEY, OPTIMIZER_KEY, RNG_KEY
from entr_megatron.checkpoint.validate import check_format, check_loadable, check_model_matches
from entr_megatron.parallel.cpu_compat import enable_cpu_compat

__all__ = ["load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)


# --- collectives around rank-0 file operations --------------------------------------------

def _on_rank0(fn, *args):
    """Run ``fn(*args)`` on rank 0 only; every rank returns its result or raises its exception.

    File-system decisions are taken once (ranks of a shared file system may see it
    at different moments), and a failure reaches every rank instead of leaving the
    others waiting in the next collective.
    """
    box: list[Any] = [None, None]
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = fn(*args)
        except Exception as e:
            error = e
            try:
                box[1] = pickle.loads(pickle.dumps(e))
            except Exception:
                box[1] = CheckpointError(f"rank 0 failed: {type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise box[1]
    return box[0]


def _check_model_config(config) -> None:
    if config is not None:
        directory.model_config_text(config)  # raises CheckpointError when it cannot be written


def _check_ready(chunks) -> list:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: checkpoints are written and read by all ranks")
    enable_cpu_compat()
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if not chunks:
        raise ValueError("model_chunks is empty")
    return unwrap_model(chunks)


def _writer_results_queue() -> None:
    """Megatron's torch_dist writer reports its write results through a module-level queue that
    it makes on the first save as a queue of a spawned `multiprocessing` manager process
    (filesystem_async._get_write_results_queue), for saves finished by a background process.
    Our saves are synchronous (`_write`): the results are put and taken in this process, so a
    thread-safe in-process queue does, with no manager process to start (a fresh interpreter,
    seconds on the first save) or to stop."""
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def _write(sharded_state_dict: dict, path: Path, content_metadata: dict) -> None:
    """Megatron's synchronous torch_dist save of everything (all ranks)."""
    _writer_results_queue()
    dist_checkpointing.save(sharded_state_dict, str(path), content_metadata=content_metadata)


_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _hashed_by(name: str, rank: int) -> bool:
    m = _RANK_FILE.match(name)
    return int(m.group(1)) == rank if m else rank == 0


def _any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (all ranks)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _write_manifest(path: Path, step: int) -> None:
    """Each rank hashes the shards it wrote (``__<rank>_<i>.distcp``), rank 0 the common files too;
    rank 0 writes the manifest (all ranks)."""
    rank = dist.get_rank()
    names = [n for n in manifest.data_files(path) if _hashed_by(n, rank)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, manifest.digest_files(path, names))
    _on_rank0(manifest.write_manifest, path, step, {k: v for part in gathered for k, v in part.items()})


def _no_space(error: BaseException, root: Path) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or "No space left" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    # torch's zip writer reports a short write as "unexpected pos ...": judge by what is left
    usage = shutil.disk_usage(root)
    return usage.free < max(16 << 20, usage.total // 1000)


def _save_failed(root: Path, tmp: Path, step: int, error: BaseException) -> CheckpointSaveError:
    """Rank 0: removes the partial save and says why it failed in one line (ENOSPC named)."""
    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.is_dir() else 0
    no_space = _no_space(error, root)
    free = shutil.disk_usage(root).free
    for attempt in range(3):  # a writer process of the failed save may still be closing its file
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            break
        time.sleep(0.5 * (attempt + 1))
    else:
        logger.warning("could not remove the partial save %s; the next save or load removes it", tmp)
    previous = directory.latest_step(root) if (root / directory.LATEST_FILE).exists() else None
    kept = f"the checkpoint of step {previous} is intact" if previous is not None else "no earlier checkpoint"
    why = (f"no space left on device (ENOSPC): {free / 2**20:.0f} MiB free on that file system, this save had "
           f"written {written / 2**20:.1f} MiB" if no_space else f"{type(error).__name__}: {error}")
    return CheckpointSaveError(f"saving the checkpoint of step {step} into {root} failed: {why}; its partial files "
                               f"were removed, {kept}")


# --- public API ---------------------------------------------------------------------------------

def save_checkpoint(
    ckpt_root: str | os.PathLike,
    step: int,
    model_chunks,
    optimizer=None,
    scheduler=None,
    extra_state: dict | None = None,
    *,
    keep_last: int | None = None,
    distributed_optimizer_format: str = "fully_reshardable",
    model_config: dict | None = None,
) -> Path:
    """Save a checkpoint of ``step`` atomically on all ranks; returns ``ckpt_root/iter_<step>``.

    Args:
        ckpt_root: checkpoint root, on a file system every rank sees.
        step: the training step just completed (the number ``load_checkpoint`` returns).
        model_chunks: this rank's model chunks (``build_model_chunks``), possibly
            wrapped in Megatron DDP / Float16Module.
        optimizer: a Megatron optimizer (``get_megatron_optimizer``), or None.
        scheduler: an ``OptimizerParamScheduler`` (anything with ``state_dict``), or None.
        extra_state: caller state to resume with (data position, buffer, ...); rank
            0's value is saved (pickled), other ranks may pass None.
        keep_last: afterwards keep only the checkpoints of the ``keep_last`` highest
            steps, and always this one (None: keep all).
        distributed_optimizer_format: one of ``DISTRIBUTED_OPTIMIZER_FORMATS``.
        model_config: the HF config dict of the model (e.g. ``hf_load.read_hf_config(hf_dir)``);
            rank 0's value is written as ``ckpt_root/model_config.json`` (atomically,
            before ``latest`` moves; ``read_model_config`` reads it), so the root alone
            says how to build the model (``entr-megatron score --model ckpt_root``).
            None: the file is left as it is.

    Writes into ``.tmp_iter_<step>``; rank 0 renames it into place and updates
    ``latest`` only after every rank has finished, so a crash leaves the last
    complete checkpoint untouched (stale temporaries are removed on the next
    save/load). An existing checkpoint of the same step is replaced.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None (keep all) or a positive int, got {keep_last!r}")
    if distributed_optimizer_format not in DISTRIBUTED_OPTIMIZER_FORMATS:
        raise ValueError(f"distributed_optimizer_format must be one of {DISTRIBUTED_OPTIMIZER_FORMATS}, "
                         f"got {distributed_optimizer_format!r}")
    chunks = _check_ready(model_chunks)
    root = Path(ckpt_root)
    # Common (rank-0) entries must agree on every rank: rank 0's extra state goes everywhere.
    extra = _on_rank0(pickle.dumps, extra_state)
    # Fail (on every rank) before writing anything when rank 0's model_config cannot be written.
    _on_rank0(_check_model_config, model_config)
    tmp = _on_rank0(directory.prepare_tmp_dir, root, step)

    metadata = state.sharding_metadata(optimizer, distributed_optimizer_format)
    sharded = state.model_sharded_state_dict(chunks, metadata)
    if optimizer is not None:
        prime_distributed_optimizer(optimizer)  # a save before the first step
        sharded[OPTIMIZER_KEY] = optimizer.sharded_state_dict(
            sharded, is_loading=False, metadata=state.with_groups(metadata, chunks))
    sharded[RNG_KEY] = state.rng_sharded_object(state.rng_state())
    sharded[INFO_KEY] = state.checkpoint_info(step, chunks, optimizer, scheduler, extra)
    error = None
    try:
        _write(sharded, tmp, metadata)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank learns of it below
        error = e  # (torch's CheckpointException, which aggregates the ranks' write errors, is a BaseException)
    if _any_rank(error is not None):  # all ranks agree before the next collective
        failure = None
        if dist.get_rank() == 0:  # one line (ENOSPC named), the partial save removed
            failure = _save_failed(root, tmp, step, error or CheckpointError("another rank failed"))
        dist.barrier()
        raise (failure or CheckpointSaveError(
            f"saving the checkpoint of step {step} into {root} failed"
            + (f" on rank {dist.get_rank()}: {type(error).__name__}: {error}" if error else " on another rank"))
        ) from error
    _write_manifest(tmp, step)
    _on_rank0(directory.write_model_config, root, model_config)
    final = _on_rank0(directory.commit, root, step, keep_last)
    if dist.get_rank() == 0:
        logger.info("saved checkpoint of step %d to %s", step, final)
    return final


def load_checkpoint(
    ckpt_root: str | os.PathLike,
    model_chunks,
    optimizer=None,
    scheduler=None,
    step: int | None = None,
    strict: bool = True,
    *,
    cleanup: bool = True,
    verify: bool = True,
) -> tuple[int, Any]:
    """Load a checkpoint into this rank's model (and optimizer, scheduler, RNG); returns ``(step, extra_state)``.

    Args:
        ckpt_root: the root passed to ``save_checkpoint``.
        model_chunks: this rank's model chunks, built for the current layout (any
            TP/PP/VPP/DP; Megatron reshards the saved tensors).
        optimizer: a Megatron optimizer to restore, or None to load weights only.
        scheduler: an ``OptimizerParamScheduler`` to restore, or None.
        step: the step to load; None loads the one ``latest`` names.
        strict: raise when the model and the checkpoint disagree on keys (naming
            them); False logs them and loads the rest. Shape mismatches always raise.
        cleanup: remove the leftovers of interrupted saves (rank 0, logged). Pass
            False when another job may be saving into ``ckpt_root`` right now (an
            evaluator reading a live run): its save in progress looks the same.
        verify: check every file against the checkpoint's manifest first (rank 0, one read of
            the checkpoint); with ``step=None`` a damaged or missing latest checkpoint is
            reported and the newest good older one loaded (``manifest.choose_checkpoint``).
            False: the caller verified it (``entr-megatron train`` does, before ranks start).

    RNG states are restored only in the saving layout (module docstring).
    Raises ``CheckpointNotFoundError`` when there is no such checkpoint (naming
    the path and what is there), ``CheckpointError`` for an incomplete checkpoint,
    a mismatched model, or state asked for that the checkpoint does not hold.
    """
    chunks = _check_ready(model_chunks)
    root = Path(ckpt_root)
    if cleanup:
        _on_rank0(directory.clean_stale, root)
    if verify:
        choice = _on_rank0(manifest.choose_checkpoint, root, step)
        if dist.get_rank() == 0:
            for name, problems in choice.skipped:
                logger.warning("skipping %s: %s", root / name, "; ".join(problems))
        step, path = choice.step, choice.path
    else:
        step, path = _on_rank0(directory.resolve_checkpoint_dir, root, step)
    common = dist_checkpointing.load_common_state_dict(str(path))
    info = common.get(INFO_KEY)
    check_format(path, info)
    layout = state.layout(chunks)
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    check_loadable(path, info, layout, metadata, optimizer, scheduler)

    same_layout = layout == info["layout"]  # None: written by `convert`, no RNG streams
    if "distrib_optim_fully_reshardable_mem_efficient" in metadata:  # interchangeable on load (Megatron)
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = not torch.cuda.is_available()
    sharded = state.model_sharded_state_dict(chunks, metadata)
    if optimizer is not None:
        prime_distributed_optimizer(optimizer)
        sharded[OPTIMIZER_KEY] = optimizer.sharded_state_dict(
            sharded, is_loading=True, metadata=state.with_groups(metadata, chunks))
    if same_layout:
        sharded[RNG_KEY] = state.rng_sharded_object(state.rng_state())
    elif dist.get_rank() == 0 and info["layout"] is not None:
        logger.warning("checkpoint %s was saved in layout %s, loading into %s: RNG states are not restored "
                       "(current ones kept)", path, info["layout"], layout)

    model_keys = state.chunk_keys(len(chunks))
    check_model_matches(path, {k: sharded[k] for k in model_keys}, strict)
    # Keys only the model has were reported above; non-strict, Megatron leaves them out of the load.
    loaded = dist_checkpointing.load(
        sharded, str(path), strict=StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.RETURN_UNEXPECTED)
    if not strict:
        loaded = loaded[0]

    for key, chunk in zip(model_keys, chunks):
        chunk.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded[OPTIMIZER_KEY])
    if scheduler is not None:
        scheduler.load_state_dict(info["scheduler"])
    if same_layout:
        state.set_rng_state(loaded[RNG_KEY])
    if dist.get_rank() == 0:
        logger.info("loaded checkpoint of step %d from %s", step, path)
    return step, pickle.loads(info["extra_state"])

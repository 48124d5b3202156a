"""Learner checkpoints: Megatron dist checkpointing (torch_dist) of model, optimizer, scheduler, RNG and step.

    save_checkpoint(root, step, chunks, optimizer, scheduler, extra_state={"data_pos": 17})
    ...                                   # a later run, possibly with another TP/PP layout
    step, extra = load_checkpoint(root, chunks, optimizer, scheduler)

What a checkpoint holds (``root/iter_<step>/``, see ``checkpoint_dir`` for the
directory protocol that makes a save atomic):

==============  =======================================================================
model           every chunk's ``sharded_state_dict`` (all virtual pipeline stages): global
                tensors cut into shards, so a load reshards to any TP / PP / VPP / EP / DP
optimizer       Megatron's optimizer ``sharded_state_dict``; the distributed optimizer in
                the ``fully_reshardable`` format by default (model-space tensors, so it
                reshards too). Adam's step, param-group hyper-parameters, main params
scheduler       ``OptimizerParamScheduler.state_dict()``
rng             per rank: python ``random``, numpy, torch CPU, CUDA (when present) and
                Megatron's model-parallel RNG tracker states (a ``ShardedObject``
                indexed by global rank)
step, extra     the step and the caller's ``extra_state`` (rank 0's; anything picklable:
                data position, replay buffer, ...), returned by ``load_checkpoint``
layout          world size and TP/PP/VPP/CP/EP/expert-TP sizes of the saving run
==============  =======================================================================

With ``model_config=`` (the HF config dict) the root also holds ``model_config.json``
(``read_model_config``): the model the checkpoints belong to, so a tool can build it
from the root alone (``entr-megatron score --model ckpt_root``).

RNG across layouts: the RNG streams are per rank and only mean something in the
layout that produced them, so they are restored only when the loading layout
(world size and every parallel size) equals the saved one. Otherwise the
current states, i.e. those ``initialize_model_parallel(seed=...)`` set, are
kept and a line is logged: weights, optimizer and scheduler resume exactly,
dropout masks from then on differ from the uninterrupted run's.

Resume is bit-identical on CPU in the same layout: weights, optimizer state,
Adam's step, the LR schedule and every RNG stream continue where they were.

Saving runs Megatron's torch_dist writer, which imports ``psutil`` and starts a
spawn ``multiprocessing`` Manager: a script that saves needs an
``if __name__ == "__main__":`` guard (without one the save hangs). The first
save of a process pays that start-up (~10 s on 2 CPU cores), later ones ~1 s
for a small model.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.tensor_parallel import random as mp_random
from megatron.core.utils import unwrap_model

from entr_megatron.learner import checkpoint_dir
from entr_megatron.learner.checkpoint_dir import (
    CheckpointError,
    CheckpointNotFoundError,
    latest_step,
    read_model_config,
)
from entr_megatron.learner.compat import enable_cpu_compat

__all__ = [
    "DISTRIBUTED_OPTIMIZER_FORMATS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "latest_step",
    "load_checkpoint",
    "read_model_config",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

# Bumped when what this module writes changes incompatibly.
FORMAT_VERSION = 1
# How the distributed optimizer's flat shards are stored (Megatron's names):
# "fully_reshardable" gathers them to model-shaped tensors on DP rank 0 (loads into
# any TP/PP/DP); "dp_reshardable" writes each rank's flat buffers in parallel
# (faster at scale, but only the DP size may change).
DISTRIBUTED_OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
_RNG_KEY = "rng_state"
_OPTIMIZER_KEY_PREFIX = "optimizer."


# --- what is saved ----------------------------------------------------------------------------

def _chunk_keys(n: int) -> list[str]:
    # Megatron-LM's names: "model" for one chunk, "model0", "model1", ... with virtual stages.
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _layout(chunks) -> dict[str, Any]:
    cfg = chunks[0].config
    return dict(
        world_size=dist.get_world_size(),
        tp=cfg.tensor_model_parallel_size,
        pp=cfg.pipeline_model_parallel_size,
        vpp=cfg.virtual_pipeline_model_parallel_size,
        cp=cfg.context_parallel_size,
        ep=cfg.expert_model_parallel_size,
        expert_tp=cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size,
    )


def _sharding_metadata(optimizer, distributed_optimizer_format: str) -> dict[str, Any]:
    """Megatron's ``metadata`` for ``sharded_state_dict`` (stored in the checkpoint; a load reuses it)."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None and _uses_distributed_optimizer(optimizer):
        metadata["distrib_optim_sharding_type"] = distributed_optimizer_format
        # The default all-gathers with a device tensor (`.cuda()`); the memory-efficient
        # variant gathers on CPU over gloo, which is the only way on a CPU machine.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = not torch.cuda.is_available()
    return metadata


def _parts(optimizer) -> list:
    from megatron.core.optimizer import ChainedOptimizer

    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import DistributedOptimizer

    return any(isinstance(p, DistributedOptimizer) for p in _parts(optimizer))


def _prime_distributed_optimizer(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet torch Adam's initial state.

    Without Apex/TransformerEngine, ``DistributedOptimizer.state_dict`` (called by
    ``sharded_state_dict`` to save or load) reads every param state's ``step``,
    which torch Adam creates only at its first step. The state added is exactly
    what that first step would create (zero moments, step 0).
    """
    from megatron.core.optimizer import DistributedOptimizer, distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
        return  # FusedAdam keeps its step in the param groups: nothing to prime
    for part in _parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if (not isinstance(part, DistributedOptimizer) or not isinstance(inner, torch.optim.Optimizer)
                or len(inner.state)):
            continue
        if part.init_state_fn is None:
            raise CheckpointError(f"cannot checkpoint a {type(inner).__name__} distributed optimizer before its "
                                  "first step without TransformerEngine/Apex (Megatron supports Adam there)")
        part.init_state_fn(inner, part.config)
        for state in inner.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))


def _load_optimizer(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict`` with two fixes for torch Adam inside Megatron's distributed optimizer.

    On the path without Apex/TransformerEngine (megatron-core 0.16.1):
    1. ``DistributedOptimizer.load_state_dict`` first puts the saved ``step`` (kept
       in the param groups) into every param state, then copies the checkpoint's
       tensors over every key of that state: the model-space formats have no
       ``step`` (KeyError), ``dp_reshardable`` hands back the state's step from
       before the load (resetting Adam's step to 0). Here ``step`` is always the
       one taken from the param groups.
    2. That ``step`` is ONE tensor shared by all param states, and torch Adam
       increments each param's step in place: it would advance once per parameter
       per step. Each state gets its own copy afterwards.
    Both are no-ops where the optimizer keeps no per-param ``step`` (TE/Apex FusedAdam).
    """
    from megatron.core.optimizer import DistributedOptimizer

    patched = []
    for part in _parts(optimizer):
        if isinstance(part, DistributedOptimizer) and getattr(part, "optimizer", None) is not None:
            part._set_main_param_and_optimizer_states = _keep_step(part)
            patched.append(part)
    try:
        with torch.no_grad():  # the dp_reshardable loader copies into views of the (fp32) params without it
            optimizer.load_state_dict(state_dict)
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states  # back to the class's method
    for part in _parts(optimizer):
        inner = getattr(part, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _keep_step(part):
    upstream = part._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(model_param, tensors):
        group_index, group_order = part.model_param_group_index_map[model_param]
        main_param = part.optimizer.param_groups[group_index]["params"][group_order]
        step = part.optimizer.state[main_param].get("step")
        if step is not None:  # keep the step load_state_dict took from the param groups
            tensors = {**tensors, "step": step}
        return upstream(model_param, tensors)

    return set_main_param_and_optimizer_states


def _with_groups(metadata: dict, chunks) -> dict:
    """A copy of ``metadata`` with the data-parallel group the model was built with (not serialised)."""
    metadata = dict(metadata)
    pgs = getattr(chunks[0], "pg_collection", None)
    if pgs is not None and hasattr(pgs, "dp_cp"):
        metadata["dp_cp_group"] = pgs.dp_cp
    return metadata


def _model_sharded_state_dict(chunks, metadata: dict) -> dict:
    return {key: chunk.sharded_state_dict(metadata=_with_groups(metadata, chunks))
            for key, chunk in zip(_chunk_keys(len(chunks)), chunks)}


def _rng_state() -> dict[str, Any]:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        # On CPU (compat), the tracker's states are CPU generator states.
        "tracker": mp_random.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    mp_random.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state) -> ShardedObject:
    # One object per global rank: DP ranks' streams may differ too (data order, sampling).
    return ShardedObject(_RNG_KEY, state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


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
        checkpoint_dir.model_config_text(config)  # raises CheckpointError when it cannot be written


def _check_ready(chunks) -> list:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: checkpoints are written and read by all ranks")
    enable_cpu_compat()
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if not chunks:
        raise ValueError("model_chunks is empty")
    return unwrap_model(chunks)


def _write(sharded_state_dict: dict, directory: Path, content_metadata: dict) -> None:
    """Megatron's synchronous torch_dist save of everything (all ranks)."""
    dist_checkpointing.save(sharded_state_dict, str(directory), content_metadata=content_metadata)


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
    tmp = _on_rank0(checkpoint_dir.prepare_tmp_dir, root, step)

    metadata = _sharding_metadata(optimizer, distributed_optimizer_format)
    state = _model_sharded_state_dict(chunks, metadata)
    if optimizer is not None:
        _prime_distributed_optimizer(optimizer)  # a save before the first step
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=False, metadata=_with_groups(metadata, chunks))
    state[_RNG_KEY] = _rng_sharded_object(_rng_state())
    state["entr"] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": _layout(chunks),
        "num_chunks": len(chunks),
        "has_optimizer": optimizer is not None,
        "distributed_optimizer": optimizer is not None and _uses_distributed_optimizer(optimizer),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra_state": extra,
    }
    _write(state, tmp, metadata)
    _on_rank0(checkpoint_dir.write_model_config, root, model_config)
    final = _on_rank0(checkpoint_dir.commit, root, step, keep_last)
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

    RNG states are restored only in the saving layout (module docstring).
    Raises ``CheckpointNotFoundError`` when there is no such checkpoint (naming
    the path and what is there), ``CheckpointError`` for an incomplete checkpoint,
    a mismatched model, or state asked for that the checkpoint does not hold.
    """
    chunks = _check_ready(model_chunks)
    root = Path(ckpt_root)
    if cleanup:
        _on_rank0(checkpoint_dir.clean_stale, root)
    step, path = _on_rank0(checkpoint_dir.resolve_checkpoint_dir, root, step)
    common = dist_checkpointing.load_common_state_dict(str(path))
    info = common.get("entr")
    if info is None or info.get("format_version") != FORMAT_VERSION:
        found = None if info is None else info.get("format_version")
        raise CheckpointError(f"{path} is not an entr_megatron learner checkpoint of format {FORMAT_VERSION} "
                              f"(found format {found})")
    if optimizer is not None and not info["has_optimizer"]:
        raise CheckpointError(f"{path} holds no optimizer state: pass optimizer=None to load the weights only")
    if optimizer is not None and _uses_distributed_optimizer(optimizer) != info["distributed_optimizer"]:
        saved = "a distributed" if info["distributed_optimizer"] else "a non-distributed"
        raise CheckpointError(
            f"{path} holds the state of {saved} optimizer, which Megatron cannot load into this one: build the "
            f"optimizer with use_distributed_optimizer={info['distributed_optimizer']}, or pass optimizer=None "
            "to load the weights only")
    layout = _layout(chunks)
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    model_parallel = {k: v for k, v in layout.items() if k != "world_size"}
    if (optimizer is not None and metadata.get("distrib_optim_sharding_type") == "dp_reshardable"
            and model_parallel != {k: v for k, v in info["layout"].items() if k != "world_size"}):
        raise CheckpointError(
            f"{path} stores the distributed optimizer as 'dp_reshardable', which loads only where the model "
            f"parallel sizes are the saved ones ({info['layout']}; here {layout}): load it in that layout, or "
            "pass optimizer=None to load the weights only")
    if scheduler is not None and info["scheduler"] is None:
        raise CheckpointError(f"{path} holds no scheduler state: pass scheduler=None")

    same_layout = layout == info["layout"]
    if "distrib_optim_fully_reshardable_mem_efficient" in metadata:  # interchangeable on load (Megatron)
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = not torch.cuda.is_available()
    state = _model_sharded_state_dict(chunks, metadata)
    if optimizer is not None:
        _prime_distributed_optimizer(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True, metadata=_with_groups(metadata, chunks))
    if same_layout:
        state[_RNG_KEY] = _rng_sharded_object(_rng_state())
    elif dist.get_rank() == 0:
        logger.warning("checkpoint %s was saved in layout %s, loading into %s: RNG states are not restored "
                       "(current ones kept)", path, info["layout"], layout)

    _check_model_matches(path, {k: state[k] for k in _chunk_keys(len(chunks))}, strict)
    # Keys only the model has were reported above; non-strict, Megatron leaves them out of the load.
    loaded = dist_checkpointing.load(
        state, str(path), strict=StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.RETURN_UNEXPECTED)
    if not strict:
        loaded = loaded[0]

    for key, chunk in zip(_chunk_keys(len(chunks)), chunks):
        chunk.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(info["scheduler"])
    if same_layout:
        _set_rng_state(loaded[_RNG_KEY])
    if dist.get_rank() == 0:
        logger.info("loaded checkpoint of step %d from %s", step, path)
    return step, pickle.loads(info["extra_state"])


def _check_model_matches(path: Path, model_state: dict, strict: bool) -> None:
    """Compare the model's sharded keys and global shapes with the checkpoint's (collective).

    Raises ``CheckpointError`` naming the keys: always for a shape mismatch (no
    way to load those), and with ``strict`` for keys only one side has; otherwise
    logs them. Megatron stacks the layers of a block into one tensor per weight
    (``decoder.layers.<name>`` of shape ``[num_layers, ...]``), so a different
    layer count shows up as a shape mismatch.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    wanted: dict[str, tuple | None] = {}
    for value in nested_values(model_state):
        for sh in nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]:
            if isinstance(sh, ShardedObject) or hasattr(sh, "global_shape"):
                # None: any shape (Megatron pads or trims the vocabulary of embeddings and output layer).
                wanted[sh.key] = None if getattr(sh, "allow_shape_mismatch", False) else tuple(sh.global_shape)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted)
    for part in everyone:
        wanted.update(part)
    saved = {}
    for key, sh in load_sharded_metadata(str(path)).items():
        key = key.split("/shard_")[0]  # ShardedObjects are stored once per shard
        if not key.startswith(_OPTIMIZER_KEY_PREFIX) and key != _RNG_KEY:
            saved[key] = tuple(sh.global_shape)
    absent = sorted(set(wanted) - set(saved))
    unused = sorted(set(saved) - set(wanted))
    shapes = sorted(f"{k} (checkpoint {list(saved[k])}, model {list(wanted[k])})"
                    for k in set(wanted) & set(saved) if wanted[k] is not None and wanted[k] != saved[k])
    if not (absent or unused or shapes):
        return
    parts = []
    if shapes:
        parts.append(f"global shapes differ: {_names(shapes)}")
    if absent:
        parts.append(f"the model has keys the checkpoint lacks: {_names(absent)}")
    if unused:
        parts.append(f"the checkpoint has keys the model lacks: {_names(unused)}")
    message = f"model does not match checkpoint {path}: " + "; ".join(parts)
    if strict or shapes:
        raise CheckpointError(message + " (a different architecture or config?)")
    logger.warning(message + " (strict=False: loading the rest)")


def _names(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")

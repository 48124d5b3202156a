"""What a learner checkpoint holds, as the sharded state dict Megatron's dist checkpointing saves and loads.

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
layout          world size and TP/PP/VPP/CP/EP/expert-TP sizes of the saving run (None in a
                checkpoint `convert hf-to-megatron` wrote: weights only, no ranks, no RNG)
==============  =======================================================================

Scheduler, step, extra state and layout form the common (rank-0) ``INFO_KEY``
record (``checkpoint_info``); the RNG streams are per rank and only mean
something in the layout that produced them (``checkpoint.io`` restores them only
there).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer
from megatron.core.tensor_parallel import random as mp_random

__all__ = [
    "DISTRIBUTED_OPTIMIZER_FORMATS",
    "FORMAT_VERSION",
    "INFO_KEY",
    "OPTIMIZER_KEY",
    "OPTIMIZER_KEY_PREFIX",
    "RNG_KEY",
    "checkpoint_info",
    "chunk_keys",
    "layout",
    "model_sharded_state_dict",
    "optimizer_parts",
    "rng_sharded_object",
    "rng_state",
    "set_rng_state",
    "sharding_metadata",
    "uses_distributed_optimizer",
    "with_groups",
]

# Bumped when what this package writes changes incompatibly.
FORMAT_VERSION = 1
# How the distributed optimizer's flat shards are stored (Megatron's names):
# "fully_reshardable" gathers them to model-shaped tensors on DP rank 0 (loads into
# any TP/PP/DP); "dp_reshardable" writes each rank's flat buffers in parallel
# (faster at scale, but only the DP size may change).
DISTRIBUTED_OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
RNG_KEY = "rng_state"
OPTIMIZER_KEY = "optimizer"
# Megatron prefixes the optimizer's sharded keys with this (the model's are not).
OPTIMIZER_KEY_PREFIX = OPTIMIZER_KEY + "."
INFO_KEY = "entr"


def chunk_keys(n: int) -> list[str]:
    """The state-dict keys of ``n`` model chunks: Megatron-LM's ``model``, or ``model0``, ``model1``, ... (VPP)."""
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def layout(chunks) -> dict[str, Any]:
    """World size and parallel sizes of the run that holds ``chunks`` (saved, and compared on load)."""
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


def optimizer_parts(optimizer) -> list:
    """The optimizers inside a Megatron ``ChainedOptimizer``, or ``[optimizer]``."""
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def uses_distributed_optimizer(optimizer) -> bool:
    """Whether any part of ``optimizer`` is Megatron's ``DistributedOptimizer``."""
    return any(isinstance(p, DistributedOptimizer) for p in optimizer_parts(optimizer))


def sharding_metadata(optimizer, distributed_optimizer_format: str) -> dict[str, Any]:
    """Megatron's ``metadata`` for ``sharded_state_dict`` (stored in the checkpoint; a load reuses it)."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer is not None and uses_distributed_optimizer(optimizer):
        metadata["distrib_optim_sharding_type"] = distributed_optimizer_format
        # The default all-gathers with a device tensor (`.cuda()`); the memory-efficient
        # variant gathers on CPU over gloo, which is the only way on a CPU machine.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = not torch.cuda.is_available()
    return metadata


def with_groups(metadata: dict, chunks) -> dict:
    """A copy of ``metadata`` with the data-parallel group the model was built with (not serialised)."""
    metadata = dict(metadata)
    pgs = getattr(chunks[0], "pg_collection", None)
    if pgs is not None and hasattr(pgs, "dp_cp"):
        metadata["dp_cp_group"] = pgs.dp_cp
    return metadata


def model_sharded_state_dict(chunks, metadata: dict) -> dict:
    """``{chunk key: chunk.sharded_state_dict(...)}`` for every model chunk of this rank."""
    return {key: chunk.sharded_state_dict(metadata=with_groups(metadata, chunks))
            for key, chunk in zip(chunk_keys(len(chunks)), chunks)}


def checkpoint_info(step: int, chunks, optimizer, scheduler, extra_state: bytes) -> dict[str, Any]:
    """The common (rank-0) record of a checkpoint: format, step, layout, what it holds, scheduler, extra state.

    ``extra_state`` is already pickled (rank 0's bytes, the same on every rank).
    """
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": layout(chunks),
        "num_chunks": len(chunks),
        "has_optimizer": optimizer is not None,
        "distributed_optimizer": optimizer is not None and uses_distributed_optimizer(optimizer),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra_state": extra_state,
    }


def rng_state() -> dict[str, Any]:
    """This rank's RNG streams: python, numpy, torch CPU, CUDA (when present), Megatron's tracker."""
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        # On CPU (parallel.cpu_compat), the tracker's states are CPU generator states.
        "tracker": mp_random.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the streams ``rng_state`` captured (CUDA's only where CUDA is present)."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    mp_random.get_cuda_rng_tracker().set_states(state["tracker"])


def rng_sharded_object(state) -> ShardedObject:
    """``state`` as this rank's entry of the RNG ``ShardedObject`` (indexed by global rank)."""
    # One object per global rank: DP ranks' streams may differ too (data order, sampling).
    return ShardedObject(RNG_KEY, state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)

"""Whether a saved checkpoint can be loaded as asked, with errors that name what does not match.

``check_format`` and ``check_loadable`` read the checkpoint's common record
(``state.checkpoint_info``) against the caller's request; ``check_model_matches``
compares the model's sharded keys and global shapes with those in the
checkpoint's metadata (a collective). Every refusal is a ``CheckpointError``
saying where and what to do instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from entr_megatron.checkpoint.directory import CheckpointError
from entr_megatron.checkpoint.state import FORMAT_VERSION, OPTIMIZER_KEY_PREFIX, RNG_KEY, uses_distributed_optimizer

__all__ = ["check_format", "check_loadable", "check_model_matches"]

logger = logging.getLogger(__name__)


def check_format(path: Path, info: dict | None) -> None:
    """Raise ``CheckpointError`` unless ``info`` (the common record) is of this package's ``FORMAT_VERSION``."""
    if info is None or info.get("format_version") != FORMAT_VERSION:
        found = None if info is None else info.get("format_version")
        raise CheckpointError(f"{path} is not an entr_megatron learner checkpoint of format {FORMAT_VERSION} "
                              f"(found format {found})")


def check_loadable(path: Path, info: dict, layout: dict[str, Any], metadata: dict, optimizer, scheduler) -> None:
    """Raise ``CheckpointError`` when the checkpoint lacks state asked for or Megatron cannot load it here.

    Args:
        path: the checkpoint directory (for the messages).
        info: its common record (``state.checkpoint_info``).
        layout: the loading run's ``state.layout``.
        metadata: the sharding metadata the checkpoint was saved with.
        optimizer / scheduler: what the caller wants restored (None: not asked for).
    """
    if optimizer is not None and not info["has_optimizer"]:
        raise CheckpointError(f"{path} holds no optimizer state: pass optimizer=None to load the weights only")
    if optimizer is not None and uses_distributed_optimizer(optimizer) != info["distributed_optimizer"]:
        saved = "a distributed" if info["distributed_optimizer"] else "a non-distributed"
        raise CheckpointError(
            f"{path} holds the state of {saved} optimizer, which Megatron cannot load into this one: build the "
            f"optimizer with use_distributed_optimizer={info['distributed_optimizer']}, or pass optimizer=None "
            "to load the weights only")
    model_parallel = {k: v for k, v in layout.items() if k != "world_size"}
    if (optimizer is not None and metadata.get("distrib_optim_sharding_type") == "dp_reshardable"
            and model_parallel != {k: v for k, v in info["layout"].items() if k != "world_size"}):
        raise CheckpointError(
            f"{path} stores the distributed optimizer as 'dp_reshardable', which loads only where the model "
            f"parallel sizes are the saved ones ({info['layout']}; here {layout}): load it in that layout, or "
            "pass optimizer=None to load the weights only")
    if scheduler is not None and info["scheduler"] is None:
        raise CheckpointError(f"{path} holds no scheduler state: pass scheduler=None")


def check_model_matches(path: Path, model_state: dict, strict: bool) -> None:
    """Compare the model's sharded keys and global shapes with the checkpoint's (collective).

    Raises ``CheckpointError`` naming the keys: always for a shape mismatch (no
    way to load those), and with ``strict`` for keys only one side has; otherwise
    logs them. Megatron stacks the layers of a block into one tensor per weight
    (``decoder.layers.<name>`` of shape ``[num_layers, ...]``), so a different
    layer count shows up as a shape mismatch.
    """
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
        if not key.startswith(OPTIMIZER_KEY_PREFIX) and key != RNG_KEY:
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

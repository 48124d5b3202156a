"""The one driver of Megatron's pipeline schedules, for training, scoring and `convert --verify`.

    stored = run_pipeline(chunks, items, forward_step, groups, forward_only=True, seq_length=T)

`forward_step(item, model)` runs one micro-batch through one model chunk and returns
`(output, loss_func)` as Megatron's schedules expect; each model chunk (virtual stage) walks the
items on an iterator of its own; stages exchange activations through a `P2PCommunicator` on the
pipeline group the caller's `ParallelGroups` holds (never Megatron's global state), and the
schedule gets the same `pg_collection`. What the last stage's loss functions returned comes back
(a list per micro-batch there; an empty list on other stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config

__all__ = ["run_pipeline"]


def run_pipeline(model_chunks: Sequence[Any], items: Sequence[Any], forward_step: Callable[[Any, Any], tuple],
                 groups, *, forward_only: bool, seq_length: int) -> list:
    """Megatron's forward (and, unless `forward_only`, backward) schedule over `items`, one
    micro-batch each: no pipelining, 1F1B, or interleaved 1F1B as the layout asks.

    seq_length: the p2p buffers' length when every micro-batch has it (ignored when the model
    config has `variable_seq_lengths`: the stages then exchange each shape first)."""
    chunks = list(model_chunks)
    config = get_model_config(chunks[0])

    def step(data_iterator, model):
        return forward_step(next(data_iterator), model)

    iterators = [iter(list(items)) for _ in chunks]
    p2p = P2PCommunicator(pp_group=groups.pp, config=config) if groups.pp_size > 1 else None
    fwd_bwd = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size)
    return fwd_bwd(
        forward_step_func=step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(items),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
        p2p_communicator=p2p,
        pg_collection=groups.pg_collection,
    )

"""The pieces of one RL training step and of the log-prob-only forward (`RLTrainer`, trainer.py,
puts them together): packed micro-batches and Megatron's pipeline schedules.

    TrainBatch (this DP rank's sequences)
      -> packed micro-batches (batching.py; counts and lengths agreed over DP)
      -> run_pipeline (schedule.py): Megatron's schedule (no pipelining, 1F1B, or interleaved 1F1B)
           first stage: embeddings ... last stage: vocab-sharded logits
           -> loss_func (loss.py): vocab-parallel log-prob + entropy -> compute_policy_loss
      -> finalize_model_grads: DP sum, SP/qk-norm/embedding reductions, / global count
      -> optimizer_step (optimizer.py): skip if the norm is not finite, clip, Adam, LR schedule

Every rank of a data-parallel replica must pass the same batch (the first stage
reads the tokens, the last the targets and rollout data). The micro-batch count
is the maximum over data-parallel ranks (padding-only micro-batches fill the
rest; a multiple of the PP size with interleaving) because expert-parallel
all-to-alls span data-parallel ranks and must run in lockstep; with EP the
micro-batch lengths are equalised too (Megatron's allgather dispatcher needs it).
Pipeline stages exchange each micro-batch's shape first (``variable_seq_lengths``),
except with interleaving, where all micro-batches are padded to one length
(``_needs_fixed_length`` says why).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from entr_megatron.config.learner import LearnerConfig
from entr_megatron.learner.batching import (
    MicroBatch,
    build_microbatch,
    padded_length,
    plan_microbatches,
)
from entr_megatron.learner.fused_output import fused_output_weight
from entr_megatron.learner.routing_replay import ReplayStep
from entr_megatron.learner.schedule import run_pipeline
from entr_megatron.types import TrainBatch

__all__ = ["check_layout", "current_device", "from_last_stage", "microbatches_for_step", "prepare_config", "required_pad_multiple",
           "run_schedule"]


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _all_reduce_max(values: list[int], group, size: int) -> list[int]:
    if size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.long, device=current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# --- micro-batches ------------------------------------------------------------------------------

def required_pad_multiple(config, groups) -> int:
    """Packed length multiple the layout needs: sequence parallelism splits T over TP ranks."""
    return groups.tp_size if config.sequence_parallel else 1


def microbatches_for_step(batch: TrainBatch, groups, learner_cfg: LearnerConfig, config) -> list[MicroBatch]:
    """This rank's packed micro-batches, with the count (and, under EP, the lengths) agreed over DP.

    A collective over ``groups.dp``: every rank of the data-parallel group must call it.
    """
    pad = required_pad_multiple(config, groups)
    plan = plan_microbatches(batch.seq_lens.tolist(), learner_cfg.max_tokens_per_microbatch, pad)
    count = _all_reduce_max([len(plan)], groups.dp, groups.dp_size)[0]
    if groups.vpp_size is not None:
        # The interleaved schedule needs a multiple of the PP size (microbatch groups per VP stage).
        count = -(-count // groups.pp_size) * groups.pp_size
    plan += [[] for _ in range(count - len(plan))]
    lens = batch.seq_lens.tolist()
    lengths = [padded_length(sum(lens[i] for i in seqs), pad) for seqs in plan]
    if groups.ep_size > 1:
        lengths = _all_reduce_max(lengths, groups.dp, groups.dp_size)
    if _needs_fixed_length(groups):
        lengths = [max(lengths)] * len(lengths)
    return [build_microbatch(batch, seqs, pad, length) for seqs, length in zip(plan, lengths)]


def _needs_fixed_length(groups) -> bool:
    """Whether every micro-batch must have the same length: the interleaved schedule.

    With variable lengths the stages first exchange shapes, always with
    ``batch_isend_irecv`` (``p2p_communication._communicate_shapes``). In the interleaved
    schedule one call sends both ways; at PP=2 both neighbours are the same rank, and
    messages matched in posting order (gloo) swap the activation and gradient shapes:
    the run deadlocks. Equal lengths need no shape exchange.
    """
    return groups.vpp_size is not None


def _on_device(mb: MicroBatch, device: torch.device) -> tuple[Tensor, Tensor, PackedSeqParams]:
    p = mb.packed_seq_params
    cu = p.cu_seqlens_q.to(device)
    packed = PackedSeqParams(qkv_format=p.qkv_format, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv)
    return mb.tokens.to(device), mb.position_ids.to(device), packed


def run_schedule(model_chunks, micro: list[MicroBatch], groups, make_loss, forward_only: bool,
                  replay: ReplayStep | None = None) -> list:
    """Megatron's forward-backward over ``micro`` (schedule.run_pipeline); ``make_loss(index, mb)``
    gives each loss_func; ``replay`` sets (and reads back) each forward's MoE routes."""
    device = current_device()

    def forward_step(item, model):
        index, mb = item
        tokens, positions, packed = _on_device(mb, device)
        if replay is not None:
            replay.before_forward(model, mb)
        # attention_mask=None: causality and sequence boundaries come from the thd packing.
        output = model(tokens, positions, None, packed_seq_params=packed)
        if replay is not None:
            replay.after_forward(model, mb)
        loss, weight = make_loss(index, mb), fused_output_weight(model)
        # the fused output layer returned hidden states: the loss multiplies them by its weight
        return output, (loss if weight is None else partial(loss, output_weight=weight))

    # Shapes the p2p buffers when lengths are fixed (all equal then); ignored otherwise.
    return run_pipeline(model_chunks, list(enumerate(micro)), forward_step, groups, forward_only=forward_only,
                        seq_length=max(mb.length for mb in micro))


def check_layout(groups) -> None:
    if groups.cp_size > 1:
        # Each CP rank would count the same sequences (seq-mean counts x cp) and thd packing under
        # CP needs every sequence padded to a multiple of 2 * cp: not implemented yet.
        raise ValueError(f"context parallel size {groups.cp_size}: the learner's packed micro-batches need cp=1")


def prepare_config(config, groups) -> None:
    # Packed micro-batches differ in length: pipeline stages exchange shapes before activations
    # (except under interleaving, where all micro-batches get one length: _needs_fixed_length).
    config.variable_seq_lengths = groups.pp_size > 1 and not _needs_fixed_length(groups)


# --- metrics ----------------------------------------------------------------------------------------

def from_last_stage(metrics: dict, groups) -> dict:
    """The last pipeline stage's metrics on every stage of the pipeline."""
    if groups.pp_size == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return box[0]

"""One RL training step, and the log-prob-only forward, through Megatron's pipeline schedules.

    TrainBatch (this DP rank's sequences)
      -> packed micro-batches (batching.py; counts and lengths agreed over DP)
      -> get_forward_backward_func()  (no pipelining, 1F1B, or interleaved 1F1B)
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

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config
from torch import Tensor

from entr_megatron.algorithm.metrics import MetricStats, finalize_mismatch_metrics, mismatch_metric_stats
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.learner.batching import (
    MicroBatch,
    build_microbatch,
    padded_length,
    plan_microbatches,
)
from entr_megatron.learner.fused_output import fused_output_weight
from entr_megatron.learner.loss import make_logprob_loss_func, make_policy_loss_func
from entr_megatron.learner.loss_report import LossReport
from entr_megatron.learner.optimizer import check_training_config, optimizer_step
from entr_megatron.learner.routing_replay import ReplayStep
from entr_megatron.types import TrainBatch

__all__ = ["compute_logprobs", "microbatches_for_step", "required_pad_multiple", "train_step", "unreplayed_mismatch"]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _all_reduce_max(values: list[int], group, size: int) -> list[int]:
    if size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.long, device=_device())
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


def _run_schedule(model_chunks, micro: list[MicroBatch], groups, make_loss, forward_only: bool,
                  replay: ReplayStep | None = None) -> list:
    """Megatron's forward-backward over ``micro``; ``make_loss(index, mb)`` gives each loss_func;
    ``replay`` sets (and reads back) each forward's MoE routes."""
    config = get_model_config(model_chunks[0])
    device = _device()

    def forward_step(data_iterator, model):
        index, mb = next(data_iterator)
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

    # One iterator per model chunk: each virtual stage walks the micro-batches on its own.
    iterators = [iter(list(enumerate(micro))) for _ in model_chunks]
    p2p = P2PCommunicator(pp_group=groups.pp, config=config) if groups.pp_size > 1 else None
    fwd_bwd = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size)
    return fwd_bwd(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=len(micro),
        # Shapes the p2p buffers when lengths are fixed (all equal then); ignored otherwise.
        seq_length=max(mb.length for mb in micro),
        micro_batch_size=1,
        forward_only=forward_only,
        p2p_communicator=p2p,
        pg_collection=groups.pg_collection,
    )


def _check_layout(groups) -> None:
    if groups.cp_size > 1:
        # Each CP rank would count the same sequences (seq-mean counts x cp) and thd packing under
        # CP needs every sequence padded to a multiple of 2 * cp: not implemented yet.
        raise ValueError(f"context parallel size {groups.cp_size}: the learner's packed micro-batches need cp=1")


def _prepare_config(config, groups) -> None:
    # Packed micro-batches differ in length: pipeline stages exchange shapes before activations
    # (except under interleaving, where all micro-batches get one length: _needs_fixed_length).
    config.variable_seq_lengths = groups.pp_size > 1 and not _needs_fixed_length(groups)


# --- metrics ----------------------------------------------------------------------------------------

def _from_last_stage(metrics: dict, groups) -> dict:
    """The last pipeline stage's metrics on every stage of the pipeline."""
    if groups.pp_size == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return box[0]


# --- public API ---------------------------------------------------------------------------------------

def train_step(model_chunks: list[DistributedDataParallel], optimizer, scheduler, batch: TrainBatch, groups,
               algo_cfg: AlgorithmConfig, learner_cfg: LearnerConfig, *, vocab_size: int | None = None,
               temperature: float = 1.0, old_logprobs: Tensor | None = None,
               before_update: Callable[[], object] | None = None) -> dict[str, float]:
    """One optimizer step of the RL loss on ``batch`` (this data-parallel rank's sequences).

    Args:
        model_chunks: this rank's model chunks wrapped by ``optimizer.wrap_model_chunks``
            (one per virtual pipeline stage).
        optimizer, scheduler: from ``optimizer.build_optimizer``.
        batch: this DP rank's share of the global batch (``batching.split_for_data_parallel``),
            the same on every TP/PP rank of the replica.
        groups: the ``ParallelGroups`` of the layout.
        vocab_size: the true (unpadded) vocabulary size: output columns beyond it (Megatron pads
            the vocabulary to a multiple of the TP size) stay out of the softmax, as in the
            engines and ``score``. None: every column is real.
        temperature: the rollouts' sampling temperature T: log-probs and entropy are taken of
            softmax(z / T), the distribution the behaviour log-probs were measured under.
        old_logprobs: pi_old, the log-probs of ``batch`` (packed ``[T]``, ``compute_logprobs``)
            under the weights before this rollout batch's first optimizer step, for corrections
            that anchor on it (``algo_cfg.uses_old_logprobs``). None: the weights have not moved
            since then, so pi_old is the current policy, detached, taken in the same pass (exact).
        before_update: called after forward and backward, just before the optimizer changes
            the weights (e.g. `WeightSync.wait_borrowed`: a push still reading them).

    Returns the same metrics on every rank: ``loss`` (exact: global numerator / global
    count), the mismatch metrics (mismatch/*, mask/fraction, is/ess, entropy_bin/*), the
    correction's and loss's metrics (token-weighted over micro-batches and DP), ``optim/grad_norm``, ``optim/skipped`` (1.0 when the non-finite
    norm skipped the step), ``optim/lr`` and ``batch/microbatches``; with MoE routing replay
    (``algo_cfg.routing_replay``, the model built for it) ``routing/disagree_frac`` and per layer.
    """
    config = get_model_config(model_chunks[0])
    check_training_config(config, learner_cfg)
    _check_layout(groups)
    if not all(isinstance(c, DistributedDataParallel) for c in model_chunks):
        raise ValueError("train_step needs DDP-wrapped model chunks: call learner.optimizer.wrap_model_chunks first")
    _prepare_config(config, groups)
    config.finalize_model_grads_func = finalize_model_grads

    micro = microbatches_for_step(batch, groups, learner_cfg, config)
    replay = ReplayStep.for_batch(model_chunks, batch, groups, scoring=False, mode=algo_cfg.routing_replay)

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    last = groups.is_last_stage()

    def make_loss(index: int, mb: MicroBatch):
        return make_policy_loss_func(mb, groups.tp, algo_cfg, learner_cfg, vocab_size=vocab_size,
                                     temperature=temperature, old_logprobs_T=old_logprobs)

    reports = _run_schedule(model_chunks, micro, groups, make_loss, forward_only=False, replay=replay)
    step = optimizer_step(optimizer, scheduler, learner_cfg.optim.clip_grad, before_update=before_update)

    metrics = LossReport.total(reports).all_reduced(groups).metrics() if last else {}
    metrics = _from_last_stage(metrics, groups)
    metrics.update({
        "optim/grad_norm": step.grad_norm,
        "optim/skipped": 0.0 if step.applied else 1.0,
        "optim/lr": step.lr,
        "batch/microbatches": float(len(micro)),
    })
    if replay is not None:
        metrics.update(replay.metrics(groups, _device()))
    return metrics


def compute_logprobs(model_chunks: list, batch: TrainBatch, groups, learner_cfg: LearnerConfig,
                     vocab_size: int | None = None, temperature: float = 1.0,
                     routing_replay: str | None = None) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """Log-probs and entropy of every target position of ``batch`` under the current weights.

    Forward only (no gradients, modules in eval mode), through the same packing and
    pipeline schedule as ``train_step``. Returns float32 ``[T]`` tensors in ``batch``'s
    packed layout (position j of a sequence: log p(token j+1 | tokens 0..j); 0 at each
    sequence's last position) on the LAST pipeline stage, ``(None, None)`` elsewhere.
    Used for the old/proximal policy of corrections that need one and for scoring.
    ``vocab_size``, ``temperature``: as in ``train_step``. ``routing_replay``: None replays MoE
    routes as the model was built to ('r2' records them); 'off' lets every router choose.
    """
    config = get_model_config(model_chunks[0])
    _check_layout(groups)
    _prepare_config(config, groups)
    micro = microbatches_for_step(batch, groups, learner_cfg, config)
    replay = ReplayStep.for_batch(model_chunks, batch, groups, scoring=True, mode=routing_replay)
    was_training = [c.training for c in model_chunks]
    for c in model_chunks:
        c.eval()
    try:
        with torch.no_grad():
            reports = _run_schedule(
                model_chunks, micro, groups,
                partial(_logprob_loss, groups=groups, learner_cfg=learner_cfg, vocab_size=vocab_size,
                        temperature=temperature),
                forward_only=True, replay=replay,
            )
    finally:
        for c, training in zip(model_chunks, was_training):
            c.train(training)
    if replay is not None:
        replay.finish(batch)
    if not groups.is_last_stage():
        return None, None
    total = batch.tokens_T.numel()
    logprobs = torch.zeros(total, dtype=torch.float32)
    entropy = torch.zeros(total, dtype=torch.float32)
    for report in reports:
        mb = micro[report["index"]]
        real = mb.source_index >= 0
        logprobs[mb.source_index[real]] = report["logprobs"].float().cpu()[real]
        entropy[mb.source_index[real]] = report["entropy"].float().cpu()[real]
    last_positions = batch.cu_seqlens[1:] - 1  # no next token there
    logprobs[last_positions] = 0.0
    entropy[last_positions] = 0.0
    return logprobs, entropy


def unreplayed_mismatch(model_chunks: list, shares: list[TrainBatch], groups, learner_cfg: LearnerConfig, *,
                        vocab_size: int | None = None, temperature: float = 1.0) -> dict[str, float]:
    """The behaviour-vs-learner mismatch with MoE routing replay off: one forward-only pass of
    each of this DP rank's ``shares`` in which every router chooses its own experts.
    ``mismatch_unreplayed/{k3, mean_abs_delta, tokens}`` and
    ``mismatch_unreplayed/entropy_bin/<lo>-<hi>/k3`` (the learner's entropy there), over every
    DP rank's policy tokens, the same on every rank (``algorithm.measure_unreplayed``)."""
    sums: dict[str, Tensor] = {}
    for share in shares:
        logprobs, entropy = compute_logprobs(model_chunks, share, groups, learner_cfg, vocab_size=vocab_size,
                                             temperature=temperature, routing_replay="off")
        if logprobs is not None:
            stats = mismatch_metric_stats(logprobs, share.behaviour_logprobs_T, entropy, share.loss_mask_T)
            sums = {k: sums.get(k, 0.0) + v for k, v in stats.sums.items()}
    metrics: dict[str, float] = {}
    if groups.is_last_stage():
        total = torch.stack(list(sums.values())).to(_device())
        if groups.dp_size > 1:
            dist.all_reduce(total, group=groups.dp)
        final = finalize_mismatch_metrics(MetricStats(dict(zip(sums, total.cpu())), {}, {}))
        for key in ("mismatch/k3", "mismatch/mean_abs_delta", "mismatch/tokens"):
            metrics[key.replace("mismatch/", "mismatch_unreplayed/")] = float(final[key])
        metrics.update({f"mismatch_unreplayed/{k}": float(v) for k, v in final.items()
                        if k.startswith("entropy_bin/") and k.endswith("/k3")})
    return _from_last_stage(metrics, groups)


def _logprob_loss(index: int, mb: MicroBatch, groups, learner_cfg: LearnerConfig, vocab_size: int | None,
                  temperature: float):
    return make_logprob_loss_func(mb, index, groups.tp, learner_cfg, vocab_size=vocab_size, temperature=temperature)

"""Log-prob-only forward: per-token log-probs and entropy of whole sequences under the learner.

    results = score_sequences(chunks, spec, groups, [[1, 5, 9], [4, 2, 2, 8]])
    logprobs_0, entropy_0 = results[0]         # [2] each: token 1 given 0, token 2 given 0..1

A sequence of L tokens has L - 1 target positions: position j holds log p(token
j+1 | tokens 0..j) and the entropy of that distribution (at `temperature`).

Sequences are packed without padding into micro-batches of at most
`batch_tokens` tokens (Megatron's `thd` packed format: each sequence attends only
to itself, RoPE positions restart per sequence) and run through Megatron's
forward-only pipeline schedule, so TP, PP (also interleaved) and EP layouts all
work. Every micro-batch has the same length (the remainder is one filler
sequence whose outputs are dropped), because the pipeline schedule exchanges
fixed-shape activations; the length is a multiple of the TP size for sequence
parallelism. Log-probs and entropy come from the vocab-parallel op on the
vocab-sharded logits (the full vocabulary is never gathered), excluding
vocabulary padding.

Results are broadcast from the last pipeline stage, so every rank returns them.
With data parallelism each replica scores what it is given (split the sequences
across replicas yourself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from entr_megatron import models
from entr_megatron.learner.fused_output import fused_output_weight
from entr_megatron.learner.hf_load import unwrap_chunk
from entr_megatron.learner.sequence_packing import DEFAULT_BATCH_TOKENS, MicroBatch, pack_sequences
from entr_megatron.parallel.fused_output import vocab_parallel_linear_logprobs_entropy
from entr_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = ["score_sequences"]

# Micro-batches per schedule call: progress is reported between calls.
_MICROBATCHES_PER_CALL = 16
_FILLER_TOKEN = 0


def _tensors(mb: MicroBatch, sequences, device):
    """ids, targets, positions [1, T] and the PackedSeqParams of a micro-batch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = torch.full((mb.length,), _FILLER_TOKEN, dtype=torch.long)
    targets = torch.full((mb.length,), _FILLER_TOKEN, dtype=torch.long)
    positions = torch.zeros(mb.length, dtype=torch.long)
    bounds = [0]
    for i, start in zip(mb.indices, mb.starts):
        seq = sequences[i]
        n = len(seq)
        ids[start:start + n] = seq
        targets[start:start + n - 1] = seq[1:]
        positions[start:start + n] = torch.arange(n)
        bounds.append(start + n)
    if bounds[-1] < mb.length:  # the filler: its own sequence, outputs dropped
        positions[bounds[-1]:] = torch.arange(mb.length - bounds[-1])
        bounds.append(mb.length)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = int(torch.diff(cu).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    return ids[None].to(device), targets[None].to(device), positions[None].to(device), packed


def score_sequences(
    model_chunks,
    spec: models.ModelSpec,
    groups,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    *,
    temperature: float = 1.0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logprobs, entropy) float32 CPU tensors of length L-1 for each sequence, on every rank.

    Args:
        model_chunks: this rank's chunks (`build_learner_model_from_hf`).
        spec: the model's `ModelSpec` (its true vocab size excludes padding columns).
        groups: the `ParallelGroups` the chunks were built with.
        sequences: token ids in [0, spec.vocab_size), at least one token each.
        temperature: the distribution is softmax(logits / temperature).
        batch_tokens: tokens per micro-batch (a longer sequence gets its own).
        progress: called as progress(sequences_done, total) after each group of micro-batches.
    """
    # megatron.core is imported on first use: processes that only import this module's names (the
    # CLI's argument parsing) do not pay for it.
    from entr_megatron.learner.schedule import run_pipeline

    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    for i, s in enumerate(seqs):
        if s.numel() < 1:
            raise ValueError(f"sequence {i} is empty")
        if int(s.min()) < 0 or int(s.max()) >= spec.vocab_size:
            raise ValueError(
                f"sequence {i}: token ids must be in [0, {spec.vocab_size}), got [{int(s.min())}, {int(s.max())}]"
            )
    if not seqs:
        return []
    chunks = list(model_chunks)
    device = next(chunks[0].parameters()).device
    multiple = groups.tp_size if unwrap_chunk(chunks[0]).config.sequence_parallel else 1
    batches, length = pack_sequences([len(s) for s in seqs], batch_tokens, multiple)

    def forward_step(item, model):
        ids, targets, positions, packed = item
        output = model(ids, positions, None, packed_seq_params=packed)

        weight = fused_output_weight(model)

        def loss_func(output):
            if weight is None:  # logits [1, T, V/tp]
                lp, ent = vocab_parallel_logprobs_entropy(output, targets, groups.tp, temperature,
                                                          vocab_size=spec.vocab_size)
            else:  # the fused output layer's hidden states [1, T, h] (learner.fused_output)
                lp, ent = vocab_parallel_linear_logprobs_entropy(output.to(weight.dtype), weight, targets, groups.tp,
                                                                 temperature, vocab_size=spec.vocab_size)
            return lp.new_zeros(()), {"lp": lp[0].float().cpu(), "ent": ent[0].float().cpu()}

        return output, loss_func

    lp_out = [torch.empty(len(s) - 1) for s in seqs]
    ent_out = [torch.empty(len(s) - 1) for s in seqs]
    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        done = 0
        for first in range(0, len(batches), _MICROBATCHES_PER_CALL):
            group = batches[first:first + _MICROBATCHES_PER_CALL]
            calls = list(group)
            if groups.vpp_size is not None:  # the interleaved schedule wants a multiple of PP micro-batches
                calls += [MicroBatch([], [], length)] * (-len(calls) % groups.pp_size)
            data = [_tensors(mb, seqs, device) for mb in calls]
            with torch.no_grad():
                stored = run_pipeline(chunks, data, forward_step, groups, forward_only=True, seq_length=length)
            if groups.is_last_stage():
                for mb, out in zip(group, stored):
                    for i, start in zip(mb.indices, mb.starts):
                        lp_out[i] = out["lp"][start:start + len(seqs[i]) - 1].clone()
                        ent_out[i] = out["ent"][start:start + len(seqs[i]) - 1].clone()
            done += sum(len(mb.indices) for mb in group)
            if progress is not None:
                progress(done, len(seqs))
    finally:
        for chunk, mode in zip(chunks, was_training):
            chunk.train(mode)
    if groups.pp_size > 1:
        _broadcast_from_last_stage(lp_out, ent_out, groups, device)
    return list(zip(lp_out, ent_out))


def _broadcast_from_last_stage(lp_out, ent_out, groups, device) -> None:
    """Replace the lists' tensors on every stage with the last stage's (one broadcast)."""
    sizes = [t.numel() for t in lp_out]
    flat = torch.cat([torch.cat(lp_out), torch.cat(ent_out)]).to(device)
    dist.broadcast(flat, group=groups.pp, group_src=groups.pp_size - 1)
    flat = flat.cpu()
    n = sum(sizes)
    lp_out[:] = list(torch.split(flat[:n], sizes))
    ent_out[:] = list(torch.split(flat[n:], sizes))

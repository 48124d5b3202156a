"""Rollout batches -> packed Megatron micro-batches, and the data-parallel split.

A ``TrainBatch`` holds variable-length sequences back to back (``types.py``:
target position j of a sequence predicts its token j + 1). Each data-parallel
rank takes a contiguous share (``split_for_data_parallel``) and packs it into
micro-batches of whole sequences without padding them to the longest one:

    micro-batch tokens [1, T]:   | seq a ......| seq b ....| seq c ..|pad|
    position_ids:                 0 1 2 ... La-1 0 1 ... Lb-1 0 ...     0 1
    PackedSeqParams(thd, cu_seqlens = [0, La, La+Lb, ..., T])

so attention never crosses a sequence boundary (the trailing dummy sequence
only pads T to a multiple the layer spec needs, e.g. the TP size under sequence
parallelism; it is never in the loss). The algorithm works on padded
``[B_mb, T_resp]`` response tensors: ``gather_index_BT`` picks each sequence's
response span (first to last loss-masked target position) out of the packed
``[T]`` per-token values, ``response_mask_BT`` marks its policy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from entr_megatron.types import ENGINE_ROUTES, TrainBatch

__all__ = [
    "ENGINE_ROUTES",
    "OLD_POLICY_ROUTES",
    "TOKEN_EXTRAS",
    "BatchCounts",
    "MicroBatch",
    "batch_counts",
    "build_microbatch",
    "pack_microbatches",
    "padded_length",
    "plan_microbatches",
    "response_spans",
    "select_sequences",
    "split_for_data_parallel",
]


OLD_POLICY_ROUTES = "old_policy_routes_T"
"""``TrainBatch.extras`` key of the learner's own routes recorded when the old policy was scored
(routing replay 'r2'), same layout; each rank fills its own layers and tokens only."""
TOKEN_EXTRAS = (ENGINE_ROUTES, OLD_POLICY_ROUTES)
"""Per-token ``extras`` (first dimension ``T``) that follow the sequences they belong to."""


# --- counts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchCounts:
    """What the loss normalisers count. Over DP shards: sum, sum, max."""

    num_tokens: int
    """Response (loss-masked) tokens."""
    num_seqs: int
    """Sequences with at least one response token."""
    max_response_len: int
    """Longest response span (first to last response token, inclusive)."""


def response_spans(batch: TrainBatch) -> tuple[Tensor, Tensor]:
    """``(start_B, length_B)``: each sequence's response span in ``batch``'s target positions
    (first to last loss-masked one, inclusive); length 0 and start at the sequence start when
    a sequence has no response token."""
    starts = batch.cu_seqlens[:-1].clone()
    lengths = torch.zeros(batch.num_seqs, dtype=torch.long)
    for i in range(batch.num_seqs):
        masked = batch.loss_mask_T[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]].nonzero().flatten()
        if masked.numel():
            starts[i] += masked[0]
            lengths[i] = masked[-1] - masked[0] + 1
    return starts, lengths


def batch_counts(batch: TrainBatch) -> BatchCounts:
    """Response tokens, non-empty sequences and the longest response span of ``batch``."""
    mask = batch.loss_mask_T.bool()
    per_seq = torch.zeros(batch.num_seqs, dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(batch.num_seqs), batch.seq_lens)
    per_seq.index_add_(0, seq_of_token, mask.long())
    _, lengths = response_spans(batch)
    return BatchCounts(
        num_tokens=int(mask.sum()),
        num_seqs=int((per_seq > 0).sum()),
        max_response_len=int(lengths.max()) if lengths.numel() else 0,
    )


# --- data-parallel split ----------------------------------------------------------------------

def select_sequences(batch: TrainBatch, indices: list[int] | Tensor) -> TrainBatch:
    """A batch of ``batch``'s sequences ``indices``, in that order (of ``extras``, only the
    per-token ``TOKEN_EXTRAS`` are carried)."""
    idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    lens = batch.seq_lens[idx]
    positions = torch.cat(
        [torch.arange(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])) for i in idx.tolist()]
    ) if idx.numel() else torch.zeros(0, dtype=torch.long)
    cu = torch.zeros(idx.numel() + 1, dtype=torch.long)
    cu[1:] = lens.cumsum(0)

    def take(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[positions]

    return TrainBatch(
        tokens_T=batch.tokens_T[positions],
        cu_seqlens=cu,
        loss_mask_T=batch.loss_mask_T[positions],
        behaviour_logprobs_T=batch.behaviour_logprobs_T[positions],
        advantages_B=batch.advantages_B[idx],
        versions_T=take(batch.versions_T),
        rollout_entropy_T=take(batch.rollout_entropy_T),
        token_labels_T=take(batch.token_labels_T),
        policy_version=batch.policy_version,
        extras={k: v[positions] for k, v in batch.extras.items() if k in TOKEN_EXTRAS},
    )


def split_for_data_parallel(batch: TrainBatch, dp_size: int) -> list[TrainBatch]:
    """``dp_size`` contiguous shares of ``batch`` balanced by token count (compute grows with
    tokens); share ``r`` is data-parallel rank ``r``'s. Deterministic: boundary k is the
    sequence boundary nearest ``k / dp_size`` of the tokens (ties to the earlier one), every
    share keeping at least one sequence."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    n = batch.num_seqs
    if n < dp_size:
        raise ValueError(
            f"a global batch of {n} sequences cannot feed {dp_size} data-parallel ranks (need >= {dp_size})"
        )
    prefix = batch.cu_seqlens.tolist()  # prefix[i] = tokens in sequences [0, i)
    total = prefix[-1]
    bounds = [0]
    for k in range(1, dp_size):
        target = k * total / dp_size
        lo, hi = bounds[-1] + 1, n - (dp_size - k)  # leave one sequence per remaining share
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i)))
    bounds.append(n)
    return [select_sequences(batch, list(range(a, b))) for a, b in zip(bounds[:-1], bounds[1:])]


# --- micro-batch plan ------------------------------------------------------------------------------

def padded_length(num_tokens: int, pad_multiple: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``pad_multiple``, at least one multiple
    (an empty micro-batch still runs: every rank must take part in each collective)."""
    return max(pad_multiple, -(-num_tokens // pad_multiple) * pad_multiple)


def plan_microbatches(seq_lens: list[int], max_tokens: int, pad_multiple: int = 1) -> list[list[int]]:
    """Sequence indices of each micro-batch: first-fit decreasing into bins of at most
    ``max_tokens`` tokens after padding to ``pad_multiple``.

    Deterministic: longest first (ties: lower index), each bin listed in index order and
    the bins ordered by their first index. A sequence longer than the budget is alone.
    """
    if max_tokens < 1 or pad_multiple < 1:
        raise ValueError(f"max_tokens={max_tokens} and pad_multiple={pad_multiple} must be >= 1")
    # Padding a bin's total to the multiple must stay within the budget.
    capacity = max(pad_multiple, max_tokens // pad_multiple * pad_multiple)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        for b, load in enumerate(loads):
            if load + seq_lens[i] <= capacity:
                bins[b].append(i)
                loads[b] += seq_lens[i]
                break
        else:
            bins.append([i])
            loads.append(seq_lens[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


# --- micro-batches --------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """One packed micro-batch of whole sequences (``T`` tokens incl. the dummy padding sequence)."""

    seq_indices: Tensor
    """``[B_mb]`` indices of its sequences in the (DP-local) batch."""
    tokens: Tensor
    """``[1, T]`` int64 token ids."""
    position_ids: Tensor
    """``[1, T]`` positions, restarting at 0 in every sequence."""
    targets: Tensor
    """``[1, T]`` the next token within the same sequence (0 at each sequence's last position)."""
    loss_mask: Tensor
    """``[1, T]`` bool: target is a policy-generated token."""
    packed_seq_params: PackedSeqParams
    """thd layout with ``cu_seqlens`` (int32, padding sequence included)."""
    source_index: Tensor
    """``[T]`` position of each token in the batch's packed layout; -1 for padding."""
    gather_index_BT: Tensor
    """``[B_mb, T_resp]`` packed position of response-span slot t of sequence b (0 outside spans)."""
    response_mask_BT: Tensor
    """``[B_mb, T_resp]`` bool: inside the span and loss-masked."""
    advantages_B: Tensor
    """``[B_mb]`` float32."""
    behaviour_logprobs_BT: Tensor
    """``[B_mb, T_resp]`` float32 behaviour log-probs (0 outside the response mask)."""
    rollout_entropy_BT: Tensor | None
    versions_BT: Tensor | None
    token_labels_BT: Tensor | None
    """``[B_mb, T_resp]`` label ids (types.TOKEN_LABELS) of the response tokens; None: unlabelled."""
    policy_version: int | None
    """The version of the weights being trained (``TrainBatch.policy_version``)."""
    num_real_tokens: int
    """Tokens of real sequences (T minus padding)."""

    @property
    def length(self) -> int:
        """T, the packed length including padding."""
        return self.tokens.shape[1]

    @property
    def num_seqs(self) -> int:
        return self.seq_indices.numel()

    def to_padded(self, values_T: Tensor) -> Tensor:
        """Packed per-position values ``[T]`` (or ``[1, T]``) -> ``[B_mb, T_resp]``, 0 outside the
        response mask. Differentiable (a gather)."""
        device = values_T.device  # index maps live on the CPU; the values may not
        values = values_T.reshape(-1)[self.gather_index_BT.to(device)]
        return torch.where(self.response_mask_BT.to(device), values, torch.zeros_like(values))

    def padded_from_batch(self, batch_values_T: Tensor) -> Tensor:
        """Like ``to_padded`` for values in the BATCH's packed layout (e.g. recomputed old log-probs)."""
        source = self.source_index.clamp(min=0).to(batch_values_T.device)
        return self.to_padded(batch_values_T.reshape(-1)[source])


def build_microbatch(batch: TrainBatch, seq_indices: list[int], pad_multiple: int = 1,
                     length: int | None = None) -> MicroBatch:
    """Pack ``batch``'s sequences ``seq_indices`` (in that order) into one micro-batch.

    ``T`` is ``padded_length(tokens, pad_multiple)`` or ``length`` when given (>= that and a
    multiple of ``pad_multiple``: used to give every rank of an expert-parallel group the
    same micro-batch length). An empty ``seq_indices`` gives a padding-only micro-batch.
    """
    idx = torch.as_tensor(seq_indices, dtype=torch.long).reshape(-1)
    lens = batch.seq_lens[idx].tolist()
    real = sum(lens)
    minimum = padded_length(real, pad_multiple)
    total = minimum if length is None else length
    if total < minimum or total % pad_multiple:
        raise ValueError(f"length={length} must be >= {minimum} and a multiple of pad_multiple={pad_multiple}")
    pad = total - real
    starts = [int(batch.cu_seqlens[i]) for i in idx.tolist()]

    source = torch.full((total,), -1, dtype=torch.long)
    positions = torch.zeros(total, dtype=torch.long)
    at = 0
    for start, n in zip(starts, lens):
        source[at:at + n] = torch.arange(start, start + n)
        positions[at:at + n] = torch.arange(n)
        at += n
    positions[at:] = torch.arange(pad)
    real_slots = source >= 0
    tokens = torch.where(real_slots, batch.tokens_T[source.clamp(min=0)], 0)
    loss_mask = real_slots & batch.loss_mask_T[source.clamp(min=0)].bool()
    # The next token of the same sequence: shift left, then blank each sequence's last slot.
    targets = torch.zeros(total, dtype=torch.long)
    targets[:-1] = tokens[1:]
    seq_cu = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
    targets[seq_cu[1:][seq_cu[1:] > 0] - 1] = 0
    targets[real:] = 0

    cu = [0] + seq_cu[1:].tolist() + ([total] if pad else [])
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    max_len = max([pad] + lens) if (lens or pad) else 0
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)

    gather, resp_mask = _response_index(batch, idx, seq_cu, loss_mask)
    behaviour = torch.where(resp_mask, batch.behaviour_logprobs_T[source.clamp(min=0)][gather].float(), 0.0)

    def padded(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        values = t[source.clamp(min=0)][gather]
        return torch.where(resp_mask, values, torch.zeros_like(values))

    return MicroBatch(
        seq_indices=idx, tokens=tokens[None], position_ids=positions[None], targets=targets[None],
        loss_mask=loss_mask[None], packed_seq_params=packed, source_index=source,
        gather_index_BT=gather, response_mask_BT=resp_mask, advantages_B=batch.advantages_B[idx].float(),
        behaviour_logprobs_BT=behaviour, rollout_entropy_BT=padded(batch.rollout_entropy_T),
        versions_BT=padded(batch.versions_T), token_labels_BT=padded(batch.token_labels_T),
        policy_version=batch.policy_version, num_real_tokens=real,
    )


def _response_index(batch: TrainBatch, idx: Tensor, seq_cu: Tensor, loss_mask_T: Tensor) -> tuple[Tensor, Tensor]:
    """``gather_index_BT`` and ``response_mask_BT`` of a micro-batch (see MicroBatch)."""
    starts, spans = response_spans(select_sequences(batch, idx)) if idx.numel() else (seq_cu[:0], seq_cu[:0])
    width = int(spans.max()) if spans.numel() else 0
    # starts are in the selected batch's layout, which is the micro-batch's minus padding.
    slots = torch.arange(width)
    in_span = slots[None, :] < spans[:, None]
    gather = torch.where(in_span, starts[:, None] + slots[None, :], 0)
    return gather, in_span & loss_mask_T[gather]


def pack_microbatches(batch: TrainBatch, max_tokens: int, pad_multiple: int = 1) -> list[MicroBatch]:
    """``batch`` as packed micro-batches (``plan_microbatches`` then ``build_microbatch``)."""
    plan = plan_microbatches(batch.seq_lens.tolist(), max_tokens, pad_multiple)
    return [build_microbatch(batch, seqs, pad_multiple) for seqs in plan]

"""Packing TrainBatches into Megatron micro-batches, the DP split and the global counts, on hand-computed cases."""

import pytest
import torch

from entr_megatron.learner.batching import (
    batch_counts,
    build_microbatch,
    pack_microbatches,
    padded_length,
    plan_microbatches,
    response_spans,
    select_sequences,
    split_for_data_parallel,
)
from entr_megatron.types import Sample, TrainBatch


def make_batch() -> TrainBatch:
    """Four sequences; batch positions: s0 0-4, s1 5-9, s2 10-12, s3 13-14.

    s0: prompt [1, 2], response [3, 4, 5]            -> target mask F T T T F   (span 1..3)
    s1: prompt [6], response [7, 8, 9, 10], tool 8, 9 -> target mask T F F T F   (span 0..3)
    s2: prompt [11, 12, 13], empty response          -> target mask F F F       (no span)
    s3: prompt [14], response [15]                   -> target mask T F         (span 0..0)
    """
    samples = [
        Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [5, 5, 6], rollout_entropy=[1.0, 2.0, 3.0]),
        Sample([6], [7, 8, 9, 10], [-1.0, -2.0, -3.0, -4.0], [7, 7, 7, 8], rollout_entropy=[4.0, 5.0, 6.0, 7.0],
               loss_mask=[True, False, False, True]),
        Sample([11, 12, 13], [], [], [], rollout_entropy=[]),
        Sample([14], [15], [-0.5], [9], rollout_entropy=[8.0]),
    ]
    return TrainBatch.from_samples(samples, torch.tensor([1.0, -1.0, 0.5, 2.0]))


def test_response_spans_and_global_counts():
    batch = make_batch()
    starts, lengths = response_spans(batch)
    assert starts.tolist() == [1, 5, 10, 13]
    assert lengths.tolist() == [3, 4, 0, 1]
    counts = batch_counts(batch)
    assert (counts.num_tokens, counts.num_seqs, counts.max_response_len) == (6, 3, 4)


def test_plan_is_first_fit_decreasing_within_the_padded_budget():
    assert plan_microbatches([5, 5, 3, 2], max_tokens=8) == [[0, 2], [1, 3]]
    # pad_multiple=3: a bin's padded length must fit in 8, so the capacity is 6.
    assert plan_microbatches([5, 5, 3, 2], max_tokens=8, pad_multiple=3) == [[0], [1], [2, 3]]
    # A sequence longer than the budget is never split: it gets a micro-batch of its own.
    assert plan_microbatches([2, 12, 3], max_tokens=6) == [[0, 2], [1]]
    assert plan_microbatches([], max_tokens=4) == []
    assert plan_microbatches([1, 1, 1], max_tokens=100) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        plan_microbatches([1], max_tokens=0)


def test_padded_length():
    assert [padded_length(n, 4) for n in (0, 1, 4, 5, 8)] == [4, 4, 4, 8, 8]
    assert padded_length(7, 1) == 7


def test_microbatch_layout_by_hand():
    batch = make_batch()
    mb = build_microbatch(batch, [1, 3], pad_multiple=4)  # 5 + 2 tokens, padded to 8
    assert mb.tokens.tolist() == [[6, 7, 8, 9, 10, 14, 15, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert mb.targets.tolist() == [[7, 8, 9, 10, 0, 15, 0, 0]]
    assert mb.loss_mask.tolist() == [[True, False, False, True, False, True, False, False]]
    assert mb.source_index.tolist() == [5, 6, 7, 8, 9, 13, 14, -1]
    p = mb.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == [0, 5, 7, 8] and p.cu_seqlens_kv.tolist() == [0, 5, 7, 8]
    assert p.max_seqlen_q == 5
    assert (mb.length, mb.num_seqs, mb.num_real_tokens) == (8, 2, 7)
    assert mb.seq_indices.tolist() == [1, 3]
    assert mb.gather_index_BT.tolist() == [[0, 1, 2, 3], [5, 0, 0, 0]]
    assert mb.response_mask_BT.tolist() == [[True, False, False, True], [True, False, False, False]]
    assert mb.advantages_B.tolist() == [-1.0, 2.0]
    assert mb.behaviour_logprobs_BT.tolist() == [[-1.0, 0.0, 0.0, -4.0], [-0.5, 0.0, 0.0, 0.0]]
    assert mb.rollout_entropy_BT.tolist() == [[4.0, 0.0, 0.0, 7.0], [8.0, 0.0, 0.0, 0.0]]
    assert mb.versions_BT.tolist() == [[7, 0, 0, 8], [9, 0, 0, 0]]
    values = torch.arange(8, dtype=torch.float32)
    assert mb.to_padded(values).tolist() == [[0.0, 0.0, 0.0, 3.0], [5.0, 0.0, 0.0, 0.0]]
    assert mb.to_padded(values[None]).tolist() == mb.to_padded(values).tolist()
    batch_values = torch.arange(15, dtype=torch.float32) * 10  # batch layout
    assert mb.padded_from_batch(batch_values).tolist() == [[50.0, 0.0, 0.0, 80.0], [130.0, 0.0, 0.0, 0.0]]


def test_microbatch_with_a_prompt_only_sequence_and_explicit_length():
    batch = make_batch()
    mb = build_microbatch(batch, [0, 2], length=10)  # 5 + 3 real tokens, 2 padding
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 11, 12, 13, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert mb.targets.tolist() == [[2, 3, 4, 5, 0, 12, 13, 0, 0, 0]]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 8, 10]
    assert mb.gather_index_BT.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert mb.response_mask_BT.tolist() == [[True, True, True], [False, False, False]]
    torch.testing.assert_close(mb.behaviour_logprobs_BT, torch.tensor([[-0.1, -0.2, -0.3], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="length"):
        build_microbatch(batch, [0, 2], length=7)
    with pytest.raises(ValueError, match="length"):
        build_microbatch(batch, [0, 2], pad_multiple=4, length=10)


def test_padding_only_microbatch():
    mb = build_microbatch(make_batch(), [], pad_multiple=2)
    assert mb.tokens.tolist() == [[0, 0]] and mb.position_ids.tolist() == [[0, 1]]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 2]
    assert mb.num_seqs == 0 and mb.num_real_tokens == 0
    assert mb.response_mask_BT.shape == (0, 0) and not mb.loss_mask.any()


def test_no_padding_sequence_when_the_length_fits():
    mb = build_microbatch(make_batch(), [0, 3])
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 7]
    assert (mb.source_index >= 0).all()


def test_pack_covers_every_sequence_once_and_keeps_their_data():
    batch = make_batch()
    micro = pack_microbatches(batch, max_tokens=6, pad_multiple=2)
    assert sorted(i for mb in micro for i in mb.seq_indices.tolist()) == [0, 1, 2, 3]
    assert all(mb.length <= 6 and mb.length % 2 == 0 for mb in micro)
    for mb in micro:
        real = mb.source_index >= 0
        assert torch.equal(mb.tokens[0][real], batch.tokens_T[mb.source_index[real]])
        assert torch.equal(mb.loss_mask[0][real], batch.loss_mask_T[mb.source_index[real]])
    assert sum(int(mb.response_mask_BT.sum()) for mb in micro) == batch_counts(batch).num_tokens


def test_select_sequences():
    batch = make_batch()
    sub = select_sequences(batch, [3, 0])
    assert sub.tokens_T.tolist() == [14, 15, 1, 2, 3, 4, 5]
    assert sub.cu_seqlens.tolist() == [0, 2, 7]
    assert sub.loss_mask_T.tolist() == [True, False, False, True, True, True, False]
    assert sub.advantages_B.tolist() == [2.0, 1.0]
    assert sub.versions_T.tolist() == [9, 0, 0, 5, 5, 6, 0]
    assert sub.rollout_entropy_T.tolist() == [8.0, 0.0, 0.0, 1.0, 2.0, 3.0, 0.0]


def test_data_parallel_split_is_contiguous_balanced_and_deterministic():
    batch = make_batch()  # sequence lengths 5, 5, 3, 2 (15 tokens)
    shares = split_for_data_parallel(batch, 2)
    # boundary nearest 7.5 tokens: after s0 (5) or after s1 (10) tie -> the earlier one
    assert [s.num_seqs for s in shares] == [1, 3]
    assert torch.equal(torch.cat([s.tokens_T for s in shares]), batch.tokens_T)
    assert torch.equal(torch.cat([s.advantages_B for s in shares]), batch.advantages_B)
    shares3 = split_for_data_parallel(batch, 3)  # targets 5 and 10 tokens
    assert [s.seq_lens.tolist() for s in shares3] == [[5], [5], [3, 2]]
    assert [s.num_seqs for s in split_for_data_parallel(batch, 4)] == [1, 1, 1, 1]
    assert [s.num_seqs for s in split_for_data_parallel(batch, 1)] == [4]
    with pytest.raises(ValueError, match="cannot feed 5"):
        split_for_data_parallel(batch, 5)
    # Global counts are the sums (tokens, sequences) and the max (span) of the shares' counts.
    parts = [batch_counts(s) for s in shares3]
    whole = batch_counts(batch)
    assert sum(p.num_tokens for p in parts) == whole.num_tokens
    assert sum(p.num_seqs for p in parts) == whole.num_seqs
    assert max(p.max_response_len for p in parts) == whole.max_response_len


def test_data_parallel_split_balances_skewed_lengths():
    samples = [Sample([1] * n, [2], [-1.0], [0]) for n in (1, 1, 1, 1, 10, 1, 1, 1, 1)]
    batch = TrainBatch.from_samples(samples, torch.zeros(9))
    # lengths 2, 2, 2, 2, 11, 2, 2, 2, 2 (27 tokens): boundaries at 8 and 19 are both 5.5 from 13.5
    shares = split_for_data_parallel(batch, 2)
    assert [int(s.seq_lens.sum()) for s in shares] == [8, 19]
    assert [int(s.seq_lens.sum()) for s in split_for_data_parallel(batch, 3)] == [8, 11, 8]

"""Loss aggregation modes: hand values, loop reference, global counts across micro-batches."""

import math

import pytest
import torch

from entr_megatron.algorithm import LOSS_AGGREGATIONS, aggregate_loss

F64 = torch.float64
MODES = sorted(LOSS_AGGREGATIONS)

# Row 0: 3 tokens, row 1: 1 token, row 2: empty. Padding holds garbage that must not count.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, math.nan], [math.inf, 99.0, 99.0]], dtype=F64)
MASK = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, (1 + 2 + 3 + 4) / 4),
        ("token-mean", {"num_tokens": 8}, 10 / 8),
        ("seq-mean-token-mean", {}, (6 / 3 + 4 / 1) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", {"num_seqs": 4}, (6 / 3 + 4 / 1) / 4),
        ("seq-mean-token-sum-norm", {}, 10 / (2 * 3)),  # Dr.GRPO: num_seqs * T
        ("seq-mean-token-sum-norm", {"num_seqs": 4, "max_response_len": 5}, 10 / 20),
    ],
)
def test_hand_values(mode, kwargs, expected):
    assert aggregate_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_token_mean_denominator_counts_tokens_a_correction_masked():
    # A correction zeroes tokens 1 and 2 of row 0; they stay in the denominator (ENTR.md):
    # (1 + 4) / 4, not (1 + 4) / 2.
    per_token = torch.tensor([[1.0, 0.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert aggregate_loss(per_token, MASK, "token-mean").item() == pytest.approx(5 / 4)


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_is_zero_not_nan(mode):
    loss = torch.full((2, 3), math.nan)
    value = aggregate_loss(loss, torch.zeros(2, 3, dtype=torch.bool), mode)
    assert value.item() == 0.0


def _reference(loss, mask, mode):
    B, T = len(loss), len(loss[0])
    rows = [[loss[b][t] for t in range(T) if mask[b][t]] for b in range(B)]
    tokens = sum(len(r) for r in rows)
    seqs = sum(1 for r in rows if r)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / tokens
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / seqs
    return sum(sum(r) for r in rows) / (seqs * T)


@pytest.mark.parametrize("mode", MODES)
def test_against_loop_reference(mode):
    g = torch.Generator().manual_seed(4)
    loss = torch.randn(7, 9, generator=g, dtype=F64)
    mask = torch.rand(7, 9, generator=g) > 0.4
    expected = _reference(loss.tolist(), mask.tolist(), mode)
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_global_counts_make_micro_batches_sum_to_the_batch(mode):
    g = torch.Generator().manual_seed(9)
    loss = torch.randn(6, 8, generator=g, dtype=F64, requires_grad=True)
    lengths = torch.tensor([8, 3, 0, 5, 1, 7])
    mask = torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)
    whole = aggregate_loss(loss, mask, mode)
    counts = {"num_tokens": int(mask.sum()), "num_seqs": int(mask.any(-1).sum()), "max_response_len": 8}
    # Micro-batch 2 is trimmed to its own longest response (7), as a packer would do.
    first = aggregate_loss(loss[:3], mask[:3], mode, **counts)
    parts = first + aggregate_loss(loss[3:, :7], mask[3:, :7], mode, **counts)
    torch.testing.assert_close(parts, whole)
    (grad_whole,) = torch.autograd.grad(whole, loss)
    (grad_parts,) = torch.autograd.grad(parts, loss)
    torch.testing.assert_close(grad_parts, grad_whole)


def test_tensor_counts_are_accepted():
    value = aggregate_loss(LOSS, MASK, "token-mean", num_tokens=torch.tensor(8))
    assert value.item() == pytest.approx(10 / 8)


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "sum")

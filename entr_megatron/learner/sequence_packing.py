"""Whole token sequences packed in order into micro-batches of one common length, for the
forward-only scoring of `learner/scoring.py` (Megatron's `thd` format: the schedule exchanges
fixed-shape activations). Plain Python: `entr-megatron score --help` reads its default from here.

    batches, length = pack_sequences([5, 9, 2], batch_tokens=12)   # [[0], [1, 2]] at length 12
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_BATCH_TOKENS", "MicroBatch", "pack_sequences"]

DEFAULT_BATCH_TOKENS = 4096
"""Tokens per packed micro-batch when the caller does not say (`score --batch-tokens`)."""


@dataclass
class MicroBatch:
    """Sequences `indices` packed into `length` tokens (the tail is one filler sequence)."""

    indices: list[int]
    starts: list[int]
    length: int


def pack_sequences(lengths: Sequence[int], batch_tokens: int, multiple_of: int = 1) -> tuple[list[MicroBatch], int]:
    """Greedy in-order packing of sequences into micro-batches of one common length.

    The common length is `batch_tokens`, or the longest sequence if longer,
    rounded up to `multiple_of`. Returns (micro-batches, common length).
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs at least one token")
    length = max([batch_tokens, *lengths])
    length = -(-length // multiple_of) * multiple_of
    batches, current, starts, used = [], [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > length:
            batches.append(MicroBatch(current, starts, length))
            current, starts, used = [], [], 0
        current.append(i)
        starts.append(used)
        used += n
    if current:
        batches.append(MicroBatch(current, starts, length))
    return batches, length

"""Flat weight buckets on our broadcast wire: which tensors go together, where each one sits, its header.

    for layout, tensors in plan_buckets(named_tensors, bucket_bytes=512 << 20, dtype=torch.bfloat16):
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.fill(flat, tensors)              # copies (and casts) every tensor into its slot
        header = layout.to_bytes()              # names, dtypes, shapes as JSON
    BucketLayout.from_bytes(header).views(flat)     # the receiver's (name, tensor) views

The layout is `utils.buckets.FlatLayout` in SGLang's "flattened_bucket" setting (the
tensors' bytes back to back without padding, larger elements first so that every offset
is a multiple of its element size), cut by `utils.buckets.plan_flat_buckets`: a tensor
that would overflow the bucket starts the next one, and a tensor larger than
`bucket_bytes` travels alone in a bucket of its own size. Our receivers and SGLang's
unpack the same bytes. What is ours: the header, and the slots that travel `alone`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from entr_megatron.rollout.weights import BucketEntry
from entr_megatron.utils.buckets import FlatLayout, dtype_from_name, dtype_name, floating_as, plan_flat_buckets

__all__ = ["BucketLayout", "plan_buckets"]


@dataclass(frozen=True)
class BucketLayout:
    """Names, dtypes and shapes of a bucket's tensors, in wire order; offsets follow from them."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    alone: tuple[int, ...] = ()
    """Slots (indices, increasing) whose bytes travel in broadcasts of their own, never shared with
    a neighbour's: the learner sends them straight from its parameters (`WeightSyncConfig.snapshot`)."""

    def __post_init__(self):
        assert len(self.names) == len(self.dtypes) == len(self.shapes) > 0, "a bucket holds at least one tensor"
        assert list(self.alone) == sorted(set(self.alone)) and all(0 <= i < len(self.names) for i in self.alone), \
            f"alone must be increasing slot indices, got {self.alone}"

    @cached_property
    def flat_layout(self) -> FlatLayout:
        """The slots' places in the flat buffer (the shared wire layout)."""
        return FlatLayout(self.names, self.dtypes, self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.flat_layout.offsets

    @property
    def nbytes(self) -> int:
        return self.flat_layout.nbytes

    def slot_nbytes(self, i: int) -> int:
        return self.flat_layout.slot_nbytes(i)

    def segments(self) -> tuple[tuple[int, int], ...]:
        """The bytes as (start, end) segments in order: each `alone` slot, and each run of the
        other slots between them (empty slots and runs left out)."""
        out, start = [], 0
        for i in self.alone:
            offset, end = self.offsets[i], self.offsets[i] + self.slot_nbytes(i)
            if offset > start:
                out.append((start, offset))
            if end > offset:
                out.append((offset, end))
            start = end
        if self.nbytes > start:
            out.append((start, self.nbytes))
        return tuple(out)

    def ranges(self, chunk_bytes: int) -> tuple[tuple[int, int], ...]:
        """The (start, end) byte ranges the bucket's bytes are broadcast in: each segment in
        pieces of at most `chunk_bytes` (<= 0: whole), the last piece of each shorter. Sender
        and receivers cut the same ranges from the header and the control message."""
        out = []
        for start, end in self.segments():
            step = end - start if chunk_bytes <= 0 else chunk_bytes
            out.extend((s, min(end, s + step)) for s in range(start, end, step))
        return tuple(out)

    def entries(self) -> tuple[BucketEntry, ...]:
        """The same slots as `rollout.weights` entries (for `WeightBucket` / `WeightStage.load_bucket`)."""
        return tuple(BucketEntry(n, d, s, o) for n, d, s, o in zip(self.names, self.dtypes, self.shapes, self.offsets))

    def views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor view into `flat`) for each slot; `flat` is uint8 with at least `nbytes`."""
        return self.flat_layout.views(flat)

    def fill(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy `tensors` (wire order, any dtype: cast on copy) into their slots of `flat`."""
        for _ in self.fill_slices(flat, tensors, slice_bytes=1 << 62):
            pass

    def fill_slices(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                    slice_bytes: int) -> Iterator[int]:
        """`fill`, a piece of at most `slice_bytes` at a time (a non-contiguous tensor in one piece):
        yields after each piece how many leading bytes of `flat` are final (slots are in offset order)."""
        assert len(tensors) == len(self.names) and slice_bytes > 0
        for (_, view), t, offset, dtype in zip(self.views(flat), tensors, self.offsets, self.dtypes):
            t = t.detach()
            step = max(1, slice_bytes // dtype.itemsize)
            if not t.is_contiguous() or t.numel() <= step:
                view.copy_(t)
                yield offset + view.numel() * dtype.itemsize
                continue
            src, dst = t.view(-1), view.view(-1)
            for start in range(0, t.numel(), step):
                end = min(t.numel(), start + step)
                dst[start:end].copy_(src[start:end])
                yield offset + end * dtype.itemsize

    def to_bytes(self) -> bytes:
        """The header receivers decode with `from_bytes` (JSON, SGLang's dtype names)."""
        body = {"names": list(self.names), "dtypes": [dtype_name(d) for d in self.dtypes],
                "shapes": [list(s) for s in self.shapes], "alone": list(self.alone)}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BucketLayout:
        body = json.loads(data)
        return cls(tuple(body["names"]), tuple(dtype_from_name(d) for d in body["dtypes"]),
                   tuple(tuple(int(x) for x in s) for s in body["shapes"]), tuple(int(i) for i in body["alone"]))


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None,
) -> Iterator[tuple[BucketLayout, list[torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (see the module docstring).

    dtype: floating tensors travel as this dtype (cast while `fill` copies); None: as given.
    Yields (layout, the tensors in wire order); the tensors are the inputs (not yet copied).
    """
    for layout, tensors in plan_flat_buckets(named_tensors, bucket_bytes, wire_dtype=floating_as(dtype)):
        yield BucketLayout(layout.names, layout.dtypes, layout.shapes), tensors

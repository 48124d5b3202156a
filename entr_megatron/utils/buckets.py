"""The flat weight bucket: where named tensors sit in one uint8 buffer, and how they are cut into buckets.

    for layout, tensors in plan_flat_buckets(named_tensors, bucket_bytes=512 << 20,
                                             wire_dtype=floating_as(torch.bfloat16)):
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.fill(flat, tensors)          # copies (and casts) every tensor into its slot
        received = layout.views(flat)       # the receiver's (name, tensor view) of each slot

Every packer of weights uses this one layout (SGLang's unpacking included, so it is a wire
format), with one of two settings:

- align=1, largest_first=True: SGLang's "flattened_bucket". The tensors' bytes back to back
  without padding, larger elements first (a stable sort), so that every offset is a multiple of
  its element size (SGLang refuses unaligned tensors). The SGLang client
  (`rollout.sglang.protocol`) and our broadcast protocol (`weight_sync.buckets`) use it.
- align=64, largest_first=False: the embedded engine's queue buckets (`rollout.weights`), in the
  order given, each tensor starting at a multiple of 64 bytes and the bucket padded to one.

Cutting: tensors are taken in order; one whose bytes would end past `bucket_bytes` (at its
aligned offset) starts the next bucket, so a tensor larger than `bucket_bytes` travels alone in
a bucket of its own size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = [
    "FlatLayout",
    "align_up",
    "as_given",
    "dtype_from_name",
    "dtype_name",
    "floating_as",
    "numel",
    "plan_flat_buckets",
]

WireDtype = Callable[[str, torch.Tensor], torch.dtype]
"""The dtype a named tensor travels as."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> its name without "torch." (SGLang's spelling: getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called `name` ("bfloat16"); ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of `shape` (1 for a scalar's ())."""
    n = 1
    for d in shape:
        n *= d
    return n


def align_up(n: int, align: int) -> int:
    """The smallest multiple of `align` that is >= n."""
    return (n + align - 1) // align * align


def as_given(name: str, tensor: torch.Tensor) -> torch.dtype:
    """Wire dtype rule: every tensor travels as it is."""
    return tensor.dtype


def floating_as(dtype: torch.dtype | None) -> WireDtype:
    """Wire dtype rule of the weight transports: floating tensors travel as `dtype` (None: as
    given), the others (integer buffers, masks) as they are."""
    if dtype is None:
        return as_given
    return lambda name, tensor: dtype if tensor.is_floating_point() else tensor.dtype


@dataclass(frozen=True)
class FlatLayout:
    """Names, dtypes and shapes of a bucket's tensors in wire order; offsets follow from them."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    align: int = 1
    """Each tensor starts at a multiple of this many bytes, and the bucket's size is one."""

    def __post_init__(self):
        assert len(self.names) == len(self.dtypes) == len(self.shapes), "one dtype and shape per name"
        assert self.align >= 1, f"align must be >= 1, got {self.align}"

    @cached_property
    def _geometry(self) -> tuple[tuple[int, ...], int]:
        offsets, end = [], 0
        for dtype, shape in zip(self.dtypes, self.shapes):
            offset = align_up(end, self.align)
            assert offset % dtype.itemsize == 0, f"unaligned {dtype} at byte {offset}"
            offsets.append(offset)
            end = offset + numel(shape) * dtype.itemsize
        return tuple(offsets), align_up(end, self.align)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each slot in the flat buffer."""
        return self._geometry[0]

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer."""
        return self._geometry[1]

    def slot_nbytes(self, i: int) -> int:
        """Bytes of slot i (without padding)."""
        return numel(self.shapes[i]) * self.dtypes[i].itemsize

    def views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor view into `flat`) for each slot; `flat` is uint8 with at least `nbytes`."""
        assert flat.dtype == torch.uint8 and flat.numel() >= self.nbytes, "flat bucket too small"
        return [
            (n, flat[o:o + numel(s) * d.itemsize].view(d).view(s))
            for n, d, s, o in zip(self.names, self.dtypes, self.shapes, self.offsets)
        ]

    def fill(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy `tensors` (wire order, any dtype: cast on copy) into their slots of `flat`."""
        assert len(tensors) == len(self.names), "one tensor per slot"
        for (_, view), t in zip(self.views(flat), tensors):
            view.copy_(t.detach())

    def pack(self, tensors: Sequence[torch.Tensor], *, share_memory: bool = False) -> torch.Tensor:
        """A new flat uint8 buffer holding `tensors` (in shared memory with `share_memory`)."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8)
        if share_memory:
            flat.share_memory_()
        self.fill(flat, tensors)
        return flat


def plan_flat_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    wire_dtype: WireDtype = as_given,
    align: int = 1,
    largest_first: bool = True,
) -> Iterator[tuple[FlatLayout, list[torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (see the module docstring).

    wire_dtype: what each tensor travels as (cast when the layout `fill`s it). align and
    largest_first: the layout's setting (largest_first needs align 1, where the order does not
    change the size). Yields (layout, the tensors in wire order): the inputs, not yet copied.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if largest_first and align != 1:
        raise ValueError(f"largest_first needs align=1 (reordering would change the padding), got align={align}")
    pending: list[tuple[str, torch.Tensor, torch.dtype]] = []
    size = 0  # bytes of the bucket so far, padding included

    def flush() -> tuple[FlatLayout, list[torch.Tensor]]:
        order = sorted(pending, key=lambda p: -p[2].itemsize) if largest_first else pending  # stable
        layout = FlatLayout(tuple(n for n, _, _ in order), tuple(d for _, _, d in order),
                            tuple(tuple(t.shape) for _, t, _ in order), align)
        assert layout.nbytes == size, "the cut and the layout disagree on the bucket's size"
        return layout, [t for _, t, _ in order]

    for name, tensor in named_tensors:
        dtype = wire_dtype(name, tensor)
        nbytes = tensor.numel() * dtype.itemsize
        if pending and size + nbytes > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor, dtype))
        size = align_up(size + nbytes, align)
    if pending:
        yield flush()

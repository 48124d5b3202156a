"""Weight updates on the engine side: flat buckets in transit, a staging copy, an atomic swap.

A new weight version travels as flat byte buckets (`pack_buckets`: several HF-named
tensors packed back to back, one message or one broadcast per bucket rather than
one per tensor; the layout is `utils.buckets`, here with 64-byte aligned slots). The engine writes what arrives into a `WeightStage`, a second
copy of its parameters, while it keeps decoding with the current ones. Once every
tensor of the version is staged, the decode loop calls `swap_into` between two
steps: parameters exchange storage with their staged copies (no copying, O(number
of tensors)), and the old storage becomes the staging area of the next version.
So the engine never samples from a half-updated model, and blocks only for the
swap, never for the transfer. Memory: one extra copy of the model (allocated by
the first update), plus the buckets in flight.

Transports plug in at the stage: the embedded engine's own queue transport calls
`load_bucket`; a broadcast transport can receive straight into `buffer(name)`, or a
whole flat bucket straight into `bucket_buffer(entries)` (the staged tensors of those
entries re-laid out as one flat buffer in the bucket's layout, then `commit_bucket`:
no copy on the engine side), or into a flat bucket of its own and call `load_bucket`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from entr_megatron.utils.buckets import align_up, numel, plan_flat_buckets

__all__ = ["BucketEntry", "TensorSpec", "WeightBucket", "WeightStage", "pack_buckets", "tensor_specs"]

_ALIGN = 64
"""Byte alignment of each tensor inside a bucket, so every slice can be viewed as its dtype."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype an engine expects for one name."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class BucketEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset into the bucket."""

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


@dataclass
class WeightBucket:
    """Several tensors packed into one flat uint8 buffer."""

    entries: tuple[BucketEntry, ...]
    flat: torch.Tensor
    """uint8 [num_bytes(entries)]."""

    @staticmethod
    def num_bytes(entries: tuple[BucketEntry, ...]) -> int:
        """Size of the flat buffer these entries were packed into."""
        return align_up(max(e.offset + e.nbytes for e in entries), _ALIGN)

    @classmethod
    def allocate(cls, entries: tuple[BucketEntry, ...]) -> WeightBucket:
        """An empty bucket to receive into (e.g. by broadcast) once the entries are known."""
        return cls(tuple(entries), torch.empty(cls.num_bytes(entries), dtype=torch.uint8))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view into `flat`) for each entry."""
        for e in self.entries:
            yield e.name, self.flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    share_memory: bool = False,
) -> Iterator[WeightBucket]:
    """Pack tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets
    a bucket of its own). `dtypes`: cast each name to this dtype while packing (send what
    the receiver stores). `share_memory`: allocate buckets in shared memory, so that a
    torch.multiprocessing queue passes them without another copy."""

    def wire_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
        return dtypes.get(name, tensor.dtype) if dtypes is not None else tensor.dtype

    for layout, tensors in plan_flat_buckets(named_tensors, bucket_bytes, wire_dtype=wire_dtype,
                                             align=_ALIGN, largest_first=False):
        entries = tuple(BucketEntry(*slot) for slot in zip(layout.names, layout.dtypes, layout.shapes, layout.offsets))
        assert layout.nbytes == WeightBucket.num_bytes(entries)
        yield WeightBucket(entries, layout.pack(tensors, share_memory=share_memory))


def tensor_specs(model: torch.nn.Module) -> dict[str, TensorSpec]:
    """Every `state_dict` name of the model (tied names included) and its shape/dtype."""
    return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}


class WeightStage:
    """A staging copy of a model's weights that a transport fills and the engine swaps in.

    Names are the model's `state_dict` names (HF "transformers" in-memory layout).
    Tied names (e.g. `lm_head.weight` and `model.embed_tokens.weight`) share one
    staged tensor; a version is complete when every distinct tensor was written.
    Thread use: one receiving thread calls begin/write/load_bucket/buffer/finish,
    the decode thread calls `swap_into` once `ready`.
    """

    def __init__(self, model: torch.nn.Module):
        state = model.state_dict(keep_vars=True)
        self.specs: dict[str, TensorSpec] = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in state.items()}
        self._slot: dict[str, int] = {}  # name -> index of its distinct tensor
        self._targets: list[torch.Tensor] = []  # the model's distinct parameters/buffers
        self._names: list[list[str]] = []
        slot_of_tensor: dict[int, int] = {}
        for name, t in state.items():
            key = slot_of_tensor.setdefault(id(t), len(self._targets))
            if key == len(self._targets):
                self._targets.append(t)
                self._names.append([])
            self._slot[name] = key
            self._names[key].append(name)
        self._staged: list[torch.Tensor] | None = None  # allocated by the first begin()
        self.flat_allocator: Callable[[int], torch.Tensor] | None = None
        """Allocates the flat buffers of `bucket_buffer` (uint8 [nbytes]); None: torch.empty where the
        model is. A colocated transport sets it to memory that the learner writes into."""
        self._lock = threading.Lock()  # bookkeeping: several receiving threads may fill the stage (one per group)
        self._written = [False] * len(self._targets)
        self.version: int | None = None
        self.ready = False
        self.num_bytes = 0
        self.began_at = 0.0
        self.staged_at = 0.0

    @property
    def num_tensors(self) -> int:
        return len(self._targets)

    @property
    def device(self) -> torch.device:
        """Where the model's weights (and so the staged copy) live."""
        return self._targets[0].device if self._targets else torch.device("cpu")

    def begin(self, version: int) -> None:
        """Start receiving `version` (the previous one must have been swapped in or discarded)."""
        assert not self.ready, "begin() while a staged version waits for its swap"
        if self._staged is None:
            self._staged = [torch.empty_like(t.detach()) for t in self._targets]
        self.version, self.num_bytes = version, 0
        self._written = [False] * len(self._targets)
        self.began_at = time.time()

    def _slot_of(self, name: str, shape: tuple[int, ...]) -> int:
        if self.version is None or self._staged is None:
            raise RuntimeError("WeightStage: begin(version) before sending tensors")
        if name not in self._slot:
            raise ValueError(
                f"weight update: unknown tensor {name!r} "
                f"(expected HF 'transformers' layout names, e.g. {next(iter(self._slot))!r})"
            )
        if tuple(shape) != self.specs[name].shape:
            raise ValueError(
                f"weight update: {name!r} has shape {tuple(shape)}, the engine's model has {self.specs[name].shape}"
            )
        return self._slot[name]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor into the stage (cast to the engine's dtype)."""
        slot = self._slot_of(name, tuple(tensor.shape))
        self._staged[slot].copy_(tensor.detach())
        with self._lock:
            self._written[slot] = True
            self.num_bytes += tensor.numel() * tensor.element_size()

    def load_bucket(self, bucket: WeightBucket) -> None:
        """Copy every tensor of a bucket into the stage."""
        for name, view in bucket.tensors():
            self.write(name, view)

    def buffer(self, name: str) -> torch.Tensor:
        """The staged tensor for `name`, for a transport that receives in place; counts as written."""
        slot = self._slot_of(name, self.specs[name].shape if name in self.specs else ())
        with self._lock:
            self._written[slot] = True
            self.num_bytes += self._staged[slot].numel() * self._staged[slot].element_size()
        return self._staged[slot]

    def bucket_buffer(self, entries: tuple[BucketEntry, ...], nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of `nbytes` whose bytes ARE the staged tensors of `entries` (each at its
        offset, in its dtype), for a transport that receives a whole flat bucket in place (no
        copy); `commit_bucket(entries)` once the bytes arrived. Not written until then.

        The first time (for this layout, and once more for the storage the following swap
        hands back) the stage re-lays those tensors out as views of one new flat buffer of the
        bucket's layout; later versions with the same layout land in it directly. None when
        the bucket cannot land in place (a name or shape the engine does not know, a dtype it
        stores differently, two names of one tied tensor, padding between the tensors as
        `pack_buckets` leaves it): receive it elsewhere and `load_bucket` it (which reports
        what is wrong)."""
        with self._lock:
            if self.version is None or self._staged is None or not entries:
                return None
            slots = []
            for e in entries:
                slot, spec = self._slot.get(e.name), self.specs.get(e.name)
                if slot is None or spec.shape != tuple(e.shape) or spec.dtype != e.dtype or e.offset % e.dtype.itemsize:
                    return None
                slots.append(slot)
            if len(set(slots)) != len(slots):
                return None
            end = 0  # the entries must tile the buffer (no gaps, no padding): its bytes are theirs alone
            for e in sorted(entries, key=lambda e: e.offset):
                if e.offset != end:
                    return None
                end += e.nbytes
            if end != nbytes:
                return None
            flat = self._flat_of(slots, entries, nbytes)
            if flat is None:  # lay them out afresh (their old staged storage is dropped)
                flat = (self.flat_allocator(nbytes) if self.flat_allocator is not None
                        else torch.empty(nbytes, dtype=torch.uint8, device=self.device))
                for slot, e in zip(slots, entries):
                    self._staged[slot] = flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            return flat

    def _flat_of(self, slots: list[int], entries: tuple[BucketEntry, ...], nbytes: int) -> torch.Tensor | None:
        """The flat uint8 view over the staged tensors of `slots` if they already sit in one
        storage at the entries' offsets, else None. Only parameters count: a buffer's staged
        tensor stays put when the swap copies it, so it is pointed back into the flat buffer."""
        anchors = [i for i, slot in enumerate(slots) if isinstance(self._targets[slot], torch.nn.Parameter)]
        anchors = anchors or list(range(len(slots)))
        first, e0 = self._staged[slots[anchors[0]]], entries[anchors[0]]
        storage = first.untyped_storage()
        base = first.data_ptr() - e0.offset
        start = base - storage.data_ptr()
        if start < 0 or start + nbytes > storage.nbytes():
            return None
        for i in anchors:
            t, e = self._staged[slots[i]], entries[i]
            if (t.data_ptr() != base + e.offset or not t.is_contiguous() or t.dtype != e.dtype
                    or t.untyped_storage().data_ptr() != storage.data_ptr()):
                return None
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,))
        for slot, e in zip(slots, entries):
            t = self._staged[slot]
            if t.data_ptr() != base + e.offset or t.untyped_storage().data_ptr() != storage.data_ptr():
                self._staged[slot] = flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        return flat

    def commit_bucket(self, entries: tuple[BucketEntry, ...]) -> None:
        """The bytes of a `bucket_buffer` arrived: its tensors count as written."""
        with self._lock:
            for e in entries:
                self._written[self._slot[e.name]] = True
                self.num_bytes += e.nbytes

    def finish(self) -> None:
        """Check the version is complete and mark it ready for `swap_into`."""
        missing = [self._names[i][0] for i, w in enumerate(self._written) if not w]
        if missing:
            self.discard()
            raise ValueError(
                f"weight update incomplete: {len(missing)} of {len(self._written)} tensors missing, e.g. {missing[:3]}"
            )
        self.staged_at = time.time()
        self.ready = True

    def discard(self) -> None:
        """Drop a partial or unwanted version (the model is untouched)."""
        self.version, self.ready = None, False

    def swap_into(self) -> int:
        """Install the staged version (decode thread, between two steps); returns the version.
        Parameters exchange storage with the stage, so nothing is copied."""
        assert self.ready and self._staged is not None, "swap_into() before finish()"
        with torch.no_grad():
            for i, target in enumerate(self._targets):
                if isinstance(target, torch.nn.Parameter):
                    target.data, self._staged[i] = self._staged[i], target.data
                else:  # buffers are small and may be referenced elsewhere: copy
                    target.copy_(self._staged[i])
        version, self.version, self.ready = self.version, None, False
        return version

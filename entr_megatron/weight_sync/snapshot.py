"""The learner's snapshot of the weights it sends: bounded host buffers and the hand-over to the sender thread.

    pool = BufferPool(max_buffers=4, pin_memory=torch.cuda.is_available())
    stream = SnapshotStream()
    # learner thread                                     # sender thread
    buf = pool.acquire(nbytes, stream)                   for bucket in stream:            # in order
    bucket = SnapshotBucket(layout, buf, pool,               send(bucket.layout)          # header
                            borrowed=..., filling=True)      for piece in bucket.pieces(chunk):   # waits
    stream.put(bucket)                                           send(piece)              # until copied
    bucket.fill(tensors)   # copies, piece by piece          bucket.release()             # free again
    stream.finish()

The sender gets each bucket before it is copied, so it sends the first bytes of a
bucket while the learner copies the rest (the copy and the wire overlap at the
granularity of a slice, whatever the bucket size). Copied tensors are the
learner's to change once the push returned; borrowed ones (parameters sent from
where they are, `WeightSyncConfig.snapshot="borrow"`) only once the sender is done.
Memory is bounded by `max_buffers` (None: as many as one version needs, i.e. one
copy of the stage's weights); with fewer, the learner waits for the sender to
free one (reported as buffer wait). Buffers are kept and reused by later pushes
(same bucket sizes every version).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from entr_megatron.weight_sync.buckets import BucketLayout

__all__ = ["BufferPool", "PoolBuffer", "SnapshotBucket", "SnapshotFailed", "SnapshotStream", "TransferBroken"]

_POLL_S = 0.1
"""How often a blocked learner looks whether the sender has failed."""


class TransferBroken(RuntimeError):
    """The sender thread failed; the learner stops copying (but keeps iterating: its TP/EP
    peers gather in step with it)."""


class PoolBuffer:
    """One buffer of a `BufferPool`: `tensor` is uint8, at least as large as asked for."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class BufferPool:
    """Host buffers for snapshot buckets: at most `max_buffers` in use at once (None: no limit).
    `allocate(nbytes)` makes a uint8 buffer when given (e.g. in shared memory, for a transport
    whose engines read the snapshot where it is); else host memory, pinned with `pin_memory`."""

    def __init__(self, max_buffers: int | None = None, pin_memory: bool = False,
                 allocate: Callable[[int], torch.Tensor] | None = None):
        if max_buffers is not None and max_buffers < 1:
            raise ValueError(f"max_buffers must be None or >= 1, got {max_buffers}")
        self.max_buffers, self.pin_memory, self.allocate = max_buffers, pin_memory, allocate
        self._free: list[PoolBuffer] = []
        self._in_use = 0
        self._cond = threading.Condition()
        self.allocated_bytes = 0
        """Bytes of all buffers held (in use and idle)."""
        self.peak_in_use_bytes = 0
        """Most bytes of buffers in use at once (their capacity) since the last reset."""
        self._in_use_bytes = 0

    def acquire(self, nbytes: int, stream: SnapshotStream | None = None) -> PoolBuffer:
        """A buffer of at least `nbytes`; blocks while `max_buffers` are in use. Raises
        `TransferBroken` when `stream` breaks meanwhile."""
        with self._cond:
            while self.max_buffers is not None and self._in_use >= self.max_buffers:
                if stream is not None:
                    if stream.error is not None:
                        raise TransferBroken(f"the weight sender failed: {stream.error!r}")
                    stream.settle()
                self._cond.wait(_POLL_S)
            fits = [b for b in self._free if b.tensor.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.tensor.numel())
                self._free.remove(buf)
            else:
                if self._free and self.max_buffers is not None and self._in_use + len(self._free) >= self.max_buffers:
                    dropped = self._free.pop(0)  # too small: make room under the bound
                    self.allocated_bytes -= dropped.tensor.numel()
                buf = PoolBuffer(self.allocate(nbytes) if self.allocate is not None
                                 else torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory))
                self.allocated_bytes += nbytes
            self._in_use += 1
            self._in_use_bytes += buf.tensor.numel()
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use_bytes)
            return buf

    def release(self, buf: PoolBuffer) -> None:
        with self._cond:
            self._in_use -= 1
            self._in_use_bytes -= buf.tensor.numel()
            self._free.append(buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Free the idle buffers (memory of buffers in use is freed when they come back)."""
        with self._cond:
            for b in self._free:
                self.allocated_bytes -= b.tensor.numel()
            self._free.clear()


_FILL_SLICE_BYTES = 8 << 20
"""The learner copies a bucket this many bytes at a time, publishing its progress after each piece."""


class SnapshotBucket:
    """One bucket of the snapshot: its layout, the tensors it borrows and the buffer holding the rest.

    borrowed: slot index -> the tensor itself (contiguous, in the wire dtype: a learner
    parameter), sent from where it is instead of copied; those slots must be the layout's
    `alone` slots. The other slots are copied, back to back in their layout order, into
    `buffer` (None when every slot is borrowed). A bucket made with `filling=True` is
    handed to the sender before its bytes are copied: the learner's thread then calls
    `fill`, and the sender's `pieces` wait for the bytes they are about to send (so it
    sends the start of a bucket while the rest is copied).
    """

    def __init__(self, layout: BucketLayout, buffer: PoolBuffer | None, pool: BufferPool, *,
                 borrowed: dict[int, torch.Tensor] | None = None, filling: bool = False):
        borrowed = borrowed or {}
        assert set(borrowed) <= set(layout.alone), "borrowed slots must travel alone"
        self.layout, self._buffer, self._pool = layout, buffer, pool
        self._borrowed = {i: t.detach().reshape(-1).view(torch.uint8) for i, t in borrowed.items()}
        copied = [i for i in range(len(layout.names)) if i not in borrowed]
        self._copied = copied
        self.copied_layout = BucketLayout(*(tuple(getattr(layout, f)[i] for i in copied)
                                            for f in ("names", "dtypes", "shapes"))) if copied else None
        """The copied slots alone, back to back: their place in `flat`."""
        assert (buffer is None) == (self.copied_layout is None), "a buffer exactly when some slot is copied"
        self._released = False
        self._cond = threading.Condition()
        self._filled = 0 if filling else self.copied_nbytes  # leading bytes of `flat` that are final
        self._abandoned = False

    def __repr__(self) -> str:
        return (f"SnapshotBucket({self.layout.nbytes} bytes, {len(self.layout.names)} tensors, "
                f"{len(self._borrowed)} borrowed, filled {self._filled})")

    @property
    def copied_nbytes(self) -> int:
        return 0 if self.copied_layout is None else self.copied_layout.nbytes

    @property
    def borrowed_nbytes(self) -> int:
        return self.layout.nbytes - self.copied_nbytes

    @property
    def flat(self) -> torch.Tensor:
        """The copied slots' bytes (`copied_layout`); the whole bucket when nothing is borrowed."""
        if self._buffer is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._buffer.tensor[: self.copied_nbytes]

    def fill(self, tensors, stop=None, slice_bytes: int = _FILL_SLICE_BYTES) -> None:
        """The learner's thread: copy the slots of `tensors` (all of them, wire order) that are not
        borrowed into the buffer, publishing progress. `stop()` true (the sender failed) ends it
        with `TransferBroken`; any error abandons the bucket (the sender then stops waiting for it)."""
        try:
            if self.copied_layout is not None:
                copied = [tensors[i] for i in self._copied]
                for end in self.copied_layout.fill_slices(self.flat, copied, slice_bytes):
                    with self._cond:
                        self._filled = end
                        self._cond.notify_all()
                    if stop is not None and stop():
                        raise TransferBroken("the weight sender failed")
        except BaseException:
            with self._cond:
                self._abandoned = True
                self._cond.notify_all()
            raise

    def wait_filled(self, nbytes: int | None = None) -> bool:
        """The sender: until the first `nbytes` of `flat` (None: all) are copied; False if the
        learner abandoned the bucket first (it then fails the stream: the version is aborted)."""
        need = self.copied_nbytes if nbytes is None else min(nbytes, self.copied_nbytes)
        with self._cond:
            while self._filled < need and not self._abandoned:
                self._cond.wait()
            return self._filled >= need

    def pieces(self, chunk_bytes: int):
        """The sender: the bucket's bytes as the tensors to broadcast for `layout.ranges(chunk_bytes)`,
        each once it is ready: a borrowed slot's bytes where they are, the others from `flat` once
        copied. A piece the learner abandoned is yielded as it is (the stream then fails and the
        version is aborted: the wire stays aligned)."""
        starts = {self.layout.offsets[i]: i for i in self._borrowed}
        skipped = 0  # borrowed bytes before the current segment: layout offset - skipped = offset in flat
        segment = None
        for start, end in self.layout.ranges(chunk_bytes):
            if segment is not None and start >= self.layout.offsets[segment] + self.layout.slot_nbytes(segment):
                skipped += self.layout.slot_nbytes(segment)
                segment = None
            if start in starts:
                segment = starts[start]
            if segment is not None:
                offset = self.layout.offsets[segment]
                yield self._borrowed[segment][start - offset:end - offset]
            else:
                self.wait_filled(end - skipped)
                yield self.flat[start - skipped:end - skipped]

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every slot in wire order: the borrowed tensors, views into `flat` for
        the others (copied: call after `wait_filled()`)."""
        copied = iter(self.copied_layout.views(self.flat) if self.copied_layout is not None else ())
        out = []
        for i, (name, dtype, shape) in enumerate(zip(self.layout.names, self.layout.dtypes, self.layout.shapes)):
            if i in self._borrowed:
                out.append((name, self._borrowed[i].view(dtype).view(shape)))
            else:
                out.append(next(copied))
        return out

    def release(self) -> None:
        """Give the buffer back (idempotent); `flat` must not be used afterwards."""
        if not self._released:
            self._released = True
            if self._buffer is not None:
                self._pool.release(self._buffer)


_END = object()


class SnapshotStream:
    """Buckets from the learner's thread to the sender thread, in order, ended by `finish` or `fail`."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        """Set by the consumer when sending failed (the producer stops copying)."""
        self._settled = threading.Event()
        self._ended = False  # the consumer has taken the end (or the producer's error)

    # --- producer (the learner's thread) ---------------------------------------------------

    def put(self, bucket: SnapshotBucket) -> None:
        if self.error is not None:
            bucket.release()
            raise TransferBroken(f"the weight sender failed: {self.error!r}")
        self._q.put(bucket)

    def finish(self) -> None:
        """Every bucket of the version was put."""
        self._q.put(_END)
        self._settled.set()

    def fail(self, error: BaseException) -> None:
        """The learner could not snapshot the version: the sender aborts it."""
        self._q.put(error)
        self._settled.set()

    def settle(self) -> None:
        """The producer must wait for buffers: what is queued is all that comes without sending."""
        self._settled.set()

    # --- consumer (the sender thread) ------------------------------------------------------

    def __iter__(self):
        """The buckets in order; raises the producer's error if it failed."""
        while True:
            item = self._q.get()
            if item is _END:
                self._ended = True
                return
            if isinstance(item, BaseException):
                self._ended = True
                raise SnapshotFailed(f"the learner failed while snapshotting: {item!r}") from item
            yield item

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Until the snapshot is complete, or as far as the buffers allow."""
        return self._settled.wait(timeout)

    def break_(self, error: BaseException) -> None:
        """Sending failed: make the producer stop copying, and release every bucket it queued
        until it ends the version (it always does: `finish` or `fail` in a finally)."""
        self.error = error
        while not self._ended:
            item = self._q.get()
            if isinstance(item, SnapshotBucket):
                item.release()
            elif item is _END or isinstance(item, BaseException):
                self._ended = True


class SnapshotFailed(RuntimeError):
    """The learner's thread failed before the version was complete."""

"""The learner's snapshot of the weights it sends: bounded host buffers and the hand-over to the sender thread.

    pool = BufferPool(max_buffers=4, pin_memory=torch.cuda.is_available())
    stream = SnapshotStream()
    # learner thread                                     # sender thread
    buf = pool.acquire(layout.nbytes, stream)            for bucket in stream:            # in order
    bucket = SnapshotBucket(layout, buf, pool, filling=True)  send(bucket.layout)          # header
    stream.put(bucket)                                       for each slice of bucket.flat:
    bucket.fill(tensors)   # copies, piece by piece              bucket.wait_filled(end)   # copied?
    stream.finish()                                              send(slice)
                                                             bucket.release()             # free again

The sender gets each bucket before it is copied, so it sends the first bytes of a
bucket while the learner copies the rest (the copy and the wire overlap at the
granularity of a slice, whatever the bucket size). A push returns once every
tensor is copied into a buffer, so the learner may change its weights right away.
Memory is bounded by `max_buffers` (None: as many as one version needs, i.e. one
copy of the stage's weights); with fewer, the learner waits for the sender to
free one (reported as buffer wait). Buffers are kept and reused by later pushes
(same bucket sizes every version).
"""

from __future__ import annotations

import queue
import threading

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
    """Host buffers for snapshot buckets: at most `max_buffers` in use at once (None: no limit)."""

    def __init__(self, max_buffers: int | None = None, pin_memory: bool = False):
        if max_buffers is not None and max_buffers < 1:
            raise ValueError(f"max_buffers must be None or >= 1, got {max_buffers}")
        self.max_buffers, self.pin_memory = max_buffers, pin_memory
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
                buf = PoolBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory))
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
    """One bucket of the snapshot: its layout and the host buffer holding its bytes.

    A bucket made with `filling=True` is handed to the sender before its bytes are copied:
    the learner's thread then calls `fill`, and the sender waits for the bytes it is about to
    send with `wait_filled` (so it sends the start of a bucket while the rest is copied).
    """

    def __init__(self, layout: BucketLayout, buffer: PoolBuffer, pool: BufferPool, *, filling: bool = False):
        self.layout, self._buffer, self._pool = layout, buffer, pool
        self._released = False
        self._cond = threading.Condition()
        self._filled = 0 if filling else layout.nbytes  # leading bytes of `flat` that are final
        self._abandoned = False

    def __repr__(self) -> str:
        return f"SnapshotBucket({self.layout.nbytes} bytes, {len(self.layout.names)} tensors, filled {self._filled})"

    @property
    def flat(self) -> torch.Tensor:
        return self._buffer.tensor[: self.layout.nbytes]

    def fill(self, tensors, stop=None, slice_bytes: int = _FILL_SLICE_BYTES) -> None:
        """The learner's thread: copy `tensors` into the buffer, publishing progress. `stop()`
        true (the sender failed) ends it with `TransferBroken`; any error abandons the bucket
        (the sender then stops waiting for it)."""
        try:
            for end in self.layout.fill_slices(self.flat, tensors, slice_bytes):
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
        """The sender: until the first `nbytes` (None: all) are copied; False if the learner
        abandoned the bucket first (it then fails the stream: the version is aborted)."""
        need = self.layout.nbytes if nbytes is None else min(nbytes, self.layout.nbytes)
        with self._cond:
            while self._filled < need and not self._abandoned:
                self._cond.wait()
            return self._filled >= need

    def release(self) -> None:
        """Give the buffer back (idempotent); `flat` must not be used afterwards."""
        if not self._released:
            self._released = True
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

"""Learner side: push a weight version to the engines while the next training step runs.

    groups = stage_groups(master_address, base_port, pp_size=pg.pp_size)     # one broadcast group per stage
    transport = BucketTransport(groups[pg.pp_rank]) if is_weight_sender(pg) else None
    sync = WeightSync.for_learner(chunks, spec, pg, transport, WeightSyncConfig(snapshot="borrow"))
    handle = sync.push(version)          # every learner rank; returns once the snapshot is taken
    train_step(..., before_update=sync.wait_borrowed)   # forward/backward overlap the broadcast;
                                                        # the optimizer step waits for borrowed weights
    report = handle.wait()               # every engine holds `version`; report.blocked_s, .transfer_s

What happens on each rank of a pipeline stage, on the learner's thread:

    iter_hf_weights (TP / EP gathers, HF names)  ->  plan_buckets  ->  queue the bucket, then copy
                                                                       its tensors into its snapshot
                                                                       buffer, a slice at a time
                                                                          │ SnapshotStream
    sender thread (the stage's first TP/DP/CP rank only):  transport.send: per bucket, its header,
        then its bytes in pieces, each as soon as the learner has copied it (`BucketTransport`)

So the wire carries the first piece of the snapshot while the learner copies the
next one, whatever the bucket size: the copy is hidden behind the transfer
instead of preceding it.

Two snapshot modes (`WeightSyncConfig.snapshot`):
- "copy": every tensor is copied into host buffers; the learner may change its
  weights as soon as `push` returns. Costs one more copy of the stage's weights
  (memory, or `max_buckets_in_flight` buckets of it) and the CPU time of copying.
- "borrow": a tensor that is a view of a parameter in the wire dtype (at TP=1
  all but the re-laid-out QKV) goes on the wire from the parameter itself, in
  broadcasts of its own; the rest is copied as above. The learner calls
  `wait_borrowed()` before it changes its weights. On GPUs with NCCL this sends
  straight from device memory; on CPU it saves the copy's CPU time, which on a
  small machine competes with the transfer itself.

The gathers are collectives on the learner's own groups, so they run on the
learner's thread, in step on every rank of the stage (ranks that hold no part of
the stage's tensors, e.g. data-parallel replicas of a dense model, skip them).
Only the broadcasts, on the stage's own group, run in the background.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from entr_megatron.config.rollout import DEFAULT_WEIGHT_BUCKET_MIB
from entr_megatron.learner.hf_export import iter_hf_weights
from entr_megatron.models.mapping import HF_TIED_OUTPUT
from entr_megatron.rollout.engine import WeightUpdateReport
from entr_megatron.utils.buckets import dtype_from_name
from entr_megatron.weight_sync.buckets import plan_buckets
from entr_megatron.weight_sync.snapshot import BufferPool, SnapshotBucket, SnapshotStream, TransferBroken
from entr_megatron.weight_sync.transports import Transport

logger = logging.getLogger(__name__)

__all__ = ["SNAPSHOT_MODES", "PushHandle", "PushReport", "WeightSync", "WeightSyncConfig", "is_weight_sender"]

SNAPSHOT_MODES = ("copy", "borrow")

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class WeightSyncConfig:
    """How one stage's weights travel."""

    bucket_bytes: int = DEFAULT_WEIGHT_BUCKET_MIB << 20
    """Bytes per flat bucket (one header each; `BucketTransport` sends its bytes in `chunk_bytes`
    broadcasts, each once copied); a larger tensor travels alone in a bucket of its size. Fewer,
    larger buckets are faster: the receivers stall briefly at each bucket's header."""
    max_buckets_in_flight: int | None = None
    """Snapshot buffers: the learner's extra host memory is at most this many buckets. None: one
    copy of the stage's weights, so `push` never waits for the sender; fewer: `push` waits until
    the sender frees a buffer (reported as `buffer_wait_s`)."""
    dtype: str | None = None
    """Floating tensors travel as this torch dtype (e.g. "bfloat16" for bf16 engines); None: the learner's."""
    pin_memory: bool | None = None
    """Page-locked snapshot buffers (fast device-to-host copies); None: when CUDA is available."""
    snapshot: str = "copy"
    """"copy": every tensor is copied into the snapshot buffers; the learner may change its weights
    as soon as `push` returns. "borrow": tensors of at least `borrow_min_bytes` that the transport
    reads where they are (a parameter in the wire dtype, contiguous: at TP=1 most of them) are
    sent straight from the parameters, without a copy and without their share of snapshot memory;
    the learner must then call `WeightSync.wait_borrowed()` before it changes its weights (its
    next optimizer step), so forward and backward still overlap the transfer."""
    borrow_min_bytes: int = 1 << 20
    """"borrow": smaller tensors are copied (each borrowed one is broadcast on its own)."""

    def __post_init__(self):
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"WeightSyncConfig.bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.max_buckets_in_flight is not None and self.max_buckets_in_flight < 1:
            raise ValueError(
                f"WeightSyncConfig.max_buckets_in_flight must be None or >= 1, got {self.max_buckets_in_flight!r}"
            )
        if self.snapshot not in SNAPSHOT_MODES:
            raise ValueError(f"WeightSyncConfig.snapshot must be one of {SNAPSHOT_MODES}, got {self.snapshot!r}")
        if isinstance(self.borrow_min_bytes, bool) or not isinstance(self.borrow_min_bytes, int) \
                or self.borrow_min_bytes < 1:
            raise ValueError(f"WeightSyncConfig.borrow_min_bytes must be a positive int, got {self.borrow_min_bytes!r}")
        if self.dtype is not None:
            try:
                dtype_from_name(self.dtype)
            except ValueError:
                raise ValueError(f"WeightSyncConfig.dtype must be a torch dtype name, got {self.dtype!r}") from None


@dataclass
class PushReport:
    """What one push cost on this rank (times in seconds)."""

    version: int
    sender: bool
    """This rank sent its stage's weights (the others only took part in the gathers)."""
    num_tensors: int = 0
    num_bytes: int = 0
    """Bytes on the wire (after the dtype cast); 0 on ranks that do not send."""
    borrowed_bytes: int = 0
    """Part of `num_bytes` sent straight from the learner's tensors (`snapshot="borrow"`), not copied."""
    num_buckets: int = 0
    blocked_s: float = 0.0
    """The learner's thread inside `push`: gathers, copies into the snapshot and waits below."""
    wait_previous_s: float = 0.0
    """Part of `blocked_s`: waiting for the previous push to finish."""
    buffer_wait_s: float = 0.0
    """Part of `blocked_s`: waiting for a free snapshot buffer (`max_buckets_in_flight`)."""
    transfer_s: float = 0.0
    """From the `push` call until every engine held the version (sender only)."""
    peak_snapshot_bytes: int = 0
    """Most snapshot buffer bytes in use at once during this push."""
    engines: list[WeightUpdateReport] = field(default_factory=list)
    """The reports of the engines the transport drives (their `swap_s`: how long they blocked)."""

    @property
    def gbytes_per_s(self) -> float:
        """Wire bytes over the transfer time, GB/s (1e9 bytes)."""
        return self.num_bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0

    @property
    def engine_blocked_s(self) -> float | None:
        """The longest engine stall (`swap_s`) among the driven engines; None without reports."""
        return max((r.swap_s for r in self.engines), default=None)


class PushHandle:
    """The version in flight; `wait()` for the engines to hold it."""

    def __init__(self, report: PushReport):
        self.version = report.version
        self.report = report
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._released = threading.Event()  # the sender no longer reads borrowed tensors

    def done(self) -> bool:
        return self._done.is_set()

    def released(self) -> bool:
        """Whether the learner may change the tensors this push borrowed (true at once without any)."""
        return self._released.is_set()

    def wait(self, timeout: float | None = None) -> PushReport:
        """The report once every engine holds the version; raises what went wrong (the engines
        then still sample from their previous version), or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"weight version {self.version} not delivered within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.report

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._released.set()
        self._done.set()


def is_weight_sender(groups) -> bool:
    """Whether this learner rank sends its pipeline stage's weights (its stage's first TP/DP/CP rank)."""
    return groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0


class WeightSync:
    """Pushes weight versions of one pipeline stage (see the module docstring); one per learner rank.

    Args:
        source: called once per push; yields (HF name, full tensor) in the same order on
            every rank of the stage (`for_learner` builds it from the Megatron chunks).
        transport: on the stage's sender rank, how the buckets reach the engines; None on
            the other ranks (they only iterate `source`, which keeps their gathers in step).
        config: bucket size, snapshot bound, dtype on the wire.
        iterate: False for ranks that take no part in the gathers (they return at once).
        borrowable: with `snapshot="borrow"`, which of `source`'s tensors may be borrowed (the
            learner's own parameters, which outlive the push); None: every tensor the transport
            can read, the caller keeping them unchanged until `wait_borrowed`.
    """

    def __init__(self, source: Callable[[], NamedTensors], transport: Transport | None = None,
                 config: WeightSyncConfig = WeightSyncConfig(), *, iterate: bool = True,
                 borrowable: Callable[[torch.Tensor], bool] | None = None):
        self.source, self.transport, self.config, self.iterate = source, transport, config, iterate
        self.borrowable = borrowable
        if transport is not None:
            _check_requirements(config, transport.requirements(), type(transport).__name__)
        pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        self.pool = BufferPool(config.max_buckets_in_flight, pin_memory=pin,
                               allocate=getattr(transport, "buffer_allocator", None))
        self._dtype = None if config.dtype is None else dtype_from_name(config.dtype)
        self._last: PushHandle | None = None
        self._version: int | None = None

    @classmethod
    def for_learner(cls, model_chunks, spec, groups, transport: Transport | None = None,
                    config: WeightSyncConfig = WeightSyncConfig()) -> WeightSync:
        """The `WeightSync` of this learner rank: its stage's HF-named tensors in the transport's layout.

        `transport` is required on the sender rank (`is_weight_sender(groups)`) and ignored elsewhere.
        Tied output embeddings are not sent (engines tie them to the input embedding).
        """
        sender = is_weight_sender(groups)
        if sender and transport is None:
            raise ValueError("this rank sends its pipeline stage's weights (is_weight_sender(groups)): give it a transport")
        transport = transport if sender else None
        layout = transport.layout if transport is not None else "checkpoint"  # same gathers either way

        def source():
            for name, tensor in iter_hf_weights(model_chunks, spec, groups, layout=layout):
                if spec.tie_word_embeddings and name == HF_TIED_OUTPUT:
                    continue
                yield name, tensor

        # Expert weights are gathered over expert-parallel groups that span data-parallel ranks.
        iterate = spec.is_moe or (groups.dp_rank == 0 and groups.cp_rank == 0)
        # Borrowed: views of the parameters' own storage (gathered or re-laid-out tensors are
        # fresh memory that only lives through the push: those are copied).
        storages = {p.untyped_storage().data_ptr() for chunk in model_chunks for p in chunk.parameters()}
        return cls(source, transport, config, iterate=iterate,
                   borrowable=lambda t: t.untyped_storage().data_ptr() in storages)

    @property
    def is_sender(self) -> bool:
        return self.transport is not None

    def connect(self) -> None:
        """Join the stage's group now (otherwise the first push does, in the background); blocks
        until the engines joined."""
        if self.transport is not None:
            self.transport.connect()

    def push(self, version: int) -> PushHandle:
        """Snapshot this stage's weights as `version` and send them in the background.

        Every rank of the stage calls it at the same point (the gathers are collectives).
        Returns once the weights are copied (or, with `max_buckets_in_flight`, once the last
        bucket is copied): the learner may update its weights right away, or, with
        `snapshot="borrow"`, after `wait_borrowed()`. Waits first for the previous push.
        Raises if the learner failed to produce the tensors (the engines then discard the
        version)."""
        t0 = time.perf_counter()
        report = PushReport(version=version, sender=self.is_sender)
        if self._last is not None:
            self._last._done.wait()  # its outcome is its own handle's
        report.wait_previous_s = time.perf_counter() - t0
        if self._version is not None and version <= self._version:
            raise ValueError(f"weight versions must increase: pushed {self._version} before, got {version}")
        self._version = version
        handle = PushHandle(report)
        self._last = handle
        if self.transport is None:
            try:
                if self.iterate:
                    for _ in self.source():
                        pass
            finally:
                report.blocked_s = time.perf_counter() - t0
                handle._finish()
            return handle
        stream = SnapshotStream()
        threading.Thread(
            target=self._send, args=(version, stream, handle, t0), name=f"weight-push-{version}", daemon=True
        ).start()
        try:
            self._snapshot(stream, report)
        finally:
            report.blocked_s = time.perf_counter() - t0
        if report.borrowed_bytes == 0:
            handle._released.set()
        return handle

    def wait_borrowed(self, timeout: float | None = None) -> float:
        """Until the last push no longer reads the learner's tensors (at once unless it borrowed
        some: `WeightSyncConfig.snapshot`); call before changing the weights. Returns the seconds
        waited. Errors of the push are left to `PushHandle.wait`."""
        if self._last is None or self._last.released():
            return 0.0
        t0 = time.perf_counter()
        if not self._last._released.wait(timeout):
            raise TimeoutError(f"weight version {self._last.version} still reads the learner's weights after {timeout} s")
        return time.perf_counter() - t0

    def _may_borrow(self, tensor: torch.Tensor, wire_dtype: torch.dtype) -> bool:
        return (tensor.dtype == wire_dtype and tensor.is_contiguous()
                and tensor.numel() * wire_dtype.itemsize >= self.config.borrow_min_bytes
                and self.transport.can_borrow(tensor) and (self.borrowable is None or self.borrowable(tensor)))

    def _snapshot(self, stream: SnapshotStream, report: PushReport) -> None:
        """Learner thread: plan buckets, copy each into a buffer, queue it. Keeps iterating (without
        copying) after the sender failed, since TP/EP peers gather in step."""
        broken = False
        self.pool.peak_in_use_bytes = 0
        try:
            for layout, tensors in plan_buckets(self.source(), self.config.bucket_bytes, self._dtype):
                report.num_tensors += len(tensors)
                report.num_bytes += layout.nbytes
                report.num_buckets += 1
                if broken:
                    continue
                borrowed = {}
                if self.config.snapshot == "borrow":
                    borrowed = {i: t for i, t in enumerate(tensors) if self._may_borrow(t, layout.dtypes[i])}
                    layout = dataclasses.replace(layout, alone=tuple(sorted(borrowed)))
                copied_bytes = layout.nbytes - sum(layout.slot_nbytes(i) for i in borrowed)
                t = time.perf_counter()
                try:
                    buf = self.pool.acquire(copied_bytes, stream) if copied_bytes else None
                    report.buffer_wait_s += time.perf_counter() - t
                    report.borrowed_bytes += layout.nbytes - copied_bytes
                    bucket = SnapshotBucket(layout, buf, self.pool, borrowed=borrowed, filling=True)
                    stream.put(bucket)  # the sender sends its header and each slice once copied
                    bucket.fill(tensors, stop=lambda: stream.error is not None)
                except TransferBroken:
                    broken = True
        except BaseException as e:
            stream.fail(e)
            raise
        stream.finish()
        report.peak_snapshot_bytes = self.pool.peak_in_use_bytes

    def _send(self, version: int, stream: SnapshotStream, handle: PushHandle, t0: float) -> None:
        """Sender thread: the transport takes the buckets as they come."""
        error = None
        try:
            handle.report.engines = [r for r in self.transport.send(version, stream) if r is not None]
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            error = e
            stream.break_(e)
        handle.report.transfer_s = time.perf_counter() - t0
        handle._finish(error)

    def close(self, wait_s: float | None = None) -> None:
        """Wait for the push in flight (at most `wait_s`; None: until it ends), leave the group,
        free the snapshot buffers."""
        if self._last is not None and not self._last._done.wait(wait_s):
            logger.warning("closing the weight sync with a push still in flight after %.0f s (a dead engine?)",
                           wait_s)
        if self.transport is not None:
            self.transport.close()
        self.pool.clear()


def _check_requirements(config: WeightSyncConfig, required: dict, transport: str) -> None:
    for name, value in required.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"WeightSyncConfig.{name}={getattr(config, name)!r}, but {transport} needs {value!r} "
                "(the engine cuts and types buckets itself; set them equal)"
            )
    if "bucket_bytes" in required and config.max_buckets_in_flight is not None and config.max_buckets_in_flight < 2:
        raise ValueError(f"WeightSyncConfig.max_buckets_in_flight must be None or >= 2 with {transport} "
                         "(it holds one bucket while the engine packs the next)")

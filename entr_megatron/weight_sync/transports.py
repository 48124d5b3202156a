"""How a learner stage's snapshot reaches the engines: the `Transport` protocol, and our bucket protocol.

    BucketTransport(groups[pp_rank])                   # engines run BroadcastReceiver (embedded engine)
    BucketTransport(groups[0], engines=[(engine, receiver_for(groups, 0))])   # ...and drive them from here
    SGLangTransport(sglang_engine, "10.0.0.1", 29600)  # SGLang servers (PP = 1): sglang_transports.py

A transport runs on the stage's sender rank, in the sender thread: `send(version,
stream)` takes the snapshot buckets in order and returns once every engine holds
the version (with the engines' reports where it drives them). The group is
joined by the first `send` (or `connect`), which waits for the engines to join.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from entr_megatron.rollout.engine import RolloutEngine, WeightReceiver, WeightUpdateReport
from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup
from entr_megatron.weight_sync.protocol import ABORT, BUCKET, END, send_control
from entr_megatron.weight_sync.snapshot import SnapshotFailed, SnapshotStream

__all__ = ["DEFAULT_CHUNK_BYTES", "BucketTransport", "Transport", "WeightSyncError"]

DEFAULT_CHUNK_BYTES = 64 << 20
"""`BucketTransport`: bytes per broadcast of a bucket's data (pipelined with the learner's copy)."""


class WeightSyncError(RuntimeError):
    """A version did not reach every engine (the message says where it failed)."""


class Transport(Protocol):
    """What `WeightSync` needs from a transport."""

    layout: str
    """HF layout the engines load: "transformers" (model.state_dict() names) or "checkpoint"."""

    buffer_allocator: Callable[[int], Any] | None
    """Optional: how the snapshot's buffers are made (nbytes -> uint8 tensor), for engines that read
    them where they lie (shared memory); absent or None: host memory."""

    def requirements(self) -> dict[str, Any]:
        """`WeightSyncConfig` fields whose values the engines dictate (empty: none)."""
        ...

    def can_borrow(self, tensor) -> bool:
        """Whether `send` can read `tensor` where it is (a snapshot then borrows it, see
        `WeightSyncConfig.snapshot`) rather than from a host copy."""
        ...

    def connect(self) -> None:
        """Join the group (blocks until the engines joined)."""
        ...

    def send(self, version: int, stream: SnapshotStream) -> list[WeightUpdateReport]:
        """Send every bucket of `stream` as `version`; returns once the engines hold it."""
        ...

    def close(self) -> None:
        ...


class _Call(threading.Thread):
    """A call on its own thread, its result or exception kept."""

    def __init__(self, fn, *args):
        super().__init__(name="weight-engine-call", daemon=True)
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            self.error = e


class BucketTransport:
    """Our versioned bucket protocol (`protocol.py`) over one stage's group, rank 0.

    engines: (engine, receiver) pairs that this process drives: `send` calls
    `engine.update_weights(receiver, version)` concurrently with the broadcasts and
    returns their reports (an engine receiving from several stages is driven by one
    stage only). Without them, whoever holds the engines calls that themselves.
    chunk_bytes: a bucket's bytes go out in broadcasts of at most this size
    (`BucketLayout.ranges`), each as soon as the learner has copied it, or straight from
    a borrowed parameter (the receivers learn it from each bucket's control message).
    """

    layout = "transformers"

    def __init__(self, group: WeightGroup, *, engines: Sequence[tuple[RolloutEngine, WeightReceiver]] = (),
                 timeout_s: float = 600.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"BucketTransport.chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.spec, self.engines, self.timeout_s, self.chunk_bytes = group, tuple(engines), timeout_s, chunk_bytes
        self.group: BroadcastGroup | None = None

    def requirements(self) -> dict[str, Any]:
        return {}

    def can_borrow(self, tensor) -> bool:
        """Tensors on the wire's device (CPU for gloo, the GPU for NCCL): broadcast where they are."""
        return tensor.device.type == ("cpu" if self.spec.backend == "gloo" else "cuda")

    def connect(self) -> None:
        if self.group is None:
            self.group = BroadcastGroup.join(self.spec, 0, timeout_s=self.timeout_s)

    def send(self, version: int, stream: SnapshotStream) -> list[WeightUpdateReport]:
        calls = [_Call(engine.update_weights, receiver, version) for engine, receiver in self.engines]
        error: BaseException | None = None
        try:
            self.connect()
            self._broadcast(version, stream)
        except BaseException as e:  # noqa: BLE001 - raised below, after the engines answered
            error = e
        reports = []
        for call in calls:
            call.join()
            if call.error is not None and error is None:
                error = call.error
            reports.append(call.result)
        if error is not None:
            raise error
        return reports

    def _broadcast(self, version: int, stream: SnapshotStream) -> None:
        group, num_buckets = self.group, 0
        try:
            try:
                for bucket in stream:
                    try:
                        send_control(group, BUCKET, version, bucket.layout.to_bytes(), bucket.layout.nbytes,
                                     self.chunk_bytes)
                        self._send_data(group, bucket)
                    finally:
                        bucket.release()
                    num_buckets += 1
            except SnapshotFailed as e:  # the wire is fine: tell the engines to drop the version
                send_control(group, ABORT, version, str(e).encode())
                raise
            send_control(group, END, version, b"", num_buckets)
            refused = group.all_reduce_sum(0)
            self._version_done()
        except SnapshotFailed:
            raise
        except BaseException:
            self.close()  # the wire is out of step: the next version joins afresh
            raise
        if refused:
            raise WeightSyncError(
                f"{refused} engine rank(s) of {self.spec.group_name!r} refused weight version {version} "
                "(the engines' update_weights says why)"
            )

    def _send_data(self, group: BroadcastGroup, bucket) -> None:
        """The bytes of one bucket, after its control message (colocated.py copies them instead)."""
        # A piece the learner abandoned goes out as it is: the stream then fails and the version is
        # aborted (the wire stays aligned).
        group.broadcast_pieces(bucket.pieces(self.chunk_bytes))

    def _version_done(self) -> None:
        """Every engine acknowledged the version's end."""

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

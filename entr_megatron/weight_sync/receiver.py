"""Engine side: join the stage groups and receive one version's buckets into the engine's staging copy.

    groups = stage_groups("10.0.0.1", 29600, pp_size=2)          # the learner uses the same
    report = engine.update_weights(BroadcastReceiver(groups, rank=1), version=v)   # while the learner pushes v

`BroadcastReceiver` is the `WeightReceiver` an engine runs on its weight thread
(the embedded engine: inside its process, while it keeps decoding). It receives
from every stage's group at once (one thread per group). Each bucket is broadcast
(in pieces, several in flight: `BucketLayout.ranges`, `BroadcastGroup.broadcast_pieces`) straight into the `WeightStage` (`WeightStage.bucket_buffer`: the staged tensors
laid out as the bucket is, so the engine copies nothing) whenever its tensors
travel in the engine's dtypes; otherwise (e.g. a cast on receipt) it lands in a
receive buffer and a loader thread copies it into the stage while the next one is
on the wire (two receive buffers per group, reused across versions). The engine swaps
the stage in only after `receive` returned and the stage is complete, so a
version is atomic whatever happened on the wire.

Groups stay joined in the engine process between versions (the first update
joins them: the learner joins on its first push), like SGLang's
`/init_weights_update_group`. A transport failure leaves the group, so that a
later update joins afresh.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from entr_megatron.rollout.engine import WeightReceiver
from entr_megatron.rollout.weights import WeightBucket, WeightStage
from entr_megatron.utils.faults import maybe_fault
from entr_megatron.weight_sync.buckets import BucketLayout
from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup
from entr_megatron.weight_sync.protocol import ABORT, END, Control, recv_control
from entr_megatron.weight_sync.snapshot import BufferPool

__all__ = ["BroadcastReceiver", "VersionAborted", "acknowledge", "joined_group", "leave_all_groups", "leave_group",
           "next_message", "receiver_for"]

_RECEIVE_BUFFERS = 2
"""Per group: one on the wire while the loader copies the other into the stage."""
JOIN_TIMEOUT_S = 120.0
"""Longest wait of an engine for the other members of a group it joins (at its first update). A
member that died before joining (its node lost as the group's first version went out) would
otherwise hold this engine's join, and every update queued behind it, for the whole transfer
timeout; the learner joins at once when it pushes."""


class _Member:
    """This process's rank in one group, and its receive buffers."""

    def __init__(self, group: BroadcastGroup):
        self.group = group
        self.buffers = BufferPool(max_buffers=_RECEIVE_BUFFERS)


_JOINED: dict[tuple, _Member] = {}
_JOINED_LOCK = threading.Lock()
_CANCEL_POLL_S = 0.1
"""How often a receive in progress looks whether it was cancelled (`BroadcastReceiver.cancel`)."""


def _member(spec: WeightGroup, rank: int, timeout_s: float) -> _Member:
    key = (spec.master_address, spec.master_port, spec.group_name, rank)
    with _JOINED_LOCK:
        member = _JOINED.get(key)
    if member is None:
        member = _Member(BroadcastGroup.join(spec, rank, timeout_s=timeout_s, join_timeout_s=JOIN_TIMEOUT_S))
        with _JOINED_LOCK:
            _JOINED[key] = member
    return member


def joined_group(spec: WeightGroup, rank: int, *, timeout_s: float = 600.0) -> BroadcastGroup:
    """This process's member of `spec` as `rank`, joined by an earlier update or now (for
    receivers that read the group themselves)."""
    return _member(spec, rank, timeout_s).group


def leave_group(spec: WeightGroup, rank: int) -> None:
    """Close this process's member of `spec` as `rank` (a later update joins afresh)."""
    with _JOINED_LOCK:
        member = _JOINED.pop((spec.master_address, spec.master_port, spec.group_name, rank), None)
    if member is not None:
        member.group.close()


def leave_all_groups() -> None:
    """Close every group this process joined (e.g. before the learner re-creates them)."""
    with _JOINED_LOCK:
        members = list(_JOINED.values())
        _JOINED.clear()
    for m in members:
        m.group.close()


class _Loader(threading.Thread):
    """Copies received buckets into the stage, one at a time, and gives their buffers back."""

    def __init__(self, stage: WeightStage):
        super().__init__(name="weight-loader", daemon=True)
        self.stage = stage
        self.q: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.num_buckets = 0

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                self.q.task_done()
                return
            layout, buf, pool = item
            try:
                if self.error is None:
                    self.stage.load_bucket(WeightBucket(layout.entries(), buf.tensor[: layout.nbytes]))
                    self.num_buckets += 1
            except ValueError as e:
                self.error = str(e)
            except Exception as e:  # noqa: BLE001 - reported to the learner and the engine
                self.error = f"loading a weight bucket failed: {e!r}"
            finally:
                pool.release(buf)
                self.q.task_done()


@dataclass(frozen=True)
class BroadcastReceiver(WeightReceiver):
    """Receives a version from the learner stages' broadcast groups (see the module docstring)."""

    groups: tuple[WeightGroup, ...]
    """One group per learner pipeline stage (`stage_groups`); the version is complete once
    every stage's buckets arrived."""
    rank: int
    """This engine's rank in every group (its `rank_offsets` entry; the learner is rank 0)."""
    timeout_s: float = 600.0
    """Joining a group, and each message (gloo / NCCL timeout)."""

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ValueError("BroadcastReceiver.groups is empty: give one WeightGroup per learner pipeline stage")
        if self.rank < 1:
            raise ValueError(f"BroadcastReceiver.rank must be >= 1 (rank 0 is the learner), got {self.rank}")

    def receive(self, stage: WeightStage) -> None:
        """Receive `stage.version` from every group into `stage`; raises if any group failed or
        an engine refused a tensor (the engine then discards the partial stage)."""
        loader = _Loader(stage)
        loader.start()
        offsets = self.groups[0].rank_offsets
        who = f"engine{offsets.index(self.rank)}" if self.rank in offsets else "engine"  # (utils/faults.py)
        try:
            self.on_every_group(lambda spec: _receive_version(_member(spec, self.rank, self.timeout_s),
                                                              stage.version, loader, who))
        finally:
            loader.q.put(None)
            loader.join()

    def cancel(self) -> None:
        """Another member of the groups died mid-version: `receive` (or a subclass's
        `on_every_group`) raises VersionAborted within 0.1 s instead of waiting out `timeout_s`.
        A gloo receive does not wake when a member dies: it waits for bytes a dead rank was to
        relay (gloo's broadcast sends large pieces along a tree), or that the sender, alive but
        failed on its write to the dead rank, no longer sends (small pieces too: 4 of 10 kills at
        random moments, measured), until its timeout; the process group's `abort` does not wake
        it. The groups are given up without being closed (the waiting threads still hold them and
        end at their timeout); the next update joins the groups it is given, on fresh ports
        (controller/job/wiring.py). Called by the engine (`cancel_weight_update`) once the
        controller saw another engine's side of the push fail; the sender has stopped by then,
        so nothing more lands in the discarded stage."""
        self._cancel_flag().set()

    def _cancel_flag(self) -> threading.Event:
        """This receiver's cancel flag, made in the process that receives (never pickled)."""
        with _JOINED_LOCK:
            return self.__dict__.setdefault("_cancelled", threading.Event())

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_cancelled"}

    def on_every_group(self, receive_one: Callable[[WeightGroup], None]) -> None:
        """`receive_one(spec)` for every group at once, one thread each; then raises the first
        error. A group whose transport broke is left (the next update joins it afresh); after
        `cancel`, every group is given up and VersionAborted raised."""
        cancelled = self._cancel_flag()  # a cancel that came as this receive began counts
        try:
            self._on_every_group(receive_one, cancelled)
        finally:
            cancelled.clear()

    def _on_every_group(self, receive_one: Callable[[WeightGroup], None], cancelled: threading.Event) -> None:
        errors: list[BaseException | None] = [None] * len(self.groups)

        def run(index: int, spec: WeightGroup) -> None:
            try:
                receive_one(spec)
            except (ValueError, VersionAborted) as e:
                errors[index] = e
            except BaseException as e:  # noqa: BLE001 - the transport broke: leave the group
                leave_group(spec, self.rank)
                errors[index] = RuntimeError(f"weight group {spec.group_name!r} (rank {self.rank}) failed: {e!r}")

        threads = [threading.Thread(target=run, args=(i, spec), name=f"weight-recv-{spec.group_name}", daemon=True)
                   for i, spec in enumerate(self.groups)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(_CANCEL_POLL_S)
                if cancelled.is_set() and t.is_alive():
                    with _JOINED_LOCK:
                        for spec in self.groups:
                            _JOINED.pop((spec.master_address, spec.master_port, spec.group_name, self.rank), None)
                    raise VersionAborted(f"weight version cancelled on rank {self.rank} (another member of its "
                                         "groups failed): its groups given up")
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]


class VersionAborted(ValueError):
    """The learner aborted the version (its message says why)."""


def _receive_version(member: _Member, version: int, loader: _Loader, who: str = "engine") -> None:
    """Read one version's messages on one group, to its end, whatever goes wrong meanwhile."""
    group, name = member.group, member.group.spec.group_name
    problem: str | None = None
    while True:
        control, layout = next_message(group)
        if layout is None:  # the end of the version
            loader.q.join()  # every bucket of this version is in the stage (or failed)
            acknowledge(group, problem or loader.error)
            return
        maybe_fault(who, version, "receive")  # tests only: an engine lost with a version begun
        if problem is None and loader.error is None and control.version == version:
            entries = layout.entries()
            target = loader.stage.bucket_buffer(entries, layout.nbytes)
            if target is not None:  # in place: no receive buffer, no copy
                group.broadcast_pieces(target[a:b] for a, b in layout.ranges(control.chunk_len))
                loader.stage.commit_bucket(entries)
                continue
        buf = member.buffers.acquire(control.data_len)
        try:
            group.broadcast_pieces(buf.tensor[a:b] for a, b in layout.ranges(control.chunk_len))
        except BaseException:
            member.buffers.release(buf)
            raise
        if problem is None and control.version != version:
            problem = f"the learner sent weight version {control.version} on {name!r}, the engine expects {version}"
        if problem is None and loader.error is None:
            loader.q.put((layout, buf, member.buffers))
        else:
            member.buffers.release(buf)  # keep reading to the end: the wire stays aligned


def next_message(group: BroadcastGroup) -> tuple[Control, BucketLayout | None]:
    """An engine rank: the next message of a version, (control, the bucket's checked layout) or
    (control, None) at its end; an ABORT raises `VersionAborted` with the learner's reason."""
    name = group.spec.group_name
    control, header = recv_control(group)
    if control.kind == ABORT:
        raise VersionAborted(f"the learner aborted version {control.version} on {name!r}: {header.decode(errors='replace')}")
    if control.kind == END:
        return control, None
    layout = BucketLayout.from_bytes(header)
    if layout.nbytes != control.data_len:
        raise RuntimeError(f"{name!r}: bucket header describes {layout.nbytes} bytes, the control says {control.data_len}")
    return control, layout


def acknowledge(group: BroadcastGroup, problem: str | None) -> None:
    """An engine rank at a version's end: the closing all-reduce (1 if it cannot take the
    version), then `problem` raised as a ValueError."""
    group.all_reduce_sum(1 if problem else 0)
    if problem:
        raise ValueError(problem)


def receiver_for(groups: Sequence[WeightGroup], engine_index: int, **kwargs) -> BroadcastReceiver:
    """The receiver of engine `engine_index` (its rank is `rank_offsets[engine_index]` of the groups)."""
    return BroadcastReceiver(tuple(groups), groups[0].rank_offsets[engine_index], **kwargs)

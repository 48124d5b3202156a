"""SGLang servers as a learner stage's transport: SGLang's HTTP weight-update handshake.

    SGLangTransport(sglang_engine, "10.0.0.1", 29600)  # over SGLang's gloo/NCCL weight group (PP = 1)
    SGLangTensorTransport(sglang_engine)               # servers on this host: through shared memory

SGLang's side of a transfer (its sessions and one request per bucket) is `SGLangWeightUpdate`
(its weight group; `SGLangTransport` drives it with a `BroadcastGroup`) or `SGLangTensorUpdate`
(`/update_weights_from_tensor`, each bucket in shared memory); either is the `WeightTransfer`
that `SGLangEngine.update_weights` sends through while it holds the servers paused.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch

from entr_megatron.rollout.engine import EngineError, WeightSource, WeightUpdateReport
from entr_megatron.rollout.sglang.client import wait_all
from entr_megatron.rollout.sglang.engine import SGLangEngine
from entr_megatron.rollout.sglang.flat_bucket import FlatBucket, iter_flattened_buckets, unpack_flattened_bucket
from entr_megatron.rollout.sglang.tensor_payload import serialize_named_tensors, shared_buffer
from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup, default_backend
from entr_megatron.weight_sync.snapshot import SnapshotBucket, SnapshotStream

__all__ = ["SGLangTensorTransport", "SGLangTensorUpdate", "SGLangTransport", "SGLangWeightUpdate", "SnapshotWeights",
           "WeightSender"]


@runtime_checkable
class WeightSender(Protocol):
    """Rank 0 of an SGLang weight group (the learner side: a `BroadcastGroup`)."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 of the group; returns when it is sent."""
        ...


class _SGLangUpdate:
    """One weight version onto an `SGLangEngine`'s servers within weight-update sessions: open a
    session on every server (`/begin_weight_update`; older servers have none), send the buckets
    (`iter_flattened_buckets`, with the engine config's bucket bytes and dtype; the last one
    carries the version and the cache flush: `_send_buckets`), then close the sessions."""

    share_memory = False
    """Whether the buckets are packed into shared memory (for servers on this host to read)."""

    def __init__(self, engine: SGLangEngine):
        self.engine = engine
        self.sent_buckets = 0
        """Buckets the last `transfer` sent to the servers (`SGLangEngine` holds them paused after a
        failure with one or more: they may hold part of the version)."""
        self._pack_buffers: list[torch.Tensor] = []
        """The two buffers buckets are packed into, kept from version to version (flat_bucket.py)."""

    def transfer(self, weights: WeightSource, version: int) -> tuple[int, int]:
        """Begin the session on every server, send the buckets, end it; (tensors, bytes) sent."""
        servers = self.engine.servers
        timeout = self.engine.config.weight_update_timeout_s
        self.sent_buckets = 0
        # Own threads: a bucket's calls may block until a broadcast, which must not queue behind them.
        # No waiting for them on failure: a broadcast nobody receives may never return.
        pool = cf.ThreadPoolExecutor(len(servers) + 1, thread_name_prefix="sglang-weights")
        try:
            sessions = wait_all([pool.submit(s.begin_weight_update) for s in servers], timeout, "begin_weight_update")

            def end_sessions() -> None:
                wait_all([pool.submit(s.end_weight_update) for s, opened in zip(servers, sessions) if opened],
                         timeout, "end_weight_update")

            try:
                counts = self._send_all(pool, weights, version, timeout)
            except BaseException as e:  # close the sessions anyway, or the next update cannot begin
                try:
                    end_sessions()
                except EngineError as end_error:
                    e.add_note(f"closing the weight-update sessions failed too: {end_error}")
                raise
            end_sessions()
            return counts
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _send_all(self, pool: cf.ThreadPoolExecutor, weights: WeightSource, version: int,
                  timeout: float) -> tuple[int, int]:
        cfg = self.engine.config
        items = weights.items() if isinstance(weights, Mapping) else weights
        dtype = None if cfg.weight_dtype is None else getattr(torch, cfg.weight_dtype)
        buckets = iter_flattened_buckets(items, cfg.weight_bucket_bytes, dtype, buffers=self._pack_buffers,
                                         share_memory=self.share_memory)

        def send(bucket: FlatBucket, flush_cache: bool, weight_version: str | None) -> tuple[int, int]:
            self._send_bucket(pool, bucket, version, flush_cache=flush_cache, weight_version=weight_version,
                              timeout=timeout)
            return len(bucket.names), bucket.num_bytes

        return self._send_in_order(buckets, version, send)

    def _send_in_order(self, buckets: Iterator[Any], version: int,
                       send: Callable[[Any, bool, str | None], tuple[int, int]]) -> tuple[int, int]:
        """`send(bucket, flush_cache, weight_version)` -> (tensors, bytes) for each bucket in turn,
        one bucket looked ahead: the version and the cache flush go on the last one."""
        flush = self.engine.config.kv_on_update == "recompute"  # a pause in place leaves requests that block the flush
        num_tensors = num_bytes = 0
        bucket = next(buckets, None)
        if bucket is None:
            raise ValueError("update_weights got no tensors")
        while bucket is not None:
            following = next(buckets, None)
            last = following is None
            self.sent_buckets += 1
            tensors, nbytes = send(bucket, flush and last, str(version) if last else None)
            num_tensors += tensors
            num_bytes += nbytes
            bucket = following
        return num_tensors, num_bytes

    def _send_bucket(self, pool: cf.ThreadPoolExecutor, bucket: FlatBucket, version: int, *, flush_cache: bool,
                     weight_version: str | None, timeout: float) -> None:
        raise NotImplementedError


class SGLangWeightUpdate(_SGLangUpdate):
    """SGLang's distributed weight-update handshake with an `SGLangEngine`'s servers: the
    `WeightTransfer` its `update_weights` sends through while it holds them paused.

        updates = SGLangWeightUpdate(engine)
        group = updates.init_weights_update_group("10.0.0.1", 29600, backend="nccl", join=learner_joins)
        updates.set_weight_sender(sender)     # rank 0 of `group`: broadcasts one flat bucket at a time
        report = engine.update_weights(hf_state_dict, version=engine.weight_version + 1)

    Each bucket: one `/update_weights_from_distributed` per server while the sender broadcasts
    it. The engine takes the transfer once there are a group and a sender.
    """

    def __init__(self, engine: SGLangEngine):
        super().__init__(engine)
        self.group: WeightGroup | None = None
        self._sender: WeightSender | None = None

    def init_weights_update_group(
        self, master_address: str, master_port: int, *, backend: str = "nccl",
        join: Callable[[WeightGroup], Any] | None = None,
    ) -> WeightGroup:
        """Create the broadcast group: rank 0 is the learner, server i holds ranks
        rank_offsets[i] .. + tp_size - 1. `join(group)` runs concurrently with the servers'
        joins (the learner side, e.g. creating its rank-0 process group and a sender)."""
        engine, cfg = self.engine, self.engine.config
        sizes = engine.tp_sizes()
        offsets = tuple(1 + sum(sizes[:i]) for i in range(len(sizes)))
        group = WeightGroup(master_address, int(master_port), 1 + sum(sizes), cfg.group_name, backend, offsets)
        calls = [
            partial(s.init_weights_update_group, master_address, master_port, off, group.world_size,
                    group.group_name, backend, timeout=cfg.weight_update_timeout_s)
            for s, off in zip(engine.servers, offsets)
        ]
        if join is not None:
            calls.append(partial(join, group))
        _on_threads(calls, cfg.weight_update_timeout_s, "init_weights_update_group")
        self.group = group
        self._attach()
        return group

    def set_weight_sender(self, sender: WeightSender | None) -> None:
        """The rank-0 side of the group that the buckets are broadcast through."""
        if sender is not None and not isinstance(sender, WeightSender):
            raise TypeError(f"weight sender must have broadcast(tensor), got {type(sender).__name__}")
        self._sender = sender
        self._attach()

    def destroy_weights_update_group(self) -> None:
        """Every server leaves the group (the sender's side belongs to whoever made it)."""
        if self.group is None:
            return
        name = self.group.group_name
        _on_threads([partial(s.destroy_weights_update_group, name) for s in self.engine.servers],
                    self.engine.config.request_timeout_s, "destroy_weights_update_group")
        self.group, self._sender = None, None
        self._attach()

    def transfer(self, weights: WeightSource, version: int) -> tuple[int, int]:
        assert self.group is not None and self._sender is not None, \
            "the engine takes the transfer only with a group and a sender"
        return super().transfer(weights, version)

    def _send_bucket(self, pool: cf.ThreadPoolExecutor, bucket: FlatBucket, version: int, *, flush_cache: bool,
                     weight_version: str | None, timeout: float) -> None:
        group, sender = self.group, self._sender
        kwargs = dict(group_name=group.group_name, flush_cache=flush_cache, weight_version=weight_version,
                      timeout=timeout)
        if self.engine.config.flattened_buckets:
            tensors = [bucket.flat]
            kwargs["load_format"] = "flattened_bucket"
        else:
            tensors = [t for _, t in unpack_flattened_bucket(bucket)]
            kwargs["load_format"] = None
        calls = [pool.submit(s.update_weights_from_distributed, bucket.names, bucket.dtypes, bucket.shapes, **kwargs)
                 for s in self.engine.servers]
        calls.append(pool.submit(lambda ts=tensors: [sender.broadcast(t) for t in ts]))
        wait_all(calls, timeout, f"update_weights_from_distributed (version {version})")

    def _attach(self) -> None:
        self.engine.set_weight_transfer(self if self.group is not None and self._sender is not None else None)


class SGLangTensorUpdate(_SGLangUpdate):
    """SGLang servers on this host take each bucket from shared memory: one
    `/update_weights_from_tensor` per server whose body says where the bucket's tensors lie
    (`tensor_payload`); the server copies them into its parameters before it answers. No
    weight group, no byte on a wire (SGLang's colocated path, through CUDA IPC on GPUs; here
    through torch's file_system shared memory).

        updates = SGLangTensorUpdate(engine).attach()
        report = engine.update_weights(hf_state_dict, version=engine.weight_version + 1)

    Tensors of a state dict are packed into two shared buffers kept from version to version; a
    `SnapshotWeights` whose buffers lie in shared memory (`SGLangTensorTransport`) is sent bucket by
    bucket where it lies, each bucket released once every server loaded it.
    """

    share_memory = True

    def attach(self) -> SGLangTensorUpdate:
        self.engine.set_weight_transfer(self)
        return self

    def detach(self) -> None:
        self.engine.set_weight_transfer(None)

    def _send_all(self, pool: cf.ThreadPoolExecutor, weights: WeightSource, version: int,
                  timeout: float) -> tuple[int, int]:
        if not isinstance(weights, SnapshotWeights) or not weights.shared:
            return super()._send_all(pool, weights, version, timeout)  # packed into shared buffers first
        # The snapshot's own buckets, in shared memory: each sent where it lies, no copy of ours.
        def send(bucket: SnapshotBucket, flush_cache: bool, weight_version: str | None) -> tuple[int, int]:
            self._send_named(pool, bucket.views(), version, flush_cache=flush_cache, weight_version=weight_version,
                             timeout=timeout)
            bucket.release()
            return len(bucket.layout.names), bucket.layout.nbytes

        buckets = weights.buckets()
        try:
            return self._send_in_order(buckets, version, send)
        finally:
            buckets.close()

    def _send_bucket(self, pool: cf.ThreadPoolExecutor, bucket: FlatBucket, version: int, *, flush_cache: bool,
                     weight_version: str | None, timeout: float) -> None:
        self._send_named(pool, unpack_flattened_bucket(bucket), version, flush_cache=flush_cache,
                         weight_version=weight_version, timeout=timeout)  # views of the shared pack buffer

    def _send_named(self, pool: cf.ThreadPoolExecutor, named: list[tuple[str, torch.Tensor]], version: int, *,
                    flush_cache: bool, weight_version: str | None, timeout: float) -> None:
        def call(server, tp_size: int):  # one payload per TP rank: a rank's rebuild uses its references up
            return server.update_weights_from_tensor([serialize_named_tensors(named) for _ in range(tp_size)],
                                                     flush_cache=flush_cache, weight_version=weight_version,
                                                     timeout=timeout)

        calls = [pool.submit(call, s, n) for s, n in zip(self.engine.servers, self.engine.tp_sizes())]
        wait_all(calls, timeout, f"update_weights_from_tensor (version {version})")


def _on_threads(calls: Sequence[Callable[[], Any]], timeout: float, what: str) -> None:
    """Run the calls at once, each on a thread of its own (they may wait for each other, as the
    ranks joining a group do); the first failure or a timeout raises, without waiting for the rest."""
    pool = cf.ThreadPoolExecutor(len(calls), thread_name_prefix="sglang-weights")
    try:
        wait_all([pool.submit(call) for call in calls], timeout, what)
    finally:
        pool.shutdown(wait=False)


class _SGLangTransportBase:
    """What both SGLang transports share: the snapshot cut the handshake's way, and one
    `SGLangEngine.update_weights` per version (pause, transfer, resume)."""

    layout = "checkpoint"
    buffer_allocator = None
    """The snapshot's buffers: host memory (`SGLangTensorTransport`: shared memory)."""

    def __init__(self, engine: SGLangEngine):
        self.engine = engine

    def requirements(self) -> dict[str, Any]:
        return {"bucket_bytes": self.engine.config.weight_bucket_bytes, "dtype": self.engine.config.weight_dtype}

    def can_borrow(self, tensor) -> bool:
        """Any tensor: the handshake packs each bucket (a copy) itself."""
        return True

    def connect(self) -> None:
        raise NotImplementedError

    def send(self, version: int, stream: SnapshotStream) -> list[WeightUpdateReport]:
        self.connect()
        stream.wait_settled()
        weights = SnapshotWeights(stream, shared=self.buffer_allocator is not None)
        try:
            return [self.engine.update_weights(weights, version)]
        finally:
            weights.close()  # gives back the buffers still held, also when the engine stopped early


class SGLangTransport(_SGLangTransportBase):
    """SGLang servers through `SGLangWeightUpdate` (group, session, one
    `/update_weights_from_distributed` per flattened bucket, version on the last one)
    and `SGLangEngine.update_weights` (pause, resume), with a `BroadcastGroup` at rank 0
    as the `WeightSender`.

    The handshake cuts buckets itself (`iter_flattened_buckets`): the snapshot is cut the
    same way (`requirements`: its bucket size and dtype), so each of our buffers is
    released as soon as that bucket is packed. Servers pause for the whole
    transfer (SGLang has no staging copy), so the transfer starts only once the snapshot
    is complete or has filled its buffers. One learner stage only (PP = 1): `SGLangEngine` holds one
    group, and two stages updating it independently would each pause and resume the servers.
    """

    def __init__(self, engine: SGLangEngine, master_address: str, master_port: int, *,
                 backend: str | None = None, timeout_s: float = 600.0):
        super().__init__(engine)
        self.master_address, self.master_port = master_address, int(master_port)
        self.backend, self.timeout_s = backend or default_backend(), timeout_s
        self.updates = SGLangWeightUpdate(engine)
        self.group: BroadcastGroup | None = None

    def connect(self) -> None:
        if self.group is None:
            self.updates.init_weights_update_group(
                self.master_address, self.master_port, backend=self.backend, join=self._join
            )
            self.updates.set_weight_sender(self.group)

    def _join(self, spec: WeightGroup) -> None:
        self.group = BroadcastGroup.join(spec, 0, timeout_s=self.timeout_s)

    def close(self) -> None:
        if self.group is not None:
            try:
                self.updates.destroy_weights_update_group()
            except EngineError:
                pass  # the servers may be gone already
            self.group.close()
            self.group = None


class SGLangTensorTransport(_SGLangTransportBase):
    """SGLang servers on the learner's host (`rollout.placement: colocated`) through
    `SGLangTensorUpdate`: the snapshot's buffers lie in shared memory (`buffer_allocator`), and each
    bucket is read by the servers where it lies, one `/update_weights_from_tensor` per server: the
    learner's snapshot copy is the only one. No group to join; the same sessions, pause and resume
    as `SGLangTransport`. /dev/shm must hold the snapshot (`max_buckets_in_flight` buckets, or one
    copy of the weights)."""

    buffer_allocator = staticmethod(shared_buffer)

    def can_borrow(self, tensor) -> bool:
        """Never: a learner's parameter does not lie in shared memory."""
        return False

    def __init__(self, engine: SGLangEngine):
        super().__init__(engine)
        self.updates: SGLangTensorUpdate | None = None

    def connect(self) -> None:
        if self.updates is None:
            self.updates = SGLangTensorUpdate(self.engine).attach()

    def close(self) -> None:
        if self.updates is not None:
            self.updates.detach()
            self.updates = None


class SnapshotWeights:
    """A version's snapshot as the `WeightSource` an `SGLangEngine` update takes: (name, view) pairs
    when iterated (for a transfer that packs them; `iter_flattened_buckets` copies a bucket when it
    receives the first tensor of the next one, so once we are resumed after yielding that tensor,
    the buckets before it are free), or the buckets themselves (`buckets`: `SGLangTensorUpdate`
    sends those in shared memory where they lie, and releases each once sent)."""

    def __init__(self, stream: SnapshotStream, shared: bool = False):
        self.stream, self.shared = stream, shared
        """shared: the buckets' buffers lie in shared memory (the transport's `buffer_allocator`)."""
        self._held: list[SnapshotBucket] = []
        self._iterators: list[Iterator] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        it = self._pairs()
        self._iterators.append(it)
        return it

    def buckets(self) -> Iterator[SnapshotBucket]:
        """Each bucket once copied; the consumer releases it (`close` releases those it did not)."""
        it = self._buckets()
        self._iterators.append(it)
        return it

    def close(self) -> None:
        for it in self._iterators:
            it.close()
        for b in self._held:
            b.release()
        self._held.clear()

    def _buckets(self) -> Iterator[SnapshotBucket]:
        for bucket in self.stream:
            self._held.append(bucket)
            if bucket.wait_filled():  # else the learner failed copying it: the stream raises next
                yield bucket

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self._buckets():
            for i, item in enumerate(bucket.views()):
                yield item
                if i == 0:
                    for old in self._held[:-1]:
                        old.release()
                    del self._held[:-1]

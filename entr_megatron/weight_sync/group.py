"""The broadcast group of one pipeline stage: its learner sender (rank 0) and every engine rank.

    groups = stage_groups("10.0.0.1", 29600, pp_size=2, engine_ranks=(1,))   # one WeightGroup per stage
    group = BroadcastGroup.join(groups[pp_rank], rank=0)                      # blocks until all ranks joined
    group.broadcast(flat_uint8)                                               # from rank 0
    group.broadcast_chunks(flat_uint8, 64 << 20)                              # the same, in pipelined slices
    group.broadcast_pieces(tensors)                                           # several tensors, pipelined
    group.close()

Built directly from a `TCPStore` (rank 0 hosts it) and the backend class,
independent of any default process group: the learner's stays untouched and the
engines' processes need none. The store keys are laid out the way SGLang's
`init_custom_process_group` lays out its side (prefixes `group_name`,
`"<group_name>/"`, `"<device>/"`), so a learner-side group pairs with SGLang
servers' ranks. NCCL on GPU, gloo on CPU, the same code: only the device of the
tensors on the wire changes (`BroadcastGroup.device`).

What listens: rank 0's store on `WeightGroup.bind_address` (None: the master address,
127.0.0.1 for a one-node run; see `utils.spawn.tcp_store`), and each rank's gloo pairs on its
own node's address when its launcher said it (Ray: `utils.node_address`), else on 127.0.0.1 when
the master address is loopback (GLOO_SOCKET_IFNAME, when set, wins), else on gloo's choice of
interface. Neither authenticates its peers: on a shared network
keep the master address on an interface only the job's nodes reach.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from entr_megatron.utils.node_address import gloo_address
from entr_megatron.utils.spawn import tcp_store

__all__ = ["BACKENDS", "BroadcastGroup", "WeightGroup", "default_backend", "stage_groups"]

BACKENDS = ("gloo", "nccl")
CHUNKS_IN_FLIGHT = 2
"""`broadcast_pieces`: pieces issued at once on NCCL and on a one-connection gloo group (torch's
default gloo group runs two collectives at a time)."""
GLOO_STREAMS = 2
"""`stage_groups` with gloo: TCP connections per pair of ranks. Consecutive pieces alternate
between them, so one piece's hand-shake overlaps another's bytes (measured on loopback, 2 cores:
64 MiB pieces at 1.3-1.6x the rate of one broadcast over one connection; see bench_weight_sync)."""
GLOO_THREADS_PER_STREAM = 4
"""Worker threads (and pieces in flight) per connection of a multi-stream gloo group: with 4
rather than torch's 2, 4-16 MiB pieces (one tensor each, `snapshot="borrow"`) move 1.2-1.4x faster."""
TORCH_GLOO_THREADS = 2
"""Worker threads of torch's own one-connection gloo group (ProcessGroupGloo::Options)."""
# The backend `_new_process_group_helper` (torch 2.13 and 2.14) creates for one backend name on
# SGLang's side: one, under the store prefix of the first device the backend supports (it registers
# that one for the others), and its rendezvous waits for every rank: ours must use the same prefix.
# A second gloo backend under "cuda/" (as once here) waits for a peer that never comes: seen against
# a real SGLang 0.5.23 server, whose /init_weights_update_group answered while our join hung.
_BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}


@dataclass(frozen=True)
class WeightGroup:
    """A broadcast group shared by the learner (rank 0) and every engine rank (an SGLang
    server's group too: its side is SGLang's `init_custom_process_group`)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    rank_offsets: tuple[int, ...]
    """First rank of each engine (engine i holds rank_offsets[i] .. + its ranks - 1)."""
    streams: int = 1
    """gloo: TCP connections between each pair of ranks, used in turn by consecutive broadcasts
    (`stage_groups`); 1 for SGLang's groups, whose side opens one."""
    bind_address: str | None = None
    """Where rank 0's store listens. None: `master_address` only (the address the others dial);
    "0.0.0.0" (or "", "::"): every interface, as torch's own TCPStore."""


def default_backend() -> str:
    """NCCL where CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def stage_groups(
    master_address: str,
    base_port: int,
    pp_size: int,
    engine_ranks: Sequence[int] = (1,),
    *,
    backend: str | None = None,
    group_name: str = "entr_weights",
    streams: int | None = None,
) -> tuple[WeightGroup, ...]:
    """One `WeightGroup` per pipeline stage: stage p on port `base_port + p`, named `<group_name>_pp<p>`.

    engine_ranks: the ranks each engine holds in every group (the learner sender is rank 0;
    an embedded engine holds one rank, an SGLang server `tp_size` consecutive ones); the
    group's size is 1 + their total. streams: gloo connections per pair of ranks (None:
    `GLOO_STREAMS`; NCCL: always 1, it has its own channels).
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if not engine_ranks or min(engine_ranks) < 1:
        raise ValueError(f"engine_ranks must give every engine at least one rank, got {tuple(engine_ranks)}")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int) or streams < 1):
        raise ValueError(f"streams must be a positive int, got {streams!r}")
    streams = 1 if backend == "nccl" else (streams or GLOO_STREAMS)
    offsets = tuple(1 + sum(engine_ranks[:i]) for i in range(len(engine_ranks)))
    world = 1 + sum(engine_ranks)
    return tuple(
        WeightGroup(master_address, base_port + p, world, f"{group_name}_pp{p}", backend, offsets, streams)
        for p in range(pp_size)
    )


class BroadcastGroup:
    """One rank's membership of a weight broadcast group (see the module docstring).

    Thread use: one thread at a time issues collectives (the sender thread, or the
    receiving thread of one group); `broadcast` also serves as SGLang's `WeightSender`.
    """

    def __init__(self, spec: WeightGroup, rank: int, backends: dict, store, device: torch.device):
        self.spec, self.rank, self.device = spec, rank, device
        self._backends, self._store = backends, store
        self._pg = backends[device.type]
        self._staging: torch.Tensor | None = None  # device copy of host tensors (NCCL)
        multi = spec.backend == "gloo" and spec.streams > 1
        self.in_flight = GLOO_THREADS_PER_STREAM * spec.streams if multi else CHUNKS_IN_FLIGHT
        """`broadcast_pieces`: pieces issued at once."""
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def join(cls, spec: WeightGroup, rank: int, *, timeout_s: float = 600.0,
             join_timeout_s: float | None = None) -> BroadcastGroup:
        """Create this rank's side; blocks until every rank of the group has joined (or
        `join_timeout_s`, default `timeout_s`); `timeout_s` bounds each collective afterwards."""
        if spec.backend not in BACKENDS:
            raise ValueError(f"WeightGroup.backend must be one of {BACKENDS}, got {spec.backend!r}")
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside the group {spec.group_name!r} of size {spec.world_size}")
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError(f"group {spec.group_name!r}: backend nccl needs CUDA; use gloo on CPU")
        timeout = datetime.timedelta(seconds=timeout_s)
        joining = timeout if join_timeout_s is None else datetime.timedelta(seconds=min(join_timeout_s, timeout_s))
        store = tcp_store(spec.master_address, spec.master_port, spec.world_size, rank == 0, joining,
                          bind_address=spec.bind_address, multi_tenant=True)
        gloo_host = _gloo_hostname(spec)
        group_store = dist.PrefixStore(f"{spec.group_name}/", dist.PrefixStore(spec.group_name, store))
        device_type = _BACKEND_DEVICES[spec.backend]
        device_store = dist.PrefixStore(f"{device_type}/", group_store)
        if spec.backend == "gloo":
            # gloo's rendezvous waits as long as its group's timeout: the join's, then the collectives'
            backend = _gloo_group(device_store, rank, spec.world_size, joining, spec.streams, gloo_host)
            backend._set_default_timeout(timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(device_store, rank, spec.world_size, options)
        backends = {device_type: backend}
        device = torch.device("cpu") if spec.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        return cls(spec, rank, backends, store, device)

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast `tensor` (contiguous) from group rank `src`, in place on the others; returns when done.
        A tensor not on the wire's device goes through a device staging copy."""
        assert tensor.is_contiguous(), "broadcast needs a contiguous tensor"
        if tensor.device == self.device or (self.device.type == "cpu" and tensor.device.type == "cpu"):
            self._wait(self._pg.broadcast([tensor], _broadcast_options(src)))
            return
        staged = self._staging_view(tensor)
        if self.rank == src:
            staged.copy_(tensor, non_blocking=True)
        self._wait(self._pg.broadcast([staged], _broadcast_options(src)))
        if self.rank != src:
            tensor.copy_(staged)
        torch.cuda.current_stream(self.device).synchronize()

    def broadcast_chunks(self, flat: torch.Tensor, chunk_bytes: int, src: int = 0,
                         ready: Callable[[int], object] | None = None) -> None:
        """Broadcast a flat uint8 tensor as consecutive slices of `chunk_bytes` (<= 0: one)
        through `broadcast_pieces`. On rank `src`, `ready(end)` is called before sending the
        slice that ends at byte `end` (e.g. to wait until it is written). Every rank must use
        the same `chunk_bytes`."""
        assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.is_contiguous(), "broadcast_chunks needs flat uint8"
        n = flat.numel()
        chunk = n if chunk_bytes <= 0 else max(1, min(chunk_bytes, n))

        def pieces():
            for start in range(0, max(n, 1), chunk):
                end = min(n, start + chunk)
                if ready is not None and self.rank == src:
                    ready(end)
                yield flat[start:end]

        self.broadcast_pieces(pieces(), src)

    def broadcast_pieces(self, pieces: Iterable[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor of `pieces` in turn (contiguous; every rank gives tensors of the
        same sizes in the same order: the sender its data, the others where it lands), with
        `in_flight` of them issued at once: a receiver has posted the next piece before
        the current one ends, so the stream does not stall between them (with one at a time it
        does, each piece paying several thread wake-ups on both sides). The iterator is advanced
        only when a piece may be issued, so the sender's may block until its next piece is
        ready. A piece not on the wire's device goes through the device staging copy, one at a time."""
        pending: deque = deque()
        try:
            for piece in pieces:
                assert piece.is_contiguous(), "broadcast_pieces needs contiguous tensors"
                if not (piece.device == self.device or (self.device.type == "cpu" and piece.device.type == "cpu")):
                    while pending:  # the staging copy is one buffer: drain first
                        self._wait(pending.popleft())
                    self.broadcast(piece, src)
                    continue
                pending.append(self._pg.broadcast([piece], _broadcast_options(src)))
                if len(pending) >= self.in_flight:
                    self._wait(pending.popleft())
            while pending:
                self._wait(pending.popleft())
        finally:
            for work in pending:  # after an error: do not leave a buffer to a collective in flight
                try:
                    work.wait()
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass

    def all_reduce_sum(self, value: int) -> int:
        """Sum of one integer over every rank (the end-of-version acknowledgement)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._wait(self._pg.allreduce([t]))
        return int(t.item())

    def _wait(self, work) -> None:
        work.wait()
        if self.device.type == "cuda":  # the NCCL stream, not only the host, must be done with the buffer
            torch.cuda.current_stream(self.device).synchronize()

    def _staging_view(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging[:nbytes].view(tensor.dtype).view(tensor.shape)

    def close(self) -> None:
        """Drop the backends and the store connection (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for pg in self._backends.values():
                shutdown = getattr(pg, "shutdown", None)
                if shutdown is not None and self.spec.backend == "nccl":
                    shutdown()
            self._backends.clear()
            self._pg = self._store = self._staging = None


def _gloo_hostname(spec: WeightGroup) -> str | None:
    """The address this rank's gloo pairs listen on (`utils.node_address.gloo_address`): this
    node's address when the launcher said it (Ray), else loopback when every rank dials a loopback
    master; None: gloo's own choice (GLOO_SOCKET_IFNAME, else the host name's address)."""
    return gloo_address(spec.master_address)


def _gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta, streams: int,
                hostname: str | None = None):
    """A gloo process group with `streams` TCP connections per pair of ranks (torch's constructor
    opens one; collectives take them in turn by their tag) and `GLOO_THREADS_PER_STREAM` worker
    threads per connection (torch's 2 with one connection), on `hostname`'s address, or on the
    interface(s) of GLOO_SOCKET_IFNAME or the host's default one."""
    if streams == 1 and hostname is None:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if ifnames:
        devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in ifnames for _ in range(streams)]
    elif hostname is not None:
        devices = [dist.ProcessGroupGloo.create_device(hostname=hostname) for _ in range(streams)]
    else:
        devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(streams)]
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = devices
    options._threads = GLOO_THREADS_PER_STREAM * len(devices) if streams > 1 else TORCH_GLOO_THREADS
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _broadcast_options(src: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts

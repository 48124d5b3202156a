"""Colocated weight handoff: the learner writes each bucket straight into the engine's staging copy.

With ``rollout.placement: colocated`` an engine runs beside the learner stage that feeds it, on
the same host. The version still follows the bucket protocol of protocol.py on
the stage's group (control messages, the closing all-reduce, ABORT), but no bucket byte crosses
the group: each engine answers a bucket's header with a handle to the memory the bucket must land
in, and the learner copies the bucket there itself.

    per bucket:  control (BUCKET, version, header bytes, data bytes, chunk bytes) + header   learner -> all
                 for each engine rank r in turn:  int64[1] = n, uint8[n] = its handle (JSON) r -> all
                 the learner copies the bucket's bytes into every handle's memory
    the next message (BUCKET, END or ABORT) tells the engines the bytes are there: they commit them.
    at the end:  control (END, ...) and the all-reduce of refusals, as on the broadcast path.

The memory is the engine's `WeightStage` itself (`WeightStage.bucket_buffer`, allocated shared here):
the one copy of a version is learner parameter -> engine stage (with ``weight_snapshot: borrow``,
the default; 'copy' adds the learner's snapshot copy), against parameter -> wire -> stage on the
broadcast path. A bucket that cannot land in place (a cast on receipt, tied names) lands in a
shared scratch buffer that the engine then loads into its stage.

Handles (``share_handle`` / ``open_handle``): the POSIX shared-memory file that torch made for the
storage (``share_memory_()``, torch.multiprocessing's file-descriptor strategy), opened by the
learner through ``/proc/<engine pid>/fd/<fd>`` and checked by inode: nothing is named in /dev/shm,
so nothing outlives the two processes; both must run as one user on one host (one PID namespace).
The learner keeps its mappings between versions (an engine alternates between two buffers per
bucket, its stage's and its model's, swapped each version: a fresh mapping would fault in every
page again) and drops those that the last two versions did not use.

An engine on the CPU keeps its staging copy in host memory: a learner on a GPU copies each bucket
device-to-host straight into it (no NCCL group: the control messages go over gloo), which is how a
run fits on one GPU. An engine on the GPU (rollout.embedded.device 'cuda') keeps it in device
memory and hands out CUDA IPC handles instead (the storage's ``_share_cuda_``, what
torch.multiprocessing's ``reduce_tensor`` sends): the learner opens each allocation once and
copies device-to-device, then waits for its copies before the next message tells the engine the
bytes are there. Both processes must see the GPU under the same index (one CUDA_VISIBLE_DEVICES).
SGLang keeps its own path.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from typing import Any

import torch

from entr_megatron.rollout.weights import BucketEntry, WeightBucket, WeightStage
from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup
from entr_megatron.weight_sync.receiver import BroadcastReceiver, acknowledge, joined_group, next_message
from entr_megatron.weight_sync.snapshot import SnapshotBucket, SnapshotFailed
from entr_megatron.weight_sync.transports import BucketTransport

__all__ = ["ColocatedReceiver", "ColocatedTransport", "map_storage", "open_handle", "share_handle", "shared_bytes",
           "staging_bytes"]


def shared_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in shared memory, which another process can map (`share_handle`)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(nbytes, 1)), 0, (nbytes,))


def staging_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of `nbytes` on `device` that another process of this host can map: host
    shared memory (`shared_bytes`) on the CPU, a plain allocation on a GPU (CUDA IPC opens it)."""
    if device.type == "cpu":
        return shared_bytes(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def share_handle(flat: torch.Tensor) -> dict[str, Any]:
    """A JSON-able handle to the bytes of `flat` (contiguous uint8 in host shared memory, or in
    GPU memory) for `open_handle` in another process of this host: its storage's shared file, or
    its CUDA IPC handle."""
    assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.is_contiguous()
    storage = flat.untyped_storage()
    offset = flat.data_ptr() - storage.data_ptr()
    if flat.device.type == "cuda":
        device, ipc, size, storage_offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
        return {"kind": "cuda", "pid": os.getpid(), "device": int(device), "ipc": _b64(ipc), "size": int(size),
                "storage_offset": int(storage_offset), "counter": _b64(counter), "counter_offset": int(counter_offset),
                "event": _b64(event), "event_sync": bool(event_sync), "offset": offset, "nbytes": flat.numel()}
    if flat.device.type != "cpu" or not storage.is_shared():
        raise ValueError("share_handle: the tensor is not in shared memory (allocate it with shared_bytes)")
    fd, size = storage._share_fd_cpu_()[:2]  # the file torch.multiprocessing passes for this storage
    return {"kind": "fd", "pid": os.getpid(), "fd": int(fd), "inode": os.fstat(fd).st_ino,
            "size": int(size), "offset": offset, "nbytes": flat.numel()}


def open_handle(handle: dict[str, Any]) -> torch.Tensor:
    """The uint8 tensor a `share_handle` describes, mapped into this process (writes are seen by
    the owner). Raises a ValueError naming the problem when it cannot be opened."""
    return map_storage(handle)[handle["offset"]:handle["offset"] + handle["nbytes"]]


def map_storage(handle: dict[str, Any]) -> torch.Tensor:
    """The whole shared storage a `share_handle` points into, mapped here as uint8 (one mapping
    serves every handle into that storage: slice it at the handle's offset)."""
    kind = handle.get("kind")
    if kind == "cuda":
        return _map_cuda(handle)
    if kind != "fd":
        raise ValueError(f"unknown shared-memory handle kind {kind!r} (expected 'fd' or 'cuda')")
    path = f"/proc/{handle['pid']}/fd/{handle['fd']}"
    try:
        inode = os.stat(path).st_ino
    except OSError as e:
        raise ValueError(f"cannot open the engine's shared weights at {path} ({e.strerror}): colocated "
                         "placement needs the engine on this host, as this user, in this PID namespace") from e
    if inode != handle["inode"]:
        raise ValueError(f"{path} is no longer the engine's shared weight buffer (inode {inode}, "
                         f"expected {handle['inode']})")
    return torch.from_file(path, shared=True, size=handle["size"], dtype=torch.uint8)


def _map_cuda(handle: dict[str, Any]) -> torch.Tensor:
    """The engine's GPU allocation behind a "cuda" handle, opened here through CUDA IPC."""
    device = handle["device"]
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise ValueError(f"the engine's weights are on GPU {device}, which this process cannot see "
                         f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices): "
                         "colocated placement needs the learner and the engine on one host with the same "
                         "CUDA_VISIBLE_DEVICES")
    torch.cuda._lazy_init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device, _unb64(handle["ipc"]), handle["size"], handle["storage_offset"], _unb64(handle["counter"]),
            handle["counter_offset"], _unb64(handle["event"]), handle["event_sync"])
    except RuntimeError as e:
        raise ValueError(f"cannot open the engine's GPU weights (CUDA IPC, engine pid {handle['pid']}): {e}") from e
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (handle["size"],))


def _release_unused(handle: dict[str, Any]) -> None:
    """A "cuda" handle of an allocation mapped here already: drop the reference count the engine
    took for it when sharing (torch.multiprocessing does the same), else the engine could never
    free that memory."""
    if handle.get("kind") == "cuda":
        torch.UntypedStorage._release_ipc_counter(_unb64(handle["counter"]), handle["counter_offset"],
                                                  device=handle["device"])


def exchange_handles(group: BroadcastGroup, handle: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    """Every engine rank (1 .. world-1, in order) broadcasts its handle for the current bucket
    (None: it takes no bytes of it); every member gets them all, the learner (rank 0) gives None."""
    out: list[dict[str, Any] | None] = []
    for src in range(1, group.world_size):
        mine = json.dumps(handle).encode() if src == group.rank else b""
        n = torch.tensor([len(mine)], dtype=torch.int64)
        group.broadcast(n, src)
        buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else torch.empty(int(n), dtype=torch.uint8)
        if int(n):
            group.broadcast(buf, src)
        out.append(json.loads(buf.numpy().tobytes()) if int(n) else None)
    return out


def _key(handle: dict[str, Any]) -> tuple:
    """One engine storage (several handles may point into it, at different offsets)."""
    if handle.get("kind") == "cuda":
        return "cuda", handle["pid"], handle["device"], handle["ipc"], handle["storage_offset"], handle["size"]
    return handle["pid"], handle["fd"], handle["inode"], handle["size"]


class ColocatedTransport(BucketTransport):
    """The learner stage's side (rank 0): `BucketTransport`'s messages, each bucket copied into the
    engines' memory instead of broadcast. Sends the same versions, aborts and refusals."""

    def __init__(self, group: WeightGroup, **kwargs):
        super().__init__(group, **kwargs)
        self._mapped: dict[tuple, torch.Tensor] = {}  # storage key -> the engine's whole storage, mapped here
        self._last_used: dict[tuple, int] = {}  # handle key -> the last version (counted here) that used it
        self._versions = 0
        self.copies = 0
        """Bucket copies made so far (one per bucket and engine that took it)."""
        self.last_copies = 0
        """Those of the last `send` (the learner's `weight_sync/colocated_copies` metric)."""

    def send(self, version: int, stream) -> list:
        before = self.copies
        try:
            return super().send(version, stream)
        finally:
            self.last_copies = self.copies - before

    def can_borrow(self, tensor) -> bool:
        return True  # the learner copies every tensor itself, from wherever it is

    def _send_data(self, group: BroadcastGroup, bucket: SnapshotBucket) -> None:
        targets = []
        for handle in exchange_handles(group, None):
            if handle is None:
                continue
            key = _key(handle)
            if key in self._mapped:
                _release_unused(handle)
            else:
                try:
                    self._mapped[key] = map_storage(handle)
                except ValueError as e:  # the wire is fine: the version is aborted, the engines told why
                    raise SnapshotFailed(f"colocated weight handoff: {e}") from e
            self._last_used[key] = self._versions
            targets.append(self._mapped[key][handle["offset"]:handle["offset"] + handle["nbytes"]])
        ranges = bucket.layout.ranges(self.chunk_bytes)
        for (a, b), piece in zip(ranges, bucket.pieces(self.chunk_bytes)):
            for target in targets:
                target[a:b].copy_(piece)  # into host memory from a GPU learner: device-to-host, synchronous
        for device in {t.device for t in targets if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)  # the next message tells the engine its bytes are there
        self.copies += len(targets)

    def _version_done(self) -> None:
        for key, last in list(self._last_used.items()):  # buffers the engines no longer hand out
            if last < self._versions - 1:
                del self._mapped[key], self._last_used[key]
        self._versions += 1

    def close(self) -> None:
        self._mapped.clear()
        self._last_used.clear()
        super().close()


class _SharedScratch:
    """The engine's receive buffer for buckets that cannot land in its stage (grown as needed)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buf: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = staging_bytes(nbytes, self.device)
        return self.buf[:nbytes]


_SCRATCH: dict[tuple, _SharedScratch] = {}
_SCRATCH_LOCK = threading.Lock()


class ColocatedReceiver(BroadcastReceiver):
    """The engine's side: answers each bucket with a handle to its stage's memory (see the module
    docstring). Pickles to the engine process like `BroadcastReceiver`, and joins the same groups."""

    def receive(self, stage: WeightStage) -> None:
        device = stage.device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"a colocated engine keeps its weights in host or GPU memory; this one holds them "
                             f"on {device}")
        stage.flat_allocator = lambda nbytes: staging_bytes(nbytes, device)

        def receive_one(spec: WeightGroup) -> None:
            with _SCRATCH_LOCK:
                scratch = _SCRATCH.setdefault((spec.group_name, self.rank), _SharedScratch(device))
            _receive_colocated(joined_group(spec, self.rank, timeout_s=self.timeout_s), stage, scratch)

        self.on_every_group(receive_one)


def _receive_colocated(group: BroadcastGroup, stage: WeightStage, scratch: _SharedScratch) -> None:
    """One version's messages on one group, to the end, whatever goes wrong meanwhile."""
    name, version = group.spec.group_name, stage.version
    problem: str | None = None
    pending: tuple[tuple[BucketEntry, ...], torch.Tensor | None] | None = None  # written by the learner

    def commit() -> str | None:
        entries, scratch_bytes = pending
        try:
            if scratch_bytes is None:
                stage.commit_bucket(entries)
            else:
                stage.load_bucket(WeightBucket(entries, scratch_bytes))
        except ValueError as e:
            return str(e)
        return None

    while True:
        control, layout = next_message(group)
        if pending is not None:  # any next message means the learner finished the last bucket's copy
            problem = problem or commit()
            pending = None
        if layout is None:  # the end of the version
            acknowledge(group, problem)
            return
        if problem is None and control.version != version:
            problem = f"the learner sent weight version {control.version} on {name!r}, the engine expects {version}"
        handle = None
        if problem is None:
            entries = layout.entries()
            target = stage.bucket_buffer(entries, layout.nbytes)
            if target is None:  # lands beside the stage; loaded (and checked) once written
                target = scratch.take(layout.nbytes)
                pending = (entries, target)
            else:
                pending = (entries, None)
                storage = target.untyped_storage()
                if target.device.type == "cpu" and not storage.is_shared():
                    storage.share_memory_()  # a staged tensor already in place, e.g. alone in its bucket: moved once
            handle = share_handle(target)
        exchange_handles(group, handle)

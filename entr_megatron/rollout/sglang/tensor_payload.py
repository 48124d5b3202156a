"""The body of SGLang's `/update_weights_from_tensor` for a server on this host: named tensors
whose bytes stay in shared memory, the request carrying only where they lie.

SGLang reads each entry of `serialized_named_tensors` (one per TP rank of the server) as
base64 of a pickle of [(name, tensor), ...] (its `MultiprocessingSerializer`), unpickled by its
`SafeUnpickler`, which admits torch's tensor and storage rebuild functions and nothing of ours.
A CPU tensor travels as torch's `file_system` sharing strategy writes it: the storage's
shared-memory file name and the name of this process's torch_shm_manager socket, so that the
server maps the same pages and copies them into its parameters within the request. We write that
pickle ourselves (`serialize_named_tensors`) rather than set torch's process-wide sharing
strategy: torch's default, `file_descriptor`, sends a descriptor through a socket of the
sender's, which made SGLang 0.5.23's scheduler die, taking the server with it
(docs/SGLANG_ON_CPU.md). The pickle names only torch's rebuild functions and
`torch.Tensor`, so it unpickles with SGLang's own torch, whatever its version (2.14.1 beside our
2.13.0).

    flat = shared_buffer(nbytes)                       # once: bucket buffers kept from version to version
    body = serialize_named_tensors([(name, view), ...])  # per request and per TP rank
    named = deserialize_named_tensors(body)            # the server's side (the protocol mock, tests)

Each pickled storage holds a reference to its shared-memory file until the server has rebuilt it
(torch's `_shared_incref`, dropped by the server's rebuild), so a request the server never read
keeps the file until this process exits. The tensors must stay unchanged until the request
returns: SGLang copies them into its parameters before it answers.

torch forks and execs its torch_shm_manager at this process's first file_system share. The
manager lives until every process that mapped our memory has exited, the server included, so it
outlives us. It would inherit our stdin, our stderr and every descriptor a C++ library left
inheritable (gloo's, and copies of our stdout and stderr), and a caller reading our output through
a pipe (`subprocess.run(..., capture_output=True)`, `train ... | tee`) would wait for the server's
end. `shared_buffer` starts it holding none of them.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import threading
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import rebuild_storage_filename, rebuild_tensor, rebuild_typed_storage

__all__ = ["deserialize_named_tensors", "serialize_named_tensors", "shared_buffer"]

PICKLE_PROTOCOL = 4
"""SGLang checks that a raw payload starts like a pickle of protocol <= its HIGHEST_PROTOCOL."""


_manager_lock = threading.Lock()
_manager_started = False


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in file-backed shared memory (torch's file_system strategy)."""
    global _manager_started
    _check_room(int(nbytes))
    flat = torch.empty(int(nbytes), dtype=torch.uint8)
    with _manager_lock:
        if _manager_started:
            flat.untyped_storage()._share_filename_cpu_()
        else:
            _inheriting_nothing(flat.untyped_storage()._share_filename_cpu_)
            _manager_started = True
    return flat


SHM_DIR = "/dev/shm"
"""Where torch's file_system strategy (shm_open) puts the buffers on Linux."""


def _check_room(nbytes: int) -> None:
    """A buffer larger than the free space of /dev/shm maps, then dies of SIGBUS on first touch:
    refuse it by name instead."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:  # not Linux: shm_open places it elsewhere
        return
    free = stat.f_bavail * stat.f_frsize
    if nbytes > free:
        raise RuntimeError(f"{SHM_DIR} has {free / 2**20:.0f} MiB free; a shared buffer of {nbytes / 2**20:.0f} MiB "
                           "for the colocated SGLang servers does not fit (a container's default is 64 MiB: give "
                           "it more with --shm-size, or use rollout.placement: separate)")


def _inheriting_nothing(fn) -> None:
    """Runs `fn` with descriptors 0 and 2 on /dev/null and every other one of ours made
    non-inheritable, so that a process it forks and execs (torch's torch_shm_manager) holds none
    of them; all restored after."""
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    marked = []
    for name in os.listdir(fd_dir):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                os.set_inheritable(fd, False)
                marked.append(fd)
        except OSError:  # the listing's own descriptor, closed by now
            continue
    saved = [os.dup(fd) for fd in (0, 2)]
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 2):
            os.dup2(devnull, fd)
        fn()
    finally:
        for fd, copy in zip((0, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
        for fd in marked:
            try:
                os.set_inheritable(fd, True)
            except OSError:  # closed meanwhile by another thread
                pass


class _SharedPickler(pickle.Pickler):
    """Tensors as torch.multiprocessing's reductions write them under the file_system strategy."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" or obj.is_sparse or obj.layout != torch.strided:
                raise ValueError(f"only dense CPU tensors can be shared with an SGLang server on this host, "
                                 f"got one on {obj.device} with layout {obj.layout}")
            if not obj.untyped_storage().is_shared():
                raise ValueError("a tensor for /update_weights_from_tensor must lie in shared memory "
                                 "(tensor_payload.shared_buffer); this one would be copied by the pickle")
            storage = torch.storage.TypedStorage(wrap_storage=obj.untyped_storage(), dtype=obj.dtype, _internal=True)
            metadata = (obj.storage_offset(), tuple(obj.size()), tuple(obj.stride()), False)
            return rebuild_tensor, (torch.Tensor, storage, metadata)
        if isinstance(obj, torch.storage.TypedStorage):
            return rebuild_typed_storage, (obj._untyped_storage, obj.dtype)
        if isinstance(obj, torch.UntypedStorage):
            manager, handle, size = obj._share_filename_cpu_()
            obj._shared_incref()  # the server's rebuild drops it
            return rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size)
        return NotImplemented


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry: base64 of a pickle of [(name, tensor), ...], the
    tensors' bytes left in their shared memory. One per TP rank: a rank's rebuild uses up the
    references its entry holds."""
    items = [(str(name), tensor.detach()) for name, tensor in named_tensors]
    if not items:
        raise ValueError("no tensors to serialize")
    out = io.BytesIO()
    _SharedPickler(out, protocol=PICKLE_PROTOCOL).dump(items)
    return base64.b64encode(out.getvalue()).decode("ascii")


_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch", "Tensor"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
}


class _Unpickler(pickle.Unpickler):
    """Admits what `serialize_named_tensors` writes (SGLang's SafeUnpickler admits more)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor payload")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The server's reading of one entry: [(name, tensor)], the tensors mapping the sender's
    shared memory. Raises ValueError on anything else."""
    try:
        items = _Unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, AttributeError, RuntimeError) as e:
        raise ValueError(f"not a tensor payload: {type(e).__name__}: {e}") from None
    if not isinstance(items, list) or not all(
            isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) and isinstance(i[1], torch.Tensor)
            for i in items):
        raise ValueError("not a tensor payload: expected a list of (name, tensor) pairs")
    return items

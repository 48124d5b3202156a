"""Write a torch_dist checkpoint directory from tensors produced one at a time, in one process.

    digests = write_dist_dir(path, [LazyChunk(key, global_shape, offsets, sizes, dtype, make), ...],
                             objects={"...linear_proj._extra_state/shard_0_2": None}, common={...})

The files are the ones Megatron's torch_dist save writes and its load (any TP/PP/EP: it reads
each rank's part of every global tensor by offsets) and `DistReader` read, in
torch.distributed.checkpoint's FileSystemWriter format: a data file of `torch.save`d chunks
(`__0_0.distcp`), `.metadata` (a pickled `Metadata`: every key's global shape, dtype and chunks,
and for each chunk its file, offset and length), `common.pt` (the rank-0 state) and
`metadata.json` (the backend, written last). Megatron stores a ShardedObject as
`torch.save([obj])`; so does `objects` here.

The chunks are written here rather than by FileSystemWriter, which keeps the last chunk of
every key it wrote until it returns (two embeddings and a layer: a third of a 2 GB model): each
chunk is made (`make()`), written and dropped before the next is made, so the memory taken is
the largest chunk plus what `make` needs. The data file's SHA-256 is computed as it is written.

Nothing here imports megatron; the directory protocol (tmp dir, manifest, `latest`) is the
caller's (`checkpoint.directory`, `checkpoint.manifest`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

__all__ = ["BACKEND_METADATA", "DATA_FILE", "LazyChunk", "write_dist_dir"]

# metadata.json of a torch_dist checkpoint (Megatron's dist_checkpointing reads it to pick its loader).
BACKEND_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                    "common_backend_version": 1}
DATA_FILE = "__0_0.distcp"  # FileSystemWriter's name for rank 0's first file
# The torch.distributed.checkpoint metadata version FileSystemWriter writes (torch 2.4 .. 2.13).
_DCP_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class LazyChunk:
    """One chunk of a global tensor, produced only when it is written."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]
    """Returns the chunk: `sizes` elements of `dtype` (any shape with that many elements)."""


class _HashingFile:
    """A binary file that hashes what is written to it (torch.save writes sequentially)."""

    def __init__(self, f):
        self.f, self.sha256, self.position = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.f.write(view)
        self.sha256.update(view)
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        self.f.flush()


def _chunk_tensor(chunk: LazyChunk) -> torch.Tensor:
    tensor = chunk.make().detach()
    if tensor.dtype != chunk.dtype or tensor.numel() != torch.Size(chunk.sizes).numel():
        raise ValueError(f"{chunk.key} at {list(chunk.offsets)}: made {tensor.dtype} {list(tensor.shape)}, "
                         f"expected {chunk.dtype} {list(chunk.sizes)}")
    tensor = tensor.reshape(chunk.sizes).contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # torch.save writes the whole storage
    return tensor


def _fsynced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_dist_dir(path: str | os.PathLike, chunks: Sequence[LazyChunk], *, objects: Mapping[str, Any],
                   common: Mapping[str, Any]) -> dict[str, dict]:
    """Write `chunks` (in order, one at a time) and `objects` into the empty directory `path` as a
    torch_dist checkpoint with `common` as its common.pt; returns the data file's digest
    ({DATA_FILE: {"size", "sha256"}}, as `manifest.digest_files` gives it)."""
    path = Path(path)
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    with open(path / DATA_FILE, "wb") as raw:
        f = _HashingFile(raw)
        for key, obj in objects.items():
            buffer = io.BytesIO()
            torch.save([obj], buffer)
            start = f.tell()
            f.write(buffer.getbuffer())
            storage[MetadataIndex(key)] = _StorageInfo(DATA_FILE, start, f.tell() - start)
        for c in chunks:
            meta = tensors.setdefault(c.key, TensorStorageMetadata(TensorProperties(dtype=c.dtype),
                                                                   torch.Size(c.global_shape), []))
            if tuple(meta.size) != tuple(c.global_shape) or meta.properties.dtype != c.dtype:
                raise ValueError(f"{c.key}: chunks of different global shapes or dtypes")
            index = MetadataIndex(c.key, c.offsets)
            assert index not in storage, f"{c.key} at {list(c.offsets)} twice"
            tensor = _chunk_tensor(c)
            start = f.tell()
            torch.save(tensor, f)
            del tensor
            storage[index] = _StorageInfo(DATA_FILE, start, f.tell() - start)
            meta.chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)))
        raw.flush()
        os.fsync(raw.fileno())
    digest = {DATA_FILE: {"size": f.tell(), "sha256": f.sha256.hexdigest()}}
    metadata = Metadata(state_dict_metadata={**tensors, **{key: BytesStorageMetadata() for key in objects}},
                        storage_data=storage, storage_meta=StorageMeta(checkpoint_id=str(path),
                                                                       save_id=str(uuid.uuid4())),
                        version=_DCP_VERSION)
    _fsynced(path / ".metadata", pickle.dumps(metadata))
    buffer = io.BytesIO()
    torch.save(dict(common), buffer)
    _fsynced(path / "common.pt", buffer.getvalue())
    _fsynced(path / "metadata.json", json.dumps(BACKEND_METADATA).encode())
    return digest

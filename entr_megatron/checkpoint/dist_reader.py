"""Read a torch_dist checkpoint one tensor slice at a time, in one process, without building a model.

    reader = DistReader(ckpt_dir)                # reads .metadata only
    reader.tensor_keys(), reader.global_shape(key), reader.dtype(key)
    fc2_HF = reader.read("decoder.layers.mlp.linear_fc2.weight", (3,))   # layer 3's [H, F]

A torch_dist checkpoint (torch.distributed.checkpoint as Megatron writes it) is a `.metadata`
file (for every key: global shape, dtype and the chunks the saving ranks wrote) and data files
in which each chunk is one `torch.save`d tensor at a known offset (`storage_data`). `read`
returns the part of a tensor at given leading-axis indices (a layer, or a layer and an expert)
and assembles it from whatever chunks the saving layout cut it into (TP rows or columns, the two
halves of a gated fc1, EP ranks' experts), reading only those chunks: the memory it takes is the
slice asked for plus one chunk. A slice not completely covered by chunks is an error naming the
key. When one chunk is exactly the slice (a checkpoint saved at TP=1, or by `convert`) it is
returned as loaded, with no copy.

Nothing here imports megatron; torch.distributed.checkpoint is used for its metadata types.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.utils import _create_file_view

__all__ = ["DistReader"]


class DistReader:
    """The tensors of one torch_dist checkpoint directory, read slice by slice (`read`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise ValueError(f"{self.path}: no .metadata (not a torch_dist checkpoint)")
        self.metadata = FileSystemReader(str(self.path)).read_metadata()
        self._tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                         if isinstance(v, TensorStorageMetadata)}
        self._files: dict[str, object] = {}

    def keys(self) -> list[str]:
        """Every key of the checkpoint: tensors and byte objects (`<key>/shard_<...>`)."""
        return list(self.metadata.state_dict_metadata)

    def tensor_keys(self) -> list[str]:
        return list(self._tensors)

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].properties.dtype

    def _load_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        info = self.metadata.storage_data[MetadataIndex(key, offsets)]
        if info.transform_descriptors:
            raise ValueError(f"{self.path}: {key} is stored with transforms {info.transform_descriptors}, "
                             "which this reader does not apply")
        f = self._files.get(info.relative_path)
        if f is None:
            f = self._files[info.relative_path] = open(self.path / info.relative_path, "rb")
        tensor = torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu", weights_only=True)
        if tensor.numel() != math.prod(sizes):
            raise ValueError(f"{self.path}/{info.relative_path}: the chunk of {key} at {list(offsets)} holds "
                             f"{tensor.numel()} elements, its metadata says {list(sizes)}")
        return tensor.reshape(sizes)

    def read(self, key: str, prefix: tuple[int, ...] = ()) -> torch.Tensor:
        """The slice of tensor `key` at leading indices `prefix` (those axes dropped): e.g. layer l of
        a stacked layer weight, (l, e) of an expert weight, () for the whole tensor."""
        meta = self._tensors.get(key)
        if meta is None:
            raise ValueError(f"{self.path}: no tensor {key!r} in the checkpoint")
        shape = tuple(meta.size)
        if len(prefix) > len(shape) or any(not 0 <= i < n for i, n in zip(prefix, shape)):
            raise ValueError(f"{self.path}: {key} has shape {list(shape)}, no slice {list(prefix)}")
        begin = tuple(prefix) + (0,) * (len(shape) - len(prefix))
        sizes = (1,) * len(prefix) + shape[len(prefix):]
        found = [c for c in meta.chunks
                 if all(o <= b < o + s for o, s, b in zip(c.offsets[:len(prefix)], c.sizes[:len(prefix)], prefix))]
        if len(found) == 1 and tuple(found[0].offsets) == begin and tuple(found[0].sizes) == sizes:
            return self._load_chunk(key, tuple(found[0].offsets), sizes).reshape(shape[len(prefix):])
        out = torch.empty(sizes, dtype=meta.properties.dtype)
        covered = 0
        for c in found:
            chunk = self._load_chunk(key, tuple(c.offsets), tuple(c.sizes))
            src, dst = chunk, out
            for dim, (o, s, b, n) in enumerate(zip(c.offsets, c.sizes, begin, sizes)):
                lo, hi = max(o, b), min(o + s, b + n)
                src, dst = src.narrow(dim, lo - o, hi - lo), dst.narrow(dim, lo - b, hi - lo)
            dst.copy_(src)
            covered += dst.numel()
        if covered != out.numel():  # chunks of one checkpoint never overlap
            raise ValueError(f"{self.path}: the chunks of {key} cover {covered} of the {out.numel()} elements at "
                             f"{list(prefix)} (an incomplete checkpoint?)")
        return out.reshape(shape[len(prefix):])

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> DistReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

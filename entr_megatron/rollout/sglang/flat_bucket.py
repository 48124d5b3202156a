"""SGLang's "flattened_bucket": the tensors of one weight-update broadcast, their bytes back to
back in one uint8 tensor, no padding, every offset a multiple of the tensor's element size (the
layout of `utils.buckets`), as SGLang's FlattenedTensorBucket (srt/weight_sync/tensor_bucket.py)
packs and reads it. The body announcing a bucket: protocol.update_weights_payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from entr_megatron.rollout.sglang.tensor_payload import shared_buffer
from entr_megatron.utils.buckets import FlatLayout, dtype_from_name, dtype_name, floating_as, plan_flat_buckets

__all__ = ["FlatBucket", "iter_flattened_buckets", "pack_flattened_bucket", "unpack_flattened_bucket"]


@dataclass
class FlatBucket:
    """SGLang "flattened_bucket": tensors' bytes back to back in one uint8 tensor."""

    names: list[str]
    dtypes: list[str]
    """torch dtype names without "torch." (SGLang does getattr(torch, dtype))."""
    shapes: list[list[int]]
    flat: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.flat.numel()

    def layout(self) -> FlatLayout:
        """Where each tensor sits in `flat` (SGLang's FlattenedTensorBucket reads the same)."""
        return FlatLayout(tuple(self.names), tuple(dtype_from_name(d) for d in self.dtypes),
                          tuple(tuple(s) for s in self.shapes))


def _bucket(layout: FlatLayout, tensors: Sequence[torch.Tensor]) -> FlatBucket:
    return FlatBucket(names=list(layout.names), dtypes=[dtype_name(d) for d in layout.dtypes],
                      shapes=[list(s) for s in layout.shapes], flat=layout.pack(tensors))


def pack_flattened_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> FlatBucket:
    """Pack tensors the way SGLang's FlattenedTensorBucket unpacks them: no padding, and larger
    elements first so that every offset is a multiple of its element size (SGLang refuses
    unaligned tensors)."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    ((layout, tensors),) = plan_flat_buckets(named_tensors, bucket_bytes=1 << 62)
    return _bucket(layout, tensors)


def unpack_flattened_bucket(bucket: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """The receiver's view (SGLang's FlattenedTensorBucket.empty + reconstruct_tensors)."""
    layout = bucket.layout()
    assert layout.nbytes == bucket.flat.numel(), "bucket size does not match its tensors"
    return layout.views(bucket.flat)


def iter_flattened_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None,
    buffers: list[torch.Tensor] | None = None, share_memory: bool = False,
) -> Iterator[FlatBucket]:
    """Buckets of at most `bucket_bytes` (a larger tensor gets one of its own); floating tensors
    are cast to `dtype` when given (send what the servers store). A bucket is packed (copied)
    as soon as the first tensor of the next one arrives.

    buffers: a pool that bucket k packs into (slot k % 2, grown when too small) and that the caller
    keeps from version to version, so that a version's copy writes into memory already paged in
    (a fresh 370 MB buffer took 1.3-2 s to fill on the 2-core machine, a warm one 0.3 s). Two
    slots: bucket k+1 is packed while bucket k is on the wire, and k+2 only after k was sent.
    share_memory: the buffers lie in file-backed shared memory (tensor_payload.shared_buffer),
    for a server on this host to read (needs `buffers`)."""
    if share_memory and buffers is None:
        raise ValueError("share_memory needs buffers kept by the caller (a shared buffer per bucket would leak)")
    for k, (layout, tensors) in enumerate(plan_flat_buckets(named_tensors, bucket_bytes, wire_dtype=floating_as(dtype))):
        if buffers is None:
            yield _bucket(layout, tensors)
            continue
        while len(buffers) <= k % 2:
            buffers.append(torch.empty(0, dtype=torch.uint8))
        if buffers[k % 2].numel() < layout.nbytes or (share_memory and not buffers[k % 2].is_shared()):
            buffers[k % 2] = shared_buffer(layout.nbytes) if share_memory else torch.empty(layout.nbytes, dtype=torch.uint8)
        flat = buffers[k % 2][:layout.nbytes]
        layout.fill(flat, tensors)
        yield FlatBucket(names=list(layout.names), dtypes=[dtype_name(d) for d in layout.dtypes],
                         shapes=[list(s) for s in layout.shapes], flat=flat)

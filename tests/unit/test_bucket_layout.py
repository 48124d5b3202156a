"""The one flat bucket layout (`utils.buckets`): named tensors of mixed dtypes and shapes are cut
into buckets, packed, and read back exactly, in both settings (SGLang's flattened bucket, the
embedded engine's 64-byte aligned one); every packer of the project lays its bytes out this way."""

from __future__ import annotations

import pytest
import torch

from entr_megatron.rollout.sglang import iter_flattened_buckets, unpack_flattened_bucket
from entr_megatron.rollout.weights import pack_buckets
from entr_megatron.utils.buckets import FlatLayout, align_up, dtype_from_name, dtype_name, floating_as, plan_flat_buckets
from entr_megatron.weight_sync.buckets import plan_buckets

BUCKET_BYTES = 64
SETTINGS = [(1, True), (64, False)]  # (align, largest_first): SGLang's / the embedded engine's


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("emb", torch.randn(3, 4, generator=g)),                                  # 48 B
        ("norm", torch.randn(5, generator=g).bfloat16()),                         # 10 B
        ("mask", torch.rand(2, 3, generator=g) > 0.5),                            # 6 B, bool
        ("step", torch.tensor(7, dtype=torch.int64)),                             # 8 B, 0-dim
        ("big", torch.randn(20, generator=g, dtype=torch.float64)),               # 160 B > BUCKET_BYTES
        ("half", torch.randn(4, 1, generator=g).half()),                          # 8 B
        ("empty", torch.zeros(0, 4)),                                             # 0 B
        ("idx", torch.arange(6, dtype=torch.int32)),                              # 24 B
        ("byte", torch.tensor([1, -2, 3], dtype=torch.int8)),                     # 3 B
        ("wide", torch.randn(2, 3, generator=g).t()),                             # 24 B, not contiguous
    ]


def slot_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


@pytest.mark.parametrize("align, largest_first", SETTINGS)
def test_round_trip_within_the_bucket_budget(align, largest_first):
    tensors = named_tensors()
    given = dict(tensors)
    planned = list(plan_flat_buckets(tensors, BUCKET_BYTES, align=align, largest_first=largest_first))
    # Every tensor once, and buckets take the input in order (a bucket is a run of the input).
    runs = [sorted(layout.names, key=[n for n, _ in tensors].index) for layout, _ in planned]
    assert [n for run in runs for n in run] == [n for n, _ in tensors]
    assert ("big",) in [layout.names for layout, _ in planned]  # the oversized tensor has a bucket of its own
    for k, (layout, wire) in enumerate(planned):
        assert [given[n] is t for n, t in zip(layout.names, wire)] == [True] * len(wire)  # inputs, not copies
        flat = layout.pack(wire)
        assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
        assert layout.nbytes <= BUCKET_BYTES or len(layout.names) == 1
        if k + 1 < len(planned):  # cut only when the next tensor would overflow the budget
            first_of_next = runs[k + 1][0]
            assert align_up(layout.nbytes, align) + slot_bytes(given[first_of_next]) > BUCKET_BYTES
        for i, (offset, dtype) in enumerate(zip(layout.offsets, layout.dtypes)):
            assert offset % align == 0 and offset % dtype.itemsize == 0
            if i:
                assert offset == align_up(layout.offsets[i - 1] + layout.slot_nbytes(i - 1), align)
        assert layout.nbytes == align_up(layout.offsets[-1] + layout.slot_nbytes(len(wire) - 1), align)
        if largest_first:  # no padding; larger elements first, ties in input order
            assert layout.nbytes == sum(slot_bytes(t) for t in wire)
            sizes = [d.itemsize for d in layout.dtypes]
            assert sizes == sorted(sizes, reverse=True)
        # The receiver knows only names, dtype names and shapes (the header): its views are exact.
        names, dtypes, shapes = list(layout.names), [dtype_name(d) for d in layout.dtypes], [list(s) for s in layout.shapes]
        header = FlatLayout(tuple(names), tuple(dtype_from_name(d) for d in dtypes), tuple(tuple(s) for s in shapes), align)
        assert header == layout
        for name, view in header.views(flat):
            want = given[name]
            assert view.dtype == want.dtype and view.shape == want.shape and torch.equal(view, want), name


def test_wire_dtypes_cast_floating_tensors_on_copy():
    tensors = named_tensors()
    given = dict(tensors)
    ((layout, wire),) = plan_flat_buckets(tensors, 1 << 20, wire_dtype=floating_as(torch.bfloat16))
    flat = layout.pack(wire)
    for name, view in layout.views(flat):
        want = given[name].to(torch.bfloat16) if given[name].is_floating_point() else given[name]
        assert view.dtype == want.dtype and torch.equal(view, want), name
    assert layout.nbytes == sum(slot_bytes(t, torch.bfloat16 if t.is_floating_point() else None) for _, t in tensors)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(plan_flat_buckets(named_tensors(), 0))
    with pytest.raises(ValueError, match="largest_first"):
        list(plan_flat_buckets(named_tensors(), 64, align=64, largest_first=True))
    assert list(plan_flat_buckets([], 64)) == []


def test_every_packer_uses_the_one_layout():
    tensors = named_tensors()
    flattened = list(plan_flat_buckets(tensors, BUCKET_BYTES))
    aligned = list(plan_flat_buckets(tensors, BUCKET_BYTES, align=64, largest_first=False))
    # Our broadcast protocol and SGLang's flattened bucket: the same cut, slots and bytes.
    for (layout, wire), (ours, _), sglang in zip(flattened, plan_buckets(tensors, BUCKET_BYTES),
                                                 iter_flattened_buckets(tensors, BUCKET_BYTES), strict=True):
        flat = layout.pack(wire)
        assert ours.flat_layout == layout and ours.offsets == layout.offsets and ours.nbytes == layout.nbytes
        assert sglang.names == list(layout.names) and sglang.dtypes == [dtype_name(d) for d in layout.dtypes]
        assert torch.equal(sglang.flat, flat)
        assert [n for n, _ in unpack_flattened_bucket(sglang)] == list(layout.names)
    # The embedded engine's queue buckets: 64-byte aligned slots in input order.
    for (layout, wire), bucket in zip(aligned, pack_buckets(tensors, BUCKET_BYTES), strict=True):
        assert [(e.name, e.dtype, e.shape, e.offset) for e in bucket.entries] == list(
            zip(layout.names, layout.dtypes, layout.shapes, layout.offsets))
        assert bucket.flat.numel() == layout.nbytes
        packed = layout.pack(wire)
        for (name, a), (_, b) in zip(bucket.tensors(), layout.views(packed)):  # the padding is not data
            assert torch.equal(a, b), name

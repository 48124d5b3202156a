"""How a bucket's bytes are cut into broadcasts (`BucketLayout.ranges`) and where each piece comes
from on the learner (`SnapshotBucket.pieces`: borrowed parameters where they are, the rest copied)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from entr_megatron.weight_sync import BucketLayout, WeightSyncConfig, plan_buckets
from entr_megatron.weight_sync.snapshot import BufferPool, SnapshotBucket

# Slots: a fp32[10] at 0 (40 B), b fp32[100] at 40 (400 B), c fp32[3] at 440 (12 B), d bf16[4] at 452 (8 B).
LAYOUT = BucketLayout(("a", "b", "c", "d"), (torch.float32, torch.float32, torch.float32, torch.bfloat16),
                      ((10,), (100,), (3,), (4,)))


def test_ranges_cut_alone_slots_out_and_split_at_the_chunk_size():
    assert LAYOUT.nbytes == 460 and LAYOUT.offsets == (0, 40, 440, 452)
    assert LAYOUT.segments() == ((0, 460),)
    assert LAYOUT.ranges(150) == ((0, 150), (150, 300), (300, 450), (450, 460))
    assert LAYOUT.ranges(0) == ((0, 460),)
    b_alone = dataclasses.replace(LAYOUT, alone=(1,))
    assert b_alone.segments() == ((0, 40), (40, 440), (440, 460))
    assert b_alone.ranges(150) == ((0, 40), (40, 190), (190, 340), (340, 440), (440, 460))
    first_two = dataclasses.replace(LAYOUT, alone=(0, 1))  # adjacent alone slots stay apart
    assert first_two.ranges(1000) == ((0, 40), (40, 440), (440, 460))
    last = dataclasses.replace(LAYOUT, alone=(3,))
    assert last.ranges(1000) == ((0, 452), (452, 460))
    again = BucketLayout.from_bytes(b_alone.to_bytes())
    assert again == b_alone and again.alone == (1,)
    with pytest.raises(AssertionError, match="alone"):
        dataclasses.replace(LAYOUT, alone=(2, 1))


@pytest.mark.parametrize("borrow", [(), (1,), (0, 1), (0, 1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("chunk", [0, 7, 150])
def test_pieces_join_to_the_packed_bucket(borrow, chunk):
    """Borrowed slots are sent from the tensors themselves (no copy, the buffer holds only the
    others), and the pieces, in order, are byte for byte the bucket `fill` packs."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(d) for s, d in zip(LAYOUT.shapes, LAYOUT.dtypes)]
    reference = torch.empty(LAYOUT.nbytes, dtype=torch.uint8)
    LAYOUT.fill(reference, tensors)
    layout = dataclasses.replace(LAYOUT, alone=borrow)
    copied_bytes = LAYOUT.nbytes - sum(LAYOUT.slot_nbytes(i) for i in borrow)
    pool = BufferPool()
    buf = pool.acquire(copied_bytes) if copied_bytes else None
    bucket = SnapshotBucket(layout, buf, pool, borrowed={i: tensors[i] for i in borrow}, filling=True)
    assert bucket.borrowed_nbytes == LAYOUT.nbytes - copied_bytes and bucket.flat.numel() == copied_bytes
    bucket.fill(tensors, slice_bytes=16)
    pieces = list(bucket.pieces(chunk))
    assert [p.numel() for p in pieces] == [b - a for a, b in layout.ranges(chunk)]
    assert torch.equal(torch.cat(pieces), reference)
    for i in borrow:  # the piece IS the parameter's memory
        start, end = layout.offsets[i], layout.offsets[i] + layout.slot_nbytes(i)
        index = [r[0] for r in layout.ranges(chunk)].index(start)
        assert pieces[index].data_ptr() == tensors[i].data_ptr()
        assert sum(b - a for a, b in layout.ranges(chunk) if start <= a < end) == end - start
    for (name, view), t, n in zip(bucket.views(), tensors, LAYOUT.names):
        assert name == n and torch.equal(view, t)
    bucket.release()
    assert pool._in_use == 0


def test_config_checks_the_snapshot_mode():
    with pytest.raises(ValueError, match="snapshot must be one of"):
        WeightSyncConfig(snapshot="steal")
    with pytest.raises(ValueError, match="borrow_min_bytes"):
        WeightSyncConfig(borrow_min_bytes=0)
    from entr_megatron.config.run import WEIGHT_SNAPSHOTS
    from entr_megatron.weight_sync.sync import SNAPSHOT_MODES

    assert set(WEIGHT_SNAPSHOTS) == set(SNAPSHOT_MODES)
    [(layout, _)] = plan_buckets([("x", torch.zeros(3))], bucket_bytes=100)
    assert layout.alone == ()

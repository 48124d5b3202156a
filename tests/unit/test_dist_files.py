"""torch_dist checkpoint files written chunk by chunk (`dist_writer`) and read slice by slice
(`dist_reader`), checked against torch.distributed.checkpoint's own loader and against the
tensors they were cut from."""

from __future__ import annotations


import pytest
import torch
import torch.distributed.checkpoint as dcp

from entr_megatron.checkpoint.dist_reader import DistReader
from entr_megatron.checkpoint.dist_writer import DATA_FILE, LazyChunk, write_dist_dir
from entr_megatron.checkpoint.manifest import digest_files


def _chunks(key, full, cuts):
    """LazyChunks of `full` at (offsets, sizes) `cuts`, each made by slicing when it is written."""
    made = []

    def chunk(offsets, sizes):
        def make():
            made.append(key)
            t = full
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                t = t.narrow(dim, o, s)
            return t.clone()
        return LazyChunk(key, tuple(full.shape), offsets, sizes, full.dtype, make)

    return [chunk(o, s) for o, s in cuts], made


def test_chunks_written_lazily_read_back_by_torch_and_by_slices(tmp_path):
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 4, 6, generator=g)  # a layer axis of 3
    emb = torch.randn(5, 2, generator=g).bfloat16()
    cuts = [((0, 0, 0), (1, 4, 6)),                                        # layer 0: one chunk
            ((1, 0, 0), (1, 4, 3)), ((1, 0, 3), (1, 4, 3)),                # layer 1: two column halves
            ((2, 0, 0), (1, 2, 6)), ((2, 2, 0), (1, 1, 6)), ((2, 3, 0), (1, 1, 6))]  # layer 2: rows
    chunks, made = _chunks("w", stacked, cuts)
    emb_chunks, _ = _chunks("emb", emb, [((0, 0), (5, 2))])
    digest = write_dist_dir(tmp_path, [*chunks, *emb_chunks], objects={"w._extra_state/shard_0_3": None},
                            common={"entr": {"step": 0}})
    assert made == ["w"] * 6  # each chunk made once, in order
    assert digest == digest_files(tmp_path, [DATA_FILE])
    assert torch.load(tmp_path / "common.pt") == {"entr": {"step": 0}}
    # torch's own loader (the one Megatron's load builds on) reads what was written
    state = {"w": torch.zeros(3, 4, 6), "emb": torch.zeros(5, 2, dtype=torch.bfloat16)}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["w"], stacked) and torch.equal(state["emb"], emb)
    with DistReader(tmp_path) as reader:
        assert sorted(reader.tensor_keys()) == ["emb", "w"] and reader.global_shape("w") == (3, 4, 6)
        assert reader.dtype("emb") == torch.bfloat16 and "w._extra_state/shard_0_3" in reader.keys()
        for layer in range(3):
            assert torch.equal(reader.read("w", (layer,)), stacked[layer])
        assert torch.equal(reader.read("w", (2, 1)), stacked[2, 1])
        assert torch.equal(reader.read("emb"), emb) and torch.equal(reader.read("w"), stacked)
        with pytest.raises(ValueError, match=r"no slice \[3\]"):
            reader.read("w", (3,))


def test_a_slice_the_chunks_do_not_cover_is_an_error(tmp_path):
    stacked = torch.randn(2, 4)
    chunks, _ = _chunks("w", stacked, [((0, 0), (1, 4)), ((1, 0), (1, 2))])  # layer 1 lacks columns 2..3
    write_dist_dir(tmp_path, chunks, objects={}, common={})
    with DistReader(tmp_path) as reader:
        assert torch.equal(reader.read("w", (0,)), stacked[0])
        with pytest.raises(ValueError, match=r"the chunks of w cover 2 of the 4 elements at \[1\]"):
            reader.read("w", (1,))
        with pytest.raises(ValueError, match="no tensor 'v'"):
            reader.read("v")


def test_a_made_chunk_of_the_wrong_size_or_dtype_is_refused(tmp_path):
    bad = LazyChunk("w", (2, 4), (0, 0), (1, 4), torch.float32, lambda: torch.ones(3))
    with pytest.raises(ValueError, match=r"w at \[0, 0\]: made torch.float32 \[3\], expected torch.float32 \[1, 4\]"):
        write_dist_dir(tmp_path, [bad], objects={}, common={})

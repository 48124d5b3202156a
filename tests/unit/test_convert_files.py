"""The rank-free parts of `convert`: safetensors headers, streamed shards, staged outputs, the verify math."""

from __future__ import annotations

import json

import pytest
import torch

from entr_megatron.checkpoint import convert as conv
from entr_megatron.checkpoint.hf_files import (
    ShardWriter,
    check_hf_dir,
    merge_shards,
    parse_size,
    read_header,
    staged_dir,
)

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("100KB") == 100_000
    assert parse_size("1234") == 1234 and parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError, match="'lots' is not valid"):
        parse_size("lots")


def test_headers_catch_truncated_corrupt_and_padded_files(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"a": torch.ones(10, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, str(path))
    infos = read_header(path)
    assert infos["a"].shape == (10, 4) and infos["a"].nbytes == 160 and infos["b"].dtype == "BF16"
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(ValueError, match=rf"truncated: {len(data) - 7} bytes, its header says {len(data)}"):
        read_header(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(ValueError, match="has trailing bytes"):
        read_header(path)
    path.write_bytes(data[:4])
    with pytest.raises(ValueError, match="not even a header length"):
        read_header(path)
    path.write_bytes(data[:8] + b"[" + data[9:])
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        read_header(path)


def _expect(tensors):
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def test_streamed_shards_merge_into_an_hf_index(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each: two per shard
    first = ShardWriter(tmp_path, max_shard_bytes=100, expected=_expect(dict(list(tensors.items())[:3])),
                        prefix="stage000")
    second = ShardWriter(tmp_path, max_shard_bytes=100, expected=_expect(dict(list(tensors.items())[3:])),
                         prefix="stage001")
    for i, (name, t) in enumerate(tensors.items()):
        (first if i < 3 else second).add(name, t)
    assert first.finish() == {"stage000-00000.safetensors": ["t0", "t1"], "stage000-00001.safetensors": ["t2"]}
    second.finish()
    weight_map = merge_shards(tmp_path, ["stage000", "stage001"])
    assert weight_map["t0"] == "model-00001-of-00003.safetensors"
    assert weight_map["t4"] == "model-00003-of-00003.safetensors"
    files = check_hf_dir(tmp_path)
    assert sorted(files.tensors) == sorted(tensors) and files.nbytes == 200
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200 and not list(tmp_path.glob("stage*"))
    # safetensors' own reader agrees with ours on every tensor
    for name, t in tensors.items():
        with safetensors_torch.safe_open(str(tmp_path / weight_map[name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), t) and torch.equal(files.get(name), t)


def test_shards_hold_no_tensor_and_refuse_surprises(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.tensor(3.5),
               "c": torch.ones(0, 4), "d": torch.tensor([True, False])}
    writer = ShardWriter(tmp_path, max_shard_bytes=10**6, expected=_expect(tensors))
    writer.add("a", tensors["a"].t().contiguous().t())  # non-contiguous: written in logical order
    assert not any(isinstance(v, torch.Tensor) for v in vars(writer).values())  # nothing held back
    with pytest.raises(ValueError, match=r"tensor c \(F32, \[0, 4\]\) arrived where b \(F32, \[\]\) was expected"):
        writer.add("c", tensors["c"])
    with pytest.raises(ValueError, match=r"tensor b \(BF16, \[\]\) arrived where b \(F32, \[\]\)"):
        writer.add("b", tensors["b"].bfloat16())
    writer.add("b", tensors["b"])
    writer.add("c", tensors["c"])
    with pytest.raises(ValueError, match="1 expected tensors were never written \\(e.g. d\\)"):
        writer.finish()
    writer = ShardWriter(tmp_path, max_shard_bytes=10**6, expected=_expect(tensors))
    for name, t in tensors.items():
        writer.add(name, t)
    writer.finish()
    merge_shards(tmp_path, ["shard"])
    with safetensors_torch.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert all(torch.equal(f.get_tensor(n), t) and f.get_tensor(n).dtype == t.dtype for n, t in tensors.items())
    with pytest.raises(ValueError, match="not expected"):
        writer.add("e", torch.ones(1))


def test_one_shard_is_model_safetensors(tmp_path):
    writer = ShardWriter(tmp_path, max_shard_bytes=10**6, expected=[("w", torch.float32, (3,))])
    writer.add("w", torch.ones(3))
    writer.finish()
    assert merge_shards(tmp_path, ["shard"]) == {"w": "model.safetensors"}
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_index_naming_a_missing_shard_or_a_wrong_file(tmp_path):
    safetensors_torch.save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    with pytest.raises(ValueError, match="maps 1 tensors \\(e.g. b\\) to two.safetensors, which does not exist"):
        check_hf_dir(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "one.safetensors"}}))
    with pytest.raises(ValueError, match="maps b to one.safetensors, but no file has it"):
        check_hf_dir(tmp_path)


def test_staged_dir_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with staged_dir(out) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with staged_dir(out) as tmp:
        (tmp / "a").write_text("1")
        assert not out.exists()
    assert (out / "a").read_text() == "1"
    with pytest.raises(ValueError, match="exists and is not empty"), staged_dir(out):
        pass
    # --overwrite deletes only what the new output replaces: an old "a" it does not write keeps the old OUT aside.
    said = []
    with staged_dir(out, overwrite=True, say=said.append) as tmp:
        (tmp / "b").write_text("2")
    [kept] = [p for p in tmp_path.iterdir() if p.name.startswith("out.previous-")]
    assert sorted(p.name for p in out.iterdir()) == ["b"] and (kept / "a").read_text() == "1"
    assert said == [f"--overwrite: the previous {out} held files this command does not write (a); it is kept whole "
                    f"as {kept}"]
    # What the new output also writes, or what `replaceable` says such an output holds, is replaced.
    (out / "c").write_text("3")
    with staged_dir(out, overwrite=True, replaceable=lambda name: name == "c", say=said.append) as tmp:
        (tmp / "b").write_text("4")
    assert sorted(p.name for p in out.iterdir()) == ["b"] and (out / "b").read_text() == "4" and len(said) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", kept.name])


def test_compare_logprobs_reports_delta_and_kl():
    ref = [torch.log_softmax(torch.randn(5, 7, dtype=torch.float64), -1)]
    seq = [[0, 1, 2, 3, 4]]
    same = conv.compare_logprobs(ref, [ref[0].clone()], seq, 1e-4)
    assert same.passed and same.max_abs_delta_logprob == 0 and same.mean_kl == 0 and same.tokens == 4
    moved = ref[0].clone()
    moved[2] = torch.log_softmax(moved[2] + torch.arange(7.0), -1)
    worse = conv.compare_logprobs(ref, [moved], seq, 1e-4)
    assert not worse.passed and worse.mean_kl > 0 and "FAILED (tolerance 0.0001)" in worse.summary()
    assert worse.max_abs_delta_logprob == pytest.approx(float((ref[0][2, 3] - moved[2, 3]).abs()))


def test_compare_model_configs_names_the_field_and_both_values():
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 256}
    conv.compare_model_configs(base, dict(base), "checkpoint", "source")
    with pytest.raises(ValueError, match="num_key_value_heads is 2 in the checkpoint, 4 in the source"):
        conv.compare_model_configs(base, base | {"num_key_value_heads": 4}, "checkpoint", "source")
    with pytest.raises(ValueError, match="model_type is 'llama' in the checkpoint, 'qwen2' in the source"):
        conv.compare_model_configs(base, base | {"model_type": "qwen2"}, "checkpoint", "source")

"""An HF model directory is checked before any work, with one error naming the flag, the file and
the problem (`checkpoint.model_inputs.check_model_dir`, used by train, sft, eval, generate, score
and convert)."""

from __future__ import annotations

import json
import os

import pytest

from entr_megatron.checkpoint.model_inputs import check_model_dir, check_tokenizer_dir, tokenizer_problem
from model_dir_fixture import CONFIG, write_model_dir

pytest.importorskip("safetensors")


def _error(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        check_model_dir(*args, **kwargs)
    return str(e.value)


def test_a_whole_directory_passes_and_reports_what_it_holds(tmp_path):
    model = check_model_dir(write_model_dir(tmp_path / "m"), "--model")
    assert model.config == CONFIG and model.tokenizer_missing is None
    assert sorted(model.files.tensors) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert model.files.nbytes == 64 * 32 * 4 + 32 * 4  # float32


def test_a_truncated_safetensors_file_is_named_with_both_sizes(tmp_path):
    d = write_model_dir(tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    assert _error(d, "model.path") == (f"model.path {d}: {d / 'model.safetensors'}: truncated: {len(data) - 100} "
                                       f"bytes, its header says {len(data)}")


def test_an_unreadable_or_corrupt_header_is_named(tmp_path):
    d = write_model_dir(tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:8] + b"#" * 16 + data[24:])
    assert _error(d, "--model").startswith(f"--model {d}: {d / 'model.safetensors'}: corrupt safetensors header")
    if os.geteuid() != 0:  # root reads a file whatever its mode
        (d / "model.safetensors").write_bytes(data)
        (d / "model.safetensors").chmod(0)
        assert _error(d, "--model") == f"--model {d}: {d / 'model.safetensors'}: cannot be read (Permission denied)"


def test_weights_in_another_format_are_named(tmp_path):
    d = write_model_dir(tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    assert _error(d, "--model") == (f"--model {d}: {d}: no model.safetensors or model.safetensors.index.json (found "
                                    "pytorch_model.bin; only safetensors checkpoints named as transformers saves "
                                    "them are read)")


@pytest.mark.parametrize("content, problem", [
    (b"{\"model_type\": \"qwen2\",\n  \"hidden_size\": 32,\n", "config.json:3:1: not valid JSON (Expecting "
                                                             "property name enclosed in double quotes)"),
    (b"{\"model_type\": \"qwen2\", \"name\": \"caf\xe9\"}", "config.json:1:37: not UTF-8 text (byte 0xe9)"),
    (b"[1, 2]", "config.json: not a JSON object of the model's settings (got a list)"),
    (b"{\"hidden_size\": 32}", "config.json: no \"model_type\" (a string such as \"qwen3\" or \"llama\"), got None"),
])
def test_a_bad_config_json_is_named_with_line_and_column(tmp_path, content, problem):
    d = write_model_dir(tmp_path / "m")
    (d / "config.json").write_bytes(content)
    assert _error(d, "model.path") == f"model.path {d}: {d}/{problem}"


def test_a_missing_directory_or_config(tmp_path):
    assert _error(tmp_path / "nope", "--model") == f"--model {tmp_path / 'nope'}: does not exist"
    (tmp_path / "f").write_text("x")
    assert _error(tmp_path / "f", "--model").startswith(f"--model {tmp_path / 'f'}: is not a directory")
    assert _error(tmp_path, "--model").startswith(f"--model {tmp_path}: no config.json")


def test_a_missing_or_damaged_tokenizer(tmp_path):
    d = write_model_dir(tmp_path / "m", tokenizer=False)
    assert _error(d, "model.path", tokenizer_hint="set model.tokenizer") == (
        f"model.path {d}: has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
        "vocab.json); set model.tokenizer")
    # Not asked for: reported, not raised (convert warns, generate says why there is no output_text).
    assert check_model_dir(d, "--hf", tokenizer=False).tokenizer_missing == (
        f"{d} has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json)")
    (d / "tokenizer.json").write_text('{"model": ')
    assert tokenizer_problem(d) == f"{d / 'tokenizer.json'}:1:11: not valid JSON (Expecting value)"
    with pytest.raises(ValueError, match="^model.tokenizer .*tokenizer.json:1:11: not valid JSON"):
        check_tokenizer_dir(d, "model.tokenizer")
    check_tokenizer_dir("Qwen/Qwen3-0.6B", "model.tokenizer")  # a hub id: the loader's business


def test_only_what_the_caller_reads_is_checked(tmp_path):
    d = write_model_dir(tmp_path / "m", tokenizer=False)
    (d / "model.safetensors").write_bytes(b"garbage")
    model = check_model_dir(d, "--model", weights=False, tokenizer=False)  # e.g. generate --sglang-url
    assert model.files is None and model.config == json.loads((d / "config.json").read_text())

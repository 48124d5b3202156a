"""An HF model directory checked before any work starts: one function for every command that reads one.

    model = check_model_dir(path, "model.path")              # config.json, every safetensors header, tokenizer
    model = check_model_dir(path, "--model", tokenizer=False, weights=False)   # only what the caller reads

`train` and `sft` (model.path, model.tokenizer), `eval` (--model or the run's model), `generate`
and `score` (--model) and `convert hf-to-megatron` (--hf) call it before a process starts or a
file is written, so a truncated shard, a corrupt header, a config.json that is not a JSON object
of a model, or a missing tokenizer is one `ValueError` naming the flag or field, the file and the
problem, not a traceback from transformers or a rank seconds later.

What is read: config.json (UTF-8, a JSON object with a "model_type"), the safetensors headers
(`hf_files.check_hf_dir`: each file as long as its header says, the index consistent; no tensor
data), and the tokenizer files that are JSON (parsed). It does not load the tokenizer or build the
model: that takes seconds and is the commands' own work.

Nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from entr_megatron.checkpoint.hf_files import HfFiles, check_hf_dir

__all__ = ["CONFIG_FILE", "TOKENIZER_FILES", "ModelDir", "check_model_dir", "check_tokenizer_dir", "tokenizer_problem"]

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holds a tokenizer transformers can load when it has one of these."""
# Tokenizer files that are JSON: a damaged one fails transformers' load with a parser traceback.
_JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                         "added_tokens.json")


@dataclass(frozen=True)
class ModelDir:
    """What `check_model_dir` found."""

    dir: Path
    config: dict
    """config.json."""
    files: HfFiles | None
    """The safetensors files and their tensors (None when weights were not asked for)."""
    tokenizer_missing: str | None
    """Why the directory has no tokenizer (None: it has one)."""


def _json_file(path: Path) -> object:
    """The JSON of `path`; ValueError "FILE: problem" (unreadable, not UTF-8 with line and column, not JSON)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"no {CONFIG_FILE} (an HF model directory has config.json beside its safetensors)")
    config = _json_file(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object of the model's settings (got a {type(config).__name__})")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{path}: no \"model_type\" (a string such as \"qwen3\" or \"llama\"), got {model_type!r}")
    return config


def tokenizer_problem(directory: str | os.PathLike) -> str | None:
    """Why `directory` holds no usable tokenizer: none of `TOKENIZER_FILES`, or a JSON one that does
    not parse (named with line and column); None when it has one."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    for name in _JSON_TOKENIZER_FILES:
        if (directory / name).is_file():
            try:
                _json_file(directory / name)
            except ValueError as e:
                return str(e)
    return None


def check_tokenizer_dir(path: str | os.PathLike, what: str) -> None:
    """A local tokenizer directory (e.g. model.tokenizer) has a tokenizer; a name that is no local
    path (a hub id) is left to the loader. ValueError "WHAT PATH: problem"."""
    if not Path(path).is_dir():
        if Path(path).exists():
            raise ValueError(f"{what} {path}: not a directory (a tokenizer is a directory with "
                             f"{' or '.join(TOKENIZER_FILES[:2])})")
        return
    problem = tokenizer_problem(path)
    if problem is not None:
        raise ValueError(f"{what} {path}: {problem.removeprefix(f'{Path(path)} ')}")


def check_model_dir(path: str | os.PathLike, what: str, *, weights: bool = True, tokenizer: bool = True,
                    tokenizer_hint: str = "") -> ModelDir:
    """Check the HF model directory `path` (the flag or field `what` gave it) before any work:
    config.json, every safetensors header when `weights` (sizes, index), and a tokenizer when
    `tokenizer` (else its absence is reported in `tokenizer_missing`). Raises one ValueError
    "WHAT PATH: FILE: problem" (`tokenizer_hint` appended to a tokenizer problem: what to set instead)."""
    directory = Path(path)
    try:
        if not directory.exists():
            raise ValueError("does not exist")
        if not directory.is_dir():
            raise ValueError("is not a directory (an HF model directory: config.json + safetensors)")
        config = _read_config(directory)
        files = check_hf_dir(directory) if weights else None
    except ValueError as e:
        raise ValueError(f"{what} {path}: {e}") from None
    missing = tokenizer_problem(directory)
    if tokenizer and missing is not None:
        raise ValueError(f"{what} {path}: {missing.removeprefix(f'{directory} ')}" + (f"; {tokenizer_hint}"
                                                                                      if tokenizer_hint else ""))
    return ModelDir(directory, config, files, missing)

"""HF model directories on disk: safetensors headers checked, shards written one at a time, a
directory that appears only when complete.

    files = check_hf_dir(hf_dir)                 # headers only: every file whole, the index consistent
    with staged_dir(out, overwrite=False) as tmp:   # out appears (renamed) only if the block succeeds
        writer = ShardWriter(tmp, max_shard_bytes)
        for name, tensor in tensors: writer.add(name, tensor)   # a shard is written as soon as it is full
        writer.finish()                          # model.safetensors, or model-0000i-of-0000N + index

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, data_offsets) and the data; `read_header` checks the offsets tile the data exactly and
the file is as long as the header says, so a truncated or overwritten file is named before a
rank reads it. Several writers (one per pipeline stage) may write into one directory under
their own `prefix`; `merge_shards` then gives the files their final names and writes the index.

Nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["HfFiles", "ShardWriter", "TensorInfo", "check_hf_dir", "merge_shards", "parse_size", "read_header",
           "staged_dir", "write_json"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A header longer than this is not a real one (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 << 20
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB", "500MB", "2GiB" or "1000" (HF's max_shard_size spelling)."""
    s = str(text).strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit) and s[: -len(unit)].strip():
            number, factor = s[: -len(unit)].strip(), _UNITS[unit]
            break
    else:
        number, factor = s, 1
    try:
        value = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"size {text!r} is not valid; e.g. 5GB, 500MB, 2GiB or a number of bytes") from None
    if value < 1:
        raise ValueError(f"size {text!r} must be positive")
    return value


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; ValueError naming the file when it is truncated or corrupt."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, not even a header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: corrupt or truncated safetensors file (header length {n}, file {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    tensors, spans = {}, []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry for {name!r}: {entry!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if dtype not in _DTYPE_BYTES or end - begin != numel * _DTYPE_BYTES[dtype]:
            raise ValueError(f"{path}: corrupt safetensors header: {name} is {dtype} {list(shape)} but spans "
                             f"{end - begin} bytes")
        tensors[name] = TensorInfo(path.name, dtype, shape, end - begin)
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: corrupt safetensors header: {name} starts at byte {begin}, expected {position}")
        position = end
    if size != 8 + n + position:
        what = "truncated" if size < 8 + n + position else "has trailing bytes"
        raise ValueError(f"{path}: {what}: {size} bytes, its header says {8 + n + position}")
    return tensors


@dataclass
class HfFiles:
    """The safetensors files of an HF model directory and where each tensor is."""

    dir: Path
    tensors: dict[str, TensorInfo]
    files: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def check_hf_dir(hf_dir: str | os.PathLike) -> HfFiles:
    """Read every header of an HF model directory (no tensor data): each file whole, and the index
    (when sharded) naming files that exist and tensors that are in them. ValueError names the file."""
    hf_dir = Path(hf_dir)
    index, single = hf_dir / INDEX_FILE, hf_dir / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
            raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            names = sorted(n for n, f in weight_map.items() if f == missing[0])
            raise ValueError(f"{index} maps {len(names)} tensors (e.g. {names[0]}) to {missing[0]}, which does not "
                             f"exist in {hf_dir}" + (f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else ""))
    elif single.is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise ValueError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        tensors.update(read_header(hf_dir / file))
    if weight_map is not None:
        wrong = sorted(n for n, f in weight_map.items() if n not in tensors or tensors[n].file != f)
        if wrong:
            n = wrong[0]
            where = f"it is in {tensors[n].file}" if n in tensors else "no file has it"
            raise ValueError(f"{index} maps {n} to {weight_map[n]}, but {where} ({len(wrong)} such entries)")
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise ValueError(f"{hf_dir}: {len(unlisted)} tensors are in the shards but not in {INDEX_FILE} "
                             f"(e.g. {unlisted[0]} in {tensors[unlisted[0]].file})")
    return HfFiles(hf_dir, tensors, files)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """An empty directory `OUT.tmp-<pid>` that becomes `out` (renamed) only if the block succeeds;
    removed on any error. An existing non-empty `out` is refused (ValueError) unless `overwrite`, in
    which case it is replaced only once the new one is complete."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        aside = out.with_name(f"{out.name}.old-{os.getpid()}")
        if out.is_dir():
            os.replace(out, aside)
        os.replace(tmp, out)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class ShardWriter:
    """Safetensors shards written into `directory` as tensors arrive: at most one shard of
    `max_shard_bytes` (or one larger tensor) is held. Files are `<prefix>-<i>.safetensors` until
    `merge_shards` names them; `finish` returns {file: [tensor names]} and also writes it as
    `<prefix>.json` for `merge_shards`."""

    directory: Path
    max_shard_bytes: int
    prefix: str = "shard"
    files: dict[str, list[str]] = field(default_factory=dict)
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)
    _pending_bytes: int = 0
    written_bytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (a contiguous CPU copy is taken only when it is not one already)."""
        assert name not in self._pending and all(name not in v for v in self.files.values()), name
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self._pending, str(Path(self.directory) / file), metadata={"format": "pt"})
        self.files[file] = list(self._pending)
        self.written_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> dict[str, list[str]]:
        """Write the last shard and the listing; returns {file: [tensor names]}."""
        if self._pending:
            self._flush()
        (Path(self.directory) / f"{self.prefix}.json").write_text(json.dumps(self.files))
        return self.files


def merge_shards(directory: str | os.PathLike, prefixes: list[str]) -> dict[str, str]:
    """Give the shards of the writers `prefixes` (in order) their HF names: one file becomes
    `model.safetensors`, several `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.
    Returns the weight map {tensor: file}."""
    directory = Path(directory)
    shards: list[tuple[str, list[str]]] = []
    for prefix in prefixes:
        listing = directory / f"{prefix}.json"
        shards += list(json.loads(listing.read_text()).items())
        listing.unlink()
    weight_map: dict[str, str] = {}
    total = 0
    for i, (file, names) in enumerate(shards, start=1):
        final = SINGLE_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += sum(t.nbytes for t in read_header(directory / file).values())
        os.replace(directory / file, directory / final)
        weight_map.update(dict.fromkeys(names, final))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def write_json(path: str | os.PathLike, obj: Mapping) -> None:
    """`obj` as indented JSON at `path` (in a directory that is renamed into place afterwards)."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

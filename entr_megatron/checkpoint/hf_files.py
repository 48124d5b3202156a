"""HF model directories on disk: safetensors headers checked, shards written one at a time, a
directory that appears only when complete.

    files = check_hf_dir(hf_dir)                 # headers only: every file whole, the index consistent
    tensor = files.get(name)                     # one tensor, read into memory of its own
    with staged_dir(out, overwrite=False) as tmp:   # out appears (renamed) only if the block succeeds,
                                                    # never half; a killed run's OUT.tmp-* is removed next time
        writer = ShardWriter(tmp, max_shard_bytes, expected=[(name, dtype, shape), ...])
        for name, tensor in tensors: writer.add(name, tensor)   # its bytes go straight to its shard
        writer.finish()
        merge_shards(tmp, ["shard"])             # model.safetensors, or model-0000i-of-0000N + index

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, data_offsets) and the data; `read_header` checks the offsets tile the data exactly and
the file is as long as the header says, so a truncated or overwritten file is named before a
tensor is read. The writer knows every tensor (name, dtype, shape) before the first arrives, so
it writes each shard's header first and then each tensor's bytes as it comes: it holds no
shard in memory. Several writers may write into one directory under their own `prefix`;
`merge_shards` then gives the files their final names and writes the index.

Nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from entr_megatron.utils.hf_layout import INDEX_FILE, SINGLE_FILE

__all__ = ["HfFiles", "ShardWriter", "TensorInfo", "check_hf_dir", "clean_stale", "deferred_signals", "merge_shards",
           "parse_size", "read_header", "staged_dir", "write_json"]

# A header longer than this is not a real one (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 << 20
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
_HEADER_ALIGN = 8  # safetensors pads its header with spaces so the data starts 8-byte aligned
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
    offset: int = 0
    """Where the tensor's bytes start in the file."""


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; ValueError naming the file when it is truncated or corrupt."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated safetensors file ({size} bytes, not even a header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"{path}: corrupt or truncated safetensors file (header length {n}, file {size} "
                                 "bytes)")
            raw = f.read(n)
    except OSError as e:  # a directory, no permission, an I/O error: named, not a traceback
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
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
        tensors[name] = TensorInfo(path.name, dtype, shape, end - begin, 8 + n + begin)
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

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its file into memory of its own (no memory map is kept: the pages
        of every file read so far would stay resident, as much again as the model)."""
        info = self.tensors[name]
        dtype = _TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise ValueError(f"{self.dir / info.file}: {name} is {info.dtype}, which is not read here")
        data = torch.empty(info.nbytes, dtype=torch.uint8)
        with open(self.dir / info.file, "rb") as f:
            f.seek(info.offset)
            if info.nbytes and f.readinto(memoryview(data.numpy())) != info.nbytes:
                raise ValueError(f"{self.dir / info.file}: truncated while reading {name}")
        return data.view(dtype).reshape(info.shape)


def check_hf_dir(hf_dir: str | os.PathLike) -> HfFiles:
    """Read every header of an HF model directory (no tensor data): each file whole, and the index
    (when sharded) naming files that exist and tensors that are in them. ValueError names the file."""
    hf_dir = Path(hf_dir)
    index, single = hf_dir / INDEX_FILE, hf_dir / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            assert isinstance(weight_map, dict)
        except OSError as e:
            raise ValueError(f"{index}: cannot be read ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError) as e:
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
        others = sorted(p.name for p in hf_dir.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        found = f" (found {', '.join(others[:4])}{', ...' if len(others) > 4 else ''}; only safetensors " \
                "checkpoints named as transformers saves them are read)" if others else ""
        raise ValueError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE}{found}")
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


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT and SIGTERM held back for the block (renames that must not be cut in half) and
    delivered when it ends; a no-op off the main thread, where Python runs no handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def _pid_of(path: Path, marker: str) -> int | None:
    try:
        return int(path.name.rsplit(marker, 1)[1])
    except (IndexError, ValueError):
        return None


def _running_conversion(pid: int) -> bool:
    """Whether `pid` is a live process that may be a conversion (a reused pid of another program is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return not cmdline or b"entr" in cmdline  # empty: starting up, or no /proc to tell: assume it may be one


def clean_stale(out: str | os.PathLike, say: Callable[[str], None] = _say) -> list[Path]:
    """Remove the `OUT.tmp-<pid>` directories that killed runs (SIGKILL, a lost node) left beside
    `out`, saying so; an `OUT.old-<pid>` (the previous output, moved aside by a run killed while
    replacing it) is renamed back when `out` is missing, else named. A temp directory of a run still
    going is refused (ValueError). Returns what was removed."""
    out = Path(out)
    removed = []
    for tmp in sorted(out.parent.glob(f"{glob.escape(out.name)}.tmp-*")):
        pid = _pid_of(tmp, ".tmp-")
        if pid is None or pid == os.getpid() or not tmp.is_dir():
            continue
        if _running_conversion(pid):
            raise ValueError(f"{tmp}: process {pid} is writing {out} now; wait for it, stop it, or if it is no "
                             f"conversion remove {tmp}")
        shutil.rmtree(tmp)
        removed.append(tmp)
        say(f"removed {tmp}, the unfinished output of an interrupted run (pid {pid}, no longer running)")
    for old in sorted(out.parent.glob(f"{glob.escape(out.name)}.old-*")):
        pid = _pid_of(old, ".old-")
        if pid is None or pid == os.getpid() or not old.is_dir() or _running_conversion(pid):
            continue
        if not out.exists():
            os.replace(old, out)
            say(f"restored {out} from {old}, where a run interrupted while replacing it had moved it")
        else:
            say(f"{old} holds the output an interrupted run (pid {pid}) was replacing; {out} is the newer one: "
                f"remove {old} when it is not needed")
    return removed


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike, *, overwrite: bool = False, replaceable: Callable[[str], bool] | None = None,
               say: Callable[[str], None] = _say) -> Iterator[Path]:
    """An empty directory `OUT.tmp-<pid>` that becomes `out` (renamed) only if the block succeeds;
    removed on any error or interrupt (and, left by a killed run, on the next start: `clean_stale`).

    An existing non-empty `out` is refused (ValueError) unless `overwrite`. With `overwrite` it is
    replaced once the new one is complete, and nothing in it that the block did not write is
    deleted: when every entry of the old `out` is one the new output also has, or one
    `replaceable(name)` accepts (what the caller's kind of output may hold), the old one is removed;
    otherwise it is kept whole, renamed `OUT.previous-<time>`, and `say` names it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out, say)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        with deferred_signals():  # old aside, new in place, old removed: never half done by a signal
            if not out.is_dir():
                os.replace(tmp, out)
                return
            made = {p.name for p in tmp.iterdir()}
            foreign = sorted(p.name for p in out.iterdir()
                             if p.name not in made and not (replaceable is not None and replaceable(p.name)))
            aside = out.with_name(f"{out.name}.old-{os.getpid()}")
            os.replace(out, aside)
            os.replace(tmp, out)
            if not foreign:
                shutil.rmtree(aside)
                return
            kept = out.with_name(f"{out.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
            while kept.exists():
                kept = kept.with_name(kept.name + "-1")
            os.replace(aside, kept)
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        say(f"--overwrite: the previous {out} held files this command does not write ({shown}); it is kept "
            f"whole as {kept}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ShardWriter:
    """Safetensors shards written into `directory` as tensors arrive, holding none of them.

    `expected` lists every tensor (name, dtype, shape) in the order `add` will receive them, so the
    shards are decided up front (a new one when the next tensor would pass `max_shard_bytes`; a
    larger tensor gets one of its own): each shard's header is written when its first tensor
    arrives and each tensor's bytes straight after it. A tensor out of order, of another dtype or
    shape, or one missing at `finish` is a ValueError. Files are `<prefix>-<i>.safetensors` until
    `merge_shards` names them; `finish` returns {file: [tensor names]} and also writes it as
    `<prefix>.json` for `merge_shards`."""

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int,
                 expected: Sequence[tuple[str, torch.dtype, Sequence[int]]], prefix: str = "shard"):
        self.directory, self.prefix = Path(directory), prefix
        self.files: dict[str, list[str]] = {}
        self.written_bytes = 0
        self._plan: list[tuple[str, str, tuple[int, ...], int]] = []  # name, safetensors dtype, shape, bytes
        self._shard_of: list[int] = []
        size, shard = 0, 0
        for name, dtype, shape in expected:
            if dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors")
            nbytes = _DTYPE_BYTES[_SAFETENSORS_DTYPES[dtype]]
            for d in shape:
                nbytes *= int(d)
            if size and size + nbytes > max_shard_bytes:
                shard, size = shard + 1, 0
            self._plan.append((name, _SAFETENSORS_DTYPES[dtype], tuple(int(d) for d in shape), nbytes))
            self._shard_of.append(shard)
            size += nbytes
        assert len({p[0] for p in self._plan}) == len(self._plan), "a tensor name is expected twice"
        self._next = 0
        self._file = None

    def _open(self, shard: int) -> None:
        """Close the current shard and start `shard` with its header."""
        self._close()
        entries = [(p, i) for i, p in enumerate(self._plan) if self._shard_of[i] == shard]
        header, position = {"__metadata__": {"format": "pt"}}, 0
        for (name, dtype, shape, nbytes), _ in entries:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + nbytes]}
            position += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % _HEADER_ALIGN)
        file = f"{self.prefix}-{shard:05d}.safetensors"
        self._file = open(self.directory / file, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self.files[file] = [name for (name, *_), _ in entries]

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor (the next one `expected` lists) into its shard."""
        if self._next >= len(self._plan):
            raise ValueError(f"tensor {name} was not expected (all {len(self._plan)} were written)")
        want, dtype, shape, nbytes = self._plan[self._next]
        got = (name, _SAFETENSORS_DTYPES.get(tensor.dtype), tuple(tensor.shape))
        if got != (want, dtype, shape):
            raise ValueError(f"tensor {got[0]} ({got[1]}, {list(got[2])}) arrived where {want} ({dtype}, "
                             f"{list(shape)}) was expected")
        shard = self._shard_of[self._next]
        if self._file is None or (self._next and self._shard_of[self._next - 1] != shard):
            self._open(shard)
        data = tensor.detach().cpu().contiguous().reshape(-1)
        if nbytes:
            self._file.write(memoryview(data.view(torch.uint8).numpy()))
        self.written_bytes += nbytes
        self._next += 1

    def finish(self) -> dict[str, list[str]]:
        """Close the last shard and write the listing; returns {file: [tensor names]}."""
        self._close()
        missing = [p[0] for p in self._plan[self._next:]]
        if missing:
            raise ValueError(f"{len(missing)} expected tensors were never written (e.g. {missing[0]})")
        (self.directory / f"{self.prefix}.json").write_text(json.dumps(self.files))
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

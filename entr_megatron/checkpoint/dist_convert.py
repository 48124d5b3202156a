"""HF safetensors <-> learner dist checkpoint, streamed one tensor at a time in one process.

    record = hf_to_dist(files, spec, ckpt_root, hf_config=config, dtype=torch.bfloat16, progress=p)
    record = dist_to_hf(ckpt_dir, spec, out_dir, dtype=None, max_shard_bytes=5 * 10**9, progress=p)

Neither builds the model. hf-to-megatron writes step 0 of a checkpoint root (weights only) the
way Megatron's torch_dist save would at TP=PP=EP=1 (`dist_layout` says where each parameter
goes, `dist_writer` writes it): each parameter is read from its HF tensors, fused (QKV, gated
fc1), cast and written before the next is read. megatron-to-hf reads each parameter's slice of
a checkpoint saved at any layout (`dist_reader`), splits it into its HF tensors and writes them
into safetensors shards whose headers were written up front (`hf_files.ShardWriter`). Host memory
is about the largest tensor (an embedding) plus the pieces of the one being converted, whatever
the model's size.

Strict both ways: every HF tensor the model has is read exactly once and every parameter
written (the caller checks the source's names and shapes first: `learner.hf_load.check_hf_checkpoint`
on the command's side); every tensor of the dist checkpoint is a parameter of this config, of the
global shape it implies (the vocabulary may be padded), or an optimizer / RNG / `_extra_state`
entry, which are skipped; a key the model lacks, or lacks in the checkpoint, is a ValueError
naming it. The fusing of HF tensors is checked against `models.to_hf` on the first tensor of
every kind (a layout change in the tables cannot produce a silently different tensor).
"""

from __future__ import annotations

import pickle
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from entr_megatron import models
from entr_megatron.checkpoint import directory, manifest
from entr_megatron.checkpoint.dist_layout import DistEntry, dist_entries, extra_state_keys
from entr_megatron.checkpoint.dist_reader import DistReader
from entr_megatron.checkpoint.dist_writer import LazyChunk, write_dist_dir
from entr_megatron.checkpoint.hf_files import HfFiles, ShardWriter
from entr_megatron.checkpoint.state import FORMAT_VERSION, INFO_KEY, OPTIMIZER_KEY_PREFIX, RNG_KEY, sharding_metadata
from entr_megatron.checkpoint.validate import check_format
from entr_megatron.utils.run_log import PROGRESS_EVERY_S

__all__ = ["Progress", "converted_info", "dist_to_hf", "hf_to_dist", "stored_dtype"]

_EXTRA_STATE = "._extra_state/"

ProgressFn = Callable[[str, torch.Tensor], None]
"""Called with each HF tensor's name and the tensor once it is read or written."""


class Progress:
    """Bytes and tensors on stderr: tqdm when it is installed, else a line every few seconds."""

    def __init__(self, what: str, enabled: bool = True):
        self.what, self.enabled, self.bytes, self.tensors = what, enabled, 0, 0
        self.started = self.last = time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm  # lazy: optional, without it progress lines on stderr

                self.bar = tqdm(desc=what, unit="B", unit_scale=True, file=sys.stderr, mininterval=1.0)
            except ImportError:
                pass

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes += nbytes
        self.tensors += 1
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(tensors=self.tensors, refresh=False)
        elif self.enabled and time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(f"  {self.what}: {self.tensors} tensors, {self.bytes / 1e9:.2f} GB", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            rate = self.bytes / max(time.monotonic() - self.started, 1e-9) / 1e9
            print(f"  {self.what}: {self.tensors} tensors, {self.bytes / 1e9:.3f} GB ({rate:.2f} GB/s)",
                  file=sys.stderr, flush=True)


def _hf_parts(megatron_name: str, spec: models.ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of the HF tensors a full Megatron parameter is made of, in `models.to_hf` order."""
    meta = torch.empty(models.megatron_shape(megatron_name, spec), device="meta")
    return [(name, tuple(t.shape)) for name, t in models.to_hf(megatron_name, meta, spec)]


def _fuse(megatron_name: str, parts: list[torch.Tensor], spec: models.ModelSpec, checked: set[str]) -> torch.Tensor:
    """The full Megatron parameter from its HF tensors (the inverse of `models.to_hf`, as the
    learner's HF load fuses them); the first parameter of each kind (name with its indices
    taken out) is checked to give its HF tensors back under `models.to_hf`."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        full = models.merge_gated(*parts)
    elif len(parts) == 3:
        full = models.interleave_qkv(*parts, spec.num_query_groups, spec.head_dim)
    else:
        raise AssertionError(f"{megatron_name}: {len(parts)} HF parts")
    kind = re.sub(r"\.\d+\.", ".N.", megatron_name)
    if kind not in checked:
        back = [t for _, t in models.to_hf(megatron_name, full, spec)]
        if len(back) != len(parts) or not all(torch.equal(a, b) for a, b in zip(back, parts)):
            raise AssertionError(f"{megatron_name}: fusing its HF tensors is not the inverse of models.to_hf")
        checked.add(kind)
    return full


def converted_info() -> dict:
    """The common record (`state.checkpoint_info`) of a checkpoint `convert` writes: step 0, weights
    only, and no layout (no ranks wrote it: a load never restores RNG streams from it)."""
    return {"format_version": FORMAT_VERSION, "step": 0, "layout": None, "num_chunks": 1, "has_optimizer": False,
            "distributed_optimizer": False, "scheduler": None, "extra_state": pickle.dumps(None)}


def hf_to_dist(files: HfFiles, spec: models.ModelSpec, ckpt_root: str | Path, *, hf_config: dict,
               dtype: torch.dtype, progress: ProgressFn | None = None) -> Path:
    """Write the model in `files` as step 0 of the checkpoint root `ckpt_root` (weights only, the
    manifest, model_config.json, `latest`); returns the step's directory. Reads every HF tensor of
    the model once (others, e.g. a tied lm_head, are the caller's to allow) and holds one at a time."""
    entries = dist_entries(spec)
    read: set[str] = set()
    checked: set[str] = set()

    def producer(entry: DistEntry) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            parts = []
            for name, shape in _hf_parts(entry.name, spec):
                tensor = files.get(name)
                if tuple(tensor.shape) != shape:  # the caller checked the headers: a file changed since
                    raise ValueError(f"{files.dir}: {name} has shape {list(tensor.shape)}, the config implies "
                                     f"{list(shape)}")
                read.add(name)
                if progress is not None:
                    progress(name, tensor)
                parts.append(tensor)
            return _fuse(entry.name, parts, spec, checked).to(dtype)
        return make

    chunks = [LazyChunk(e.key, e.global_shape, e.prefix_offsets + (0,) * len(e.shape),
                        (1,) * len(e.prefix_offsets) + e.shape, dtype, producer(e)) for e in entries]
    tmp = directory.prepare_tmp_dir(ckpt_root, 0)
    digests = write_dist_dir(tmp, chunks, objects=dict.fromkeys(extra_state_keys(entries)), common={
        INFO_KEY: converted_info(), "content_metadata": sharding_metadata(None, "fully_reshardable")})
    unread = set(models.hf_names(spec, "checkpoint")) - read
    assert not unread, f"HF tensors never read: {sorted(unread)[:4]}"
    small = [name for name in manifest.data_files(tmp) if name not in digests]  # .metadata, common.pt, ...
    manifest.write_manifest(tmp, 0, digests | manifest.digest_files(tmp, small))
    directory.write_model_config(ckpt_root, hf_config)
    return directory.commit(ckpt_root, 0)


def _check_keys(reader: DistReader, entries: list[DistEntry], spec: models.ModelSpec) -> None:
    """Every tensor of the checkpoint is a parameter of `spec` (or skipped state), of the global shape
    `spec` implies; ValueError naming the keys otherwise."""
    where = f"{reader.path} ({spec.model_type} config)"
    wanted = {e.key: e for e in entries}
    skipped = (OPTIMIZER_KEY_PREFIX, RNG_KEY + "/")
    tensors = set(reader.tensor_keys())
    stored = [k for k in tensors if not k.startswith(skipped)]
    others = [k for k in reader.keys() if k not in tensors and not k.startswith(skipped) and _EXTRA_STATE not in k]
    unknown, absent = sorted(set(stored) - set(wanted)) + sorted(others), sorted(set(wanted) - set(stored))
    if unknown or absent:
        parts = [f"it holds {len(unknown)} entries no parameter of this config maps to: {', '.join(unknown[:6])}"
                 ] if unknown else []
        parts += [f"it lacks {len(absent)} the config implies: {', '.join(absent[:6])}"] if absent else []
        raise ValueError(f"{where}: " + "; ".join(parts) + " (a checkpoint of another model or config?)")
    for key, e in wanted.items():
        got, want = reader.global_shape(key), e.global_shape
        vocab = len(e.prefix_shape)  # the rows a saving TP size may have padded
        padded = e.is_vocab and len(got) == len(want) and got[vocab] >= want[vocab] and \
            got[:vocab] + got[vocab + 1:] == want[:vocab] + want[vocab + 1:]
        if got != want and not padded:
            raise ValueError(f"{where}: {key} has global shape {list(got)}, the config implies {list(want)}")


def stored_dtype(reader: DistReader, spec: models.ModelSpec) -> torch.dtype:
    """The dtype the checkpoint stores the model's weights in (ValueError when they differ)."""
    stored = set(reader.tensor_keys())
    dtypes = {reader.dtype(e.key) for e in dist_entries(spec) if e.key in stored}
    if len(dtypes) != 1:
        raise ValueError(f"{reader.path}: the weights are stored in {sorted(map(str, dtypes))}: pick one with --dtype")
    return dtypes.pop()


def dist_to_hf(ckpt_dir: str | Path, spec: models.ModelSpec, out_dir: str | Path, *, dtype: torch.dtype | None,
               max_shard_bytes: int, progress: ProgressFn | None = None, prefix: str = "shard") -> dict[str, list[str]]:
    """Write the weights of the checkpoint directory `ckpt_dir` (an `iter_*`, saved at any layout) as HF
    safetensors shards `<prefix>-<i>.safetensors` in `out_dir` (`hf_files.merge_shards` names them) in
    `dtype` (None: as stored); returns {file: [tensor names]}."""
    with DistReader(ckpt_dir) as reader:
        check_format(Path(ckpt_dir), torch.load(Path(ckpt_dir) / "common.pt", map_location="cpu",
                                                weights_only=False).get(INFO_KEY))
        entries = dist_entries(spec)
        _check_keys(reader, entries, spec)
        dtype = dtype or stored_dtype(reader, spec)
        plan = [(name, dtype, shape) for e in entries for name, shape in _hf_parts(e.name, spec)]
        writer = ShardWriter(out_dir, max_shard_bytes, expected=plan, prefix=prefix)
        for e in entries:
            tensor = reader.read(e.key, e.prefix_offsets).to(dtype)
            for name, part in models.to_hf(e.name, tensor, spec):
                writer.add(name, part)
                if progress is not None:
                    progress(name, part)
            del tensor
        return writer.finish()

"""Load an HF model directory (config.json + safetensors) into this rank's Megatron model chunks.

Each rank reads only the tensors behind its own parameters (its pipeline stage's
layers, its EP rank's experts; TP ranks read the same tensors and keep their
slice), lazily (headers through `safetensors.safe_open`, data by plain reads: no memory map
kept), one parameter at a time, so peak extra memory is one full (TP-unsharded) parameter. Names and layouts come from
`models` (`to_hf` names the HF tensors of a Megatron parameter; QKV
interleaving and the gated-MLP merge are `models.interleave_qkv` /
`models.merge_gated`); sharding is `models.shard`.

Before any tensor is read, every rank checks the whole checkpoint from the
safetensors headers: missing and unexpected keys and every shape. All ranks see
the same files, so they fail together with the same message instead of one rank
raising while the others wait in a collective.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from safetensors import safe_open

from entr_megatron import models
from entr_megatron.utils.hf_layout import HF_CONFIG_FILE, INDEX_FILE, SINGLE_FILE

__all__ = [
    "HfCheckpoint",
    "check_hf_checkpoint",
    "global_param_names",
    "load_hf_weights",
    "read_hf_config",
    "tp_coords",
    "unwrap_chunk",
]

# Non-parameter buffers some older checkpoints carry; never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_PREVIEW = 8
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _preview(names) -> str:
    names = sorted(names)
    more = f", ... and {len(names) - _PREVIEW} more" if len(names) > _PREVIEW else ""
    return ", ".join(names[:_PREVIEW]) + more


def read_hf_config(hf_dir_or_config: str | os.PathLike | Mapping | Any) -> dict:
    """The HF config as a dict, from a model directory, a config.json path, a dict or a transformers config."""
    if isinstance(hf_dir_or_config, (str, os.PathLike)):
        path = os.fspath(hf_dir_or_config)
        if os.path.isdir(path):
            path = os.path.join(path, HF_CONFIG_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{os.fspath(hf_dir_or_config)!r}: no HF {HF_CONFIG_FILE} found (expected an HF model directory)"
            )
        with open(path) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
    if isinstance(hf_dir_or_config, Mapping):
        return dict(hf_dir_or_config)
    if callable(getattr(hf_dir_or_config, "to_dict", None)):
        return hf_dir_or_config.to_dict()
    raise TypeError(
        "expected an HF model directory, a config.json path, a dict or a transformers config, "
        f"got {type(hf_dir_or_config)}"
    )


class HfCheckpoint(contextlib.AbstractContextManager):
    """Lazy access to the tensors of an HF model directory (single or sharded safetensors).

    `shape(name)` reads only headers; `get(name)` reads one tensor. Files are
    opened on first use and closed by `close()` / the context manager.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = os.fspath(hf_dir)
        index, single = os.path.join(self.dir, INDEX_FILE), os.path.join(self.dir, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from None
            self._file_of = dict(weight_map)
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self._file_of = {k: SINGLE_FILE for k in f.keys()}
        else:
            others = sorted(n for n in os.listdir(self.dir) if n.endswith((".bin", ".pt", ".pth", ".safetensors")))
            raise ValueError(
                f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}"
                + (f" (found {_preview(others)}; only safetensors checkpoints are supported)" if others else "")
            )
        self._handles: dict[str, object] = {}
        self._offsets: dict[str, tuple[int, dict]] = {}  # file -> (data start, header)

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._file_of)

    def _handle(self, name: str):
        file = self._file_of.get(name)
        if file is None:
            raise KeyError(f"{name!r} is not in the checkpoint {self.dir}")
        if file not in self._handles:
            path = os.path.join(self.dir, file)
            if not os.path.isfile(path):
                raise ValueError(f"{os.path.join(self.dir, INDEX_FILE)} maps {name} to {file}, which does not exist")
            self._handles[file] = safe_open(path, framework="pt").__enter__()
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file header."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read from disk into memory of its own (no memory map is kept: pages of
        the files read so far would stay resident, as much again as the checkpoint)."""
        self._handle(name)  # the file exists and its header parses
        path = os.path.join(self.dir, self._file_of[name])
        if path not in self._offsets:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self._offsets[path] = (8 + n, header)
        start, header = self._offsets[path]
        entry = header[name]
        begin, end = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:  # a dtype we do not read by hand: safetensors' own reader
            return self._handle(name).get_tensor(name)
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(start + begin)
            if f.readinto(memoryview(data.numpy())) != end - begin:
                raise ValueError(f"{path}: truncated while reading {name}")
        return data.view(dtype).reshape(entry["shape"])

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __exit__(self, *exc):
        self.close()


def _hf_parts(megatron_name: str, spec: models.ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, expected shape) of the HF tensors a full Megatron parameter is made of."""
    meta = torch.empty(models.megatron_shape(megatron_name, spec), device="meta")
    return [(name, tuple(t.shape)) for name, t in models.to_hf(megatron_name, meta, spec)]


def check_hf_checkpoint(
    ckpt: HfCheckpoint, spec: models.ModelSpec, allow_unmapped: Sequence[str] = ()
) -> list[str]:
    """Raise ValueError naming missing / unexpected keys and shape mismatches (headers only).

    allow_unmapped: fnmatch patterns of tensor names that may be in the checkpoint without a
    learner parameter (an escape hatch: they are not loaded). Returns those skipped, sorted.
    """
    keys = {k for k in ckpt.keys() if not k.endswith(_IGNORED_SUFFIXES)}
    expected = set(models.hf_names(spec, "checkpoint"))
    if spec.tie_word_embeddings and "lm_head.weight" in keys - expected:
        keys.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    if keys != expected and keys == set(models.hf_names(spec, "transformers")):
        raise ValueError(
            f"{ckpt.dir}: the tensors are in transformers' in-memory layout (stacked experts); "
            "expected the checkpoint layout that save_pretrained writes (one tensor per expert)"
        )
    missing, unexpected = expected - keys, keys - expected
    skipped = sorted(k for k in unexpected if any(fnmatch.fnmatchcase(k, p) for p in allow_unmapped))
    unexpected -= set(skipped)
    mtp = sorted(k for k in unexpected if k.startswith(models.mtp_hf_prefixes(spec)))
    if mtp:
        patterns = " ".join(f"--allow-unmapped '{p}*'" for p in models.mtp_hf_prefixes(spec))
        raise ValueError(
            f"{ckpt.dir}: the checkpoint holds {len(mtp)} tensors of multi-token-prediction layers "
            f"(num_nextn_predict_layers={spec.mtp_layers}: {_preview(mtp)}), which are not supported: the learner "
            f"has no MTP layers (HF transformers ignores them too); to convert without them pass {patterns}")
    if missing or unexpected:
        parts = [f"missing {len(missing)}: {_preview(missing)}"] if missing else []
        parts += [f"unexpected {len(unexpected)}: {_preview(unexpected)}"] if unexpected else []
        raise ValueError(f"{ckpt.dir}: tensors do not match the {spec.model_type} config.json: " + "; ".join(parts))
    wrong = []
    for megatron_name in models.megatron_names(spec):
        for hf_name, shape in _hf_parts(megatron_name, spec):
            found = ckpt.shape(hf_name)
            if found != shape:
                wrong.append(f"{hf_name} has shape {list(found)}, config.json implies {list(shape)}")
    if wrong:
        more = f" (and {len(wrong) - _PREVIEW} more)" if len(wrong) > _PREVIEW else ""
        raise ValueError(f"{ckpt.dir}: shape mismatches: " + "; ".join(wrong[:_PREVIEW]) + more)
    return skipped


# --- local <-> global Megatron names ----------------------------------------------------


def unwrap_chunk(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _layer_offset(chunk) -> int:
    """Global index of the chunk's first layer; its layers must be one contiguous run."""
    layers = chunk.decoder.layers if chunk.decoder is not None else []
    if len(layers) == 0:
        return 0
    offset = layers[0].layer_number - 1
    numbers = [layer.layer_number - 1 for layer in layers]
    assert numbers == list(range(offset, offset + len(layers))), f"non-contiguous layers {numbers}"
    return offset


# Buffers that are weights of the HF model: the router's expert bias (HF e_score_correction_bias),
# a float32 buffer Megatron keeps beside the router weight.
_ROUTER_WEIGHT, _EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"


def _named_weights(chunk) -> Iterator[tuple[str, torch.Tensor]]:
    """The chunk's parameters, each router's `expert_bias` buffer right after its weight."""
    buffers = dict(chunk.named_buffers())
    for local, param in chunk.named_parameters():
        yield local, param
        if local.endswith(_ROUTER_WEIGHT):
            bias = local[: -len(_ROUTER_WEIGHT)] + _EXPERT_BIAS
            if buffers.get(bias) is not None:
                yield bias, buffers[bias]


def global_param_names(chunk, spec: models.ModelSpec, groups) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(global Megatron name, local name, parameter) for every weight of a chunk, in module order:
    its parameters and the routers' expert-bias buffers (a model weight HF stores).

    Global names carry global layer and expert indices, as `models` expects. The
    output layer of a tied model (last stage with PP > 1) is named as the word
    embedding it shares.
    """
    chunk = unwrap_chunk(chunk)
    offset = _layer_offset(chunk)
    for local, param in _named_weights(chunk):
        name = models.offset_layer(local, offset)
        if models.is_expert_param(name):
            name = models.expert_global_name(name, groups.ep_rank, spec.num_experts, groups.ep_size)
        if spec.tie_word_embeddings and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        yield name, local, param


def tp_coords(megatron_name: str, groups) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that splits this parameter (expert-TP for experts)."""
    if models.is_expert_param(megatron_name):
        return groups.expert_tp_rank, groups.expert_tp_size
    return groups.tp_rank, groups.tp_size


# --- loading -------------------------------------------------------------------------------


def _fuse(megatron_name: str, parts: list[torch.Tensor], spec: models.ModelSpec) -> torch.Tensor:
    """The full Megatron tensor from its HF parts (the inverse of `models.to_hf`)."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return models.merge_gated(*parts)
    if len(parts) == 3:
        return models.interleave_qkv(*parts, spec.num_query_groups, spec.head_dim)
    raise AssertionError(f"{megatron_name}: {len(parts)} HF parts")


def _check_inverse(megatron_name: str, full: torch.Tensor, parts: list[torch.Tensor], spec) -> None:
    """`models.to_hf(full)` must give back the parts: guards `_fuse` against a table change."""
    back = [t for _, t in models.to_hf(megatron_name, full, spec)]
    assert len(back) == len(parts) and all(torch.equal(a, b) for a, b in zip(back, parts)), (
        f"{megatron_name}: fusing the HF tensors is not the inverse of models.to_hf"
    )


@torch.no_grad()
def load_hf_weights(
    model_chunks,
    spec: models.ModelSpec,
    groups,
    hf_dir: str | os.PathLike,
    *,
    allow_unmapped: Sequence[str] = (),
    progress: Callable[[str, torch.Tensor], None] | None = None,
) -> list[str]:
    """Copy an HF checkpoint's weights into this rank's chunks (every parameter is written).

    Raises ValueError (before reading any tensor) for missing / unexpected keys
    and shape mismatches, and for a chunk parameter with no HF source.
    HF tensors are cast to each parameter's dtype. No collective is used.
    allow_unmapped: see `check_hf_checkpoint`; returns the tensors it skipped.
    progress: called as progress(hf_name, tensor) after each HF tensor is read.
    """
    with HfCheckpoint(hf_dir) as ckpt:
        skipped = check_hf_checkpoint(ckpt, spec, allow_unmapped)
        checked_arity: set[int] = set()
        for chunk in model_chunks:
            for name, local, param in global_param_names(chunk, spec, groups):
                try:
                    hf = _hf_parts(name, spec)
                except ValueError as e:
                    raise ValueError(f"learner parameter {local} ({name}) has no HF source: {e}") from None
                parts = [ckpt.get(hf_name) for hf_name, _ in hf]
                if progress is not None:
                    for (hf_name, _), part in zip(hf, parts):
                        progress(hf_name, part)
                full = _fuse(name, parts, spec)
                if len(parts) not in checked_arity:
                    _check_inverse(name, full, parts, spec)
                    checked_arity.add(len(parts))
                rank, size = tp_coords(name, groups)
                if models.tp_split(name) is models.TpSplit.VOCAB:
                    full = models.pad_vocab_rows(full, param.shape[0] * size)
                local_tensor = models.shard(name, full, rank, size)
                if local_tensor.shape != param.shape:
                    raise ValueError(
                        f"{local} ({name}): the HF tensors give a local shard of shape {list(local_tensor.shape)}, "
                        f"the learner parameter has {list(param.shape)}"
                    )
                param.copy_(local_tensor)
    return skipped

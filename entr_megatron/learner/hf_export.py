"""Export the learner's weights as HF-named full tensors (weight sync, conversion, `save_hf_checkpoint`).

    for hf_name, tensor in iter_hf_weights(chunks, spec, groups):   # every rank calls it
        ...                                                          # this stage's tensors, full size

`iter_hf_weights` gathers tensor-parallel shards (all_gather over TP, or
expert-TP for expert weights) and expert-parallel shards (all_gather over EP), so
every rank of a pipeline stage receives the full tensors of that stage's
parameters, named with global layer and expert indices. Stages do not talk to
each other: each yields its own layers (the embedding on the first stage, the
final norm and output layer on the last). `gather_hf_state_dict` collects all
stages on global rank 0, `save_hf_checkpoint` writes them as an HF model directory.

Every rank of a TP / EP group must iterate to the end, in step: the collectives
are per parameter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from entr_megatron import models
from entr_megatron.learner.hf_load import INDEX_FILE, SINGLE_FILE, global_param_names, tp_coords, unwrap_chunk

__all__ = ["gather_hf_state_dict", "iter_hf_weights", "save_hf_checkpoint"]

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _full_megatron_params(chunk, spec: models.ModelSpec, groups) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, full tensor) of a chunk's parameters; experts of every EP rank."""
    for name, local, param in global_param_names(chunk, spec, groups):
        if spec.tie_word_embeddings and local == "output_layer.weight":
            continue  # the last stage's copy of the shared embedding (PP > 1)
        tensor = param.detach()
        _, size = tp_coords(name, groups)
        if size > 1 and models.tp_split(name) is not models.TpSplit.REPLICATED:
            group = groups.expert_tp if models.is_expert_param(name) else groups.tp
            tensor = models.unshard(name, _all_gather(tensor, group, size))
        if models.is_expert_param(name) and groups.ep_size > 1:
            local_name = models.expert_local_name(name, spec.num_experts, groups.ep_size)[1]
            for ep_rank, t in enumerate(_all_gather(tensor, groups.ep, groups.ep_size)):
                yield models.expert_global_name(local_name, ep_rank, spec.num_experts, groups.ep_size), t
        else:
            yield name, tensor


# Megatron names a decoder layer's parameters "decoder.layers.<index>.<...>".
_LAYER_PREFIX = re.compile(r"decoder\.layers\.(\d+)\.")


def _layer_of(megatron_name: str) -> int | str:
    """The layer index of a parameter; "pre" / "post" for those before / after the decoder layers."""
    m = _LAYER_PREFIX.match(megatron_name)
    if m:
        return int(m.group(1))
    return "pre" if megatron_name.startswith("embedding.") else "post"


def iter_hf_weights(model_chunks, spec: models.ModelSpec, groups, *, layout: str = "checkpoint"):
    """Yield (HF name, full tensor) for this pipeline stage's parameters, on every rank of the stage.

    layout: "checkpoint" (safetensors names, one tensor per expert: what SGLang /
    vLLM load) or "transformers" (a transformers >= 5 model's state_dict: stacked
    experts, `lm_head.weight` for tied embeddings); see `models.mapping`.
    Vocabulary padding rows are dropped. Tensors may share storage with the
    parameters (TP=1, unchanged layouts): copy before modifying.
    """
    if layout not in models.HF_LAYOUTS:
        raise ValueError(f"layout={layout!r}; allowed: {models.HF_LAYOUTS}")
    for chunk in model_chunks:
        block, key = [], None
        for name, tensor in _full_megatron_params(unwrap_chunk(chunk), spec, groups):
            # One block per layer; the embedding and the final norm/output each form one too.
            k = _layer_of(name)
            if block and k != key:
                yield from models.to_hf_state_dict(block, spec, layout=layout, strict=False).items()
                block = []
            block.append((name, tensor))
            key = k
        if block:
            yield from models.to_hf_state_dict(block, spec, layout=layout, strict=False).items()


def gather_hf_state_dict(model_chunks, spec: models.ModelSpec, groups, *, layout: str = "checkpoint"):
    """The whole HF state dict on global rank 0 (None on other ranks); every rank must call it.

    Each stage exports its own tensors (`iter_hf_weights`), then the stages'
    TP-rank-0 / DP-rank-0 ranks send them to rank 0 over the pipeline group
    (pickled tensors: meant for checkpoints and tests, not for weight sync).
    """
    local = dict(iter_hf_weights(model_chunks, spec, groups, layout=layout))
    if groups.pp_size == 1:
        return local if dist.get_rank() == 0 else None
    if groups.tp_rank != 0 or groups.dp_rank != 0 or groups.cp_rank != 0:
        return None
    stages = [None] * groups.pp_size if groups.pp_rank == 0 else None
    dist.gather_object(local, stages, group=groups.pp, group_dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        duplicate = set(merged) & set(stage)
        assert not duplicate, f"two pipeline stages exported {sorted(duplicate)[:4]}"
        merged.update(stage)
    return merged


def _shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    files, size = [[]], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def _write_hf_dir(path: str, state: Mapping[str, torch.Tensor], hf_config: Mapping, max_shard_bytes: int) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(hf_config), f, indent=2, sort_keys=True)
    files = _shards(state, max_shard_bytes)
    if len(files) == 1:
        save_file({n: state[n].contiguous() for n in files[0]}, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(files, start=1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file({n: state[n].contiguous() for n in names}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_hf_checkpoint(
    model_chunks,
    spec: models.ModelSpec,
    groups,
    out_dir: str | os.PathLike,
    *,
    hf_config: Mapping,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the model as an HF directory (config.json + safetensors) from global rank 0; every rank calls it.

    hf_config: the config.json contents to write (e.g. `build.read_hf_config(source_dir)`).
    The directory appears atomically (written next to it, then renamed); an
    existing non-empty `out_dir` is refused on every rank before any work.
    """
    out_dir = os.fspath(out_dir)
    refusal = [None]
    if dist.get_rank() == 0 and os.path.isdir(out_dir) and os.listdir(out_dir):
        refusal[0] = f"{out_dir} exists and is not empty"
    dist.broadcast_object_list(refusal, group_src=0)
    if refusal[0] is not None:
        raise ValueError(refusal[0])
    state = gather_hf_state_dict(model_chunks, spec, groups, layout="checkpoint")
    if state is not None:
        tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_hf_dir(tmp, state, hf_config, max_shard_bytes)
            if os.path.isdir(out_dir):
                os.rmdir(out_dir)  # empty (checked above)
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()

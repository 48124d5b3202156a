"""A learner checkpoint as an HF model directory: where the source is, and what the directory holds.

    root, run = resolve_source(path)             # a checkpoint root, or a run directory (its checkpoints/)
    step, ckpt = checked_step(root, None)        # the step `latest` names (or the given one), files checked
    config, spec = source_model(root)            # from model_config.json
    written = write_hf_dir(tmp, ckpt, spec, config, dtype="fp32", max_shard_bytes=5 * 10**9,
                           assets=asset_source(root, run))

`write_hf_dir` streams the weights (`dist_convert.dist_to_hf`), names the shards and writes the
index, config.json (with the dtype written), the tokenizer and generation config files of
`assets` (a converted root keeps its source's in `hf_assets/`; a run has them in sft/model or
model_init), or a generation config made from the model config. Used by `convert megatron-to-hf`
and by `train` when model.path is a learner checkpoint (`controller.model_init`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from entr_megatron import models
from entr_megatron.checkpoint import directory
from entr_megatron.checkpoint.convert import copy_assets
from entr_megatron.checkpoint.dist_convert import ProgressFn, dist_to_hf, stored_dtype
from entr_megatron.checkpoint.dist_reader import DistReader
from entr_megatron.checkpoint.hf_files import HfFiles, check_hf_dir, merge_shards, write_json
from entr_megatron.checkpoint.manifest import choose_checkpoint

__all__ = ["ASSETS_DIR", "DTYPES", "HfDir", "asset_source", "checked_step", "output_dtype", "resolve_source",
           "source_model", "write_hf_dir"]

ASSETS_DIR = "hf_assets"  # in a converted checkpoint root: the source's tokenizer and generation config
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def resolve_source(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(checkpoint root, run directory or None) of a checkpoint root or run directory."""
    path = Path(path)
    found = directory.learner_checkpoint_roots(path)
    if found:
        return found[0]
    if path.name.startswith("iter_") and directory.list_steps(path.parent):
        raise ValueError(f"{path} is one step of the checkpoint root {path.parent}: pass the root {path.parent} "
                         "(and the step)")
    raise ValueError(f"{path}: not a learner checkpoint root (a 'latest' file and iter_NNNNNNN/ directories) nor a "
                     "run directory with checkpoints/")


def checked_step(root: Path, step: int | None) -> tuple[int, Path]:
    """The step to convert (`step`, else the one `latest` names) and its directory, its files checked
    against its manifest; a damaged one is refused (CheckpointError), not replaced by an older one."""
    if step is not None and step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    step, _ = directory.resolve_checkpoint_dir(root, step)
    choice = choose_checkpoint(root, step)  # raises CheckpointError naming the damaged files
    return choice.step, choice.path


def source_model(root: Path) -> tuple[dict, models.ModelSpec]:
    """The HF config in the root's model_config.json and its `ModelSpec` (the portable naming)."""
    config = directory.read_model_config(root)
    if config is None:
        raise ValueError(f"{root} has no {directory.MODEL_CONFIG_FILE}: it does not say which model it holds")
    return config, models.get_family(config).spec(config)  # an unknown model_type lists the supported ones


def asset_source(root: Path, run: Path | None, given: str | os.PathLike | None = None) -> Path | None:
    """Where the tokenizer files are: `given`, else the root's hf_assets/, else the run's sft/model or model_init."""
    candidates = [Path(given)] if given else [root / ASSETS_DIR]
    if run is not None and not given:
        candidates += [run / "sft" / "model", run / "model_init"]
    return next((c for c in candidates if c.is_dir()), None)


def output_dtype(requested: str, ckpt: Path, spec: models.ModelSpec) -> str:
    """`requested` ("fp32", "bf16"), or for "auto" the one the checkpoint stores its weights in."""
    if requested != "auto":
        return requested
    with DistReader(ckpt) as reader:
        stored = stored_dtype(reader, spec)
    names = {dtype: name for name, dtype in DTYPES.items()}
    if stored not in names:
        raise ValueError(f"--dtype auto: {ckpt} stores the weights as {stored}; pass --dtype fp32 or bf16")
    return names[stored]


@dataclasses.dataclass
class HfDir:
    """What `write_hf_dir` wrote."""

    weight_map: dict[str, str]
    files: HfFiles
    assets: list[str]


def write_hf_dir(out: Path, ckpt: Path, spec: models.ModelSpec, config: dict, *, dtype: str, max_shard_bytes: int,
                 assets: Path | None, progress: ProgressFn | None = None) -> HfDir:
    """The weights of the checkpoint directory `ckpt` as a complete HF model directory in the empty `out`."""
    dist_to_hf(ckpt, spec, out, dtype=DTYPES[dtype], max_shard_bytes=max_shard_bytes, progress=progress)
    weight_map = merge_shards(out, ["shard"])
    files = check_hf_dir(out)
    out_config = dict(config)
    out_config["torch_dtype" if "dtype" not in out_config else "dtype"] = _TORCH_NAMES[dtype]
    write_json(out / "config.json", out_config)
    copied = copy_assets(assets, out)
    if "generation_config.json" not in copied:
        import transformers

        gen = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.for_model(**config))
        gen.save_pretrained(out)
    return HfDir(weight_map, files, copied)

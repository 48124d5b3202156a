"""The run directory: its layout and the small files the job keeps there.

    run_dir/
      config.yaml           the resolved config of the latest start (the one before: config.yaml.previous)
      model_init/           HF model + tokenizer built from `model.architecture` (random, seeded), or
                            converted from model.path's learner checkpoint (converted_from.json)
      sft/model/            HF model after the supervised warm-up (its presence means "done")
      sft/metrics.jsonl
      checkpoints/          Megatron dist checkpoints (model, optimizer, scheduler, RNG, controller state)
      metrics.jsonl         one JSON object per RL step;  tensorboard/
      eval.json             held-out accuracy before and after RL
      final_model/          HF export of the last step (an earlier one: final_model.previous)

Every file is written to a temporary name and renamed, so a killed run never leaves half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from entr_megatron.config.loader import dump_config
from entr_megatron.config.run import RunConfig
from entr_megatron.utils.console import say
from entr_megatron.utils.outputs import check_output, relation

__all__ = ["WRITTEN", "RunPaths", "check_run_dir", "copy_tokenizer", "export_final_model", "read_eval", "run_inputs",
           "save_eval", "write_config"]


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where each part of a run lives under `root` (see the module docstring)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def model_init(self) -> Path:
        return self.root / "model_init"

    @property
    def sft_model(self) -> Path:
        return self.root / "sft" / "model"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def eval(self) -> Path:
        return self.root / "eval.json"

    @property
    def final_model(self) -> Path:
        return self.root / "final_model"

    def latest_model(self) -> Path | None:
        """The run's newest HF model: final_model, else sft/model, else model_init (None: none yet)."""
        return next((p for p in (self.final_model, self.sft_model, self.model_init) if (p / "config.json").exists()),
                    None)


WRITTEN = ("final_model", "final_model.previous", "sft", "checkpoints")
"""What train and sft write (replace, or remove) in a run directory: no input may lie there."""


def run_inputs(cfg: RunConfig) -> list[tuple[str, str]]:
    """(dotted field, path) of every file or directory a run's config makes it read."""
    found = [("model.path", cfg.model.path), ("model.tokenizer", cfg.model.tokenizer)]
    options = getattr(cfg.task, cfg.task.name, None)  # the chosen task's section: task.math, ...
    for f in dataclasses.fields(options) if dataclasses.is_dataclass(options) else ():
        if f.name.endswith("_files"):
            found += [(f"task.{cfg.task.name}.{f.name}", p) for p in getattr(options, f.name) or ()]
    if cfg.sft is not None:
        found += [("sft.data_files", p) for p in cfg.sft.data_files or ()]
    return [(field, str(p)) for field, p in found if p]


def check_run_dir(cfg: RunConfig, run_dir: str | os.PathLike) -> None:
    """The run directory of train or sft is not an input of `cfg`, nor inside one, and no input lies
    where the run writes (WRITTEN: final_model is replaced, final_model.previous removed). ValueError
    naming both (utils/outputs.py); run before anything is converted or written."""
    instead = "choose another --run-dir (logging.run_dir), or copy the input out of it"
    for field, src in run_inputs(cfg):
        check_output("the run directory", run_dir, [(field, src)], refused=("is", "is inside"), instead=instead)
        for name in WRITTEN:
            if relation(Path(run_dir) / name, src) in ("is", "contains"):
                raise ValueError(f"the run directory {run_dir} contains the source {field} {src} in {name}/, which "
                                 f"the run writes: writing it would replace or mix with what is being read; {instead}")


def write_config(cfg: RunConfig, paths: RunPaths) -> None:
    """Writes config.yaml; a different config of an earlier start is kept as config.yaml.previous."""
    paths.root.mkdir(parents=True, exist_ok=True)
    text = dump_config(cfg)
    if paths.config.exists() and paths.config.read_text() != text:
        say(f"the config differs from the one {paths.config} was started with; keeping the old one as "
            f"{paths.config.name}.previous")
        os.replace(paths.config, paths.config.with_suffix(".yaml.previous"))
    tmp = paths.config.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, paths.config)


def save_eval(paths: RunPaths, key: str, metrics: dict) -> None:
    """Sets `key` ("before_rl", "after_rl") of eval.json to `metrics`."""
    data = json.loads(paths.eval.read_text()) if paths.eval.exists() else {}
    data[key] = metrics
    tmp = paths.eval.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, paths.eval)


def read_eval(paths: RunPaths, key: str) -> dict | None:
    """`key` of eval.json; None when the file or the key is missing."""
    return json.loads(paths.eval.read_text()).get(key) if paths.eval.exists() else None


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files next to an exported model (the export writes config and weights only)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists() and not (dst / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())


def export_final_model(learner: Any, paths: RunPaths, tokenizer_dir: Path) -> None:
    """The learner's weights as final_model/ (HF) with the tokenizer of `tokenizer_dir`; the export
    of an earlier end of this run (train_steps since raised) becomes final_model.previous."""
    if paths.final_model.exists():
        previous = paths.final_model.with_name(paths.final_model.name + ".previous")
        if previous.exists():
            shutil.rmtree(previous)
        os.replace(paths.final_model, previous)
    learner.export_hf(str(paths.final_model))
    copy_tokenizer(tokenizer_dir, paths.final_model)

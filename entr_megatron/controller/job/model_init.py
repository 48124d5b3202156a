"""What a run starts from: the policy's tokenizer, the task, and the initial HF model.

    cfg = from_learner_checkpoint(cfg, run_dir)    # model.path a learner checkpoint: its HF export instead
    tokenizer = tokenizer_for(cfg)                 # model.tokenizer / model.path, or the character tokenizer
    task = build_task(cfg, tokenizer)              # tasks.TASK_BUILDERS[cfg.task.name]
    model_dir = prepare_model(cfg, paths, tokenizer)   # model.path, or run_dir/model_init built once

A run starts from an HF directory: the engines (transformers, SGLang) load safetensors and a
tokenizer, and the learner the same weights. `model.path` may also name a learner checkpoint
root (e.g. one `convert hf-to-megatron` wrote: weights only, step 0) or another run's directory:
its latest step is converted once, streamed (`checkpoint.hf_dir`, no model built, in the dtype it
stores), into run_dir/model_init with its tokenizer files, and the run starts from that; the
round trip is bit-identical, so the first step's log-probs are the source's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from entr_megatron.checkpoint.directory import is_learner_checkpoint
from entr_megatron.checkpoint.hf_files import staged_dir
from entr_megatron.config.run import RunConfig
from entr_megatron.controller.job.run_dir import RunPaths
from entr_megatron.tasks import TASK_BUILDERS, default_tokenizer, load_tokenizer
from entr_megatron.utils.console import say

__all__ = ["build_task", "from_learner_checkpoint", "prepare_model", "tokenizer_for"]

_SOURCE_FILE = "converted_from.json"  # in run_dir/model_init: the checkpoint step it was converted from


def from_learner_checkpoint(cfg: RunConfig, run_dir: str | os.PathLike) -> RunConfig:
    """`cfg` itself, or when model.path is a learner checkpoint root or run directory, `cfg` with
    model.path set to run_dir/model_init holding that checkpoint's latest step as an HF directory
    (converted on the first start; a later start checks it came from the same step)."""
    if not cfg.model.path or not is_learner_checkpoint(cfg.model.path):
        return cfg
    from entr_megatron.checkpoint import hf_dir  # lazy: megatron (checkpoint.state, 3-4 s), for a checkpoint only

    root, run = hf_dir.resolve_source(cfg.model.path)
    step, ckpt = hf_dir.checked_step(root, None)
    out = RunPaths(Path(run_dir)).model_init
    source = {"checkpoint": os.path.abspath(ckpt), "step": step}
    if (out / _SOURCE_FILE).is_file():
        previous = json.loads((out / _SOURCE_FILE).read_text())
        if previous != source:
            raise ValueError(f"model.path {cfg.model.path}: {out} was converted from step {previous['step']} of "
                             f"{previous['checkpoint']}, the checkpoint now gives step {step} of {ckpt}; use a "
                             "new run directory (or remove model_init to start this one over)")
    elif (out / "config.json").exists():
        raise ValueError(f"model.path {cfg.model.path} is a learner checkpoint, but {out} already holds a model "
                         "this run did not convert from it; use a new run directory")
    else:
        config, spec = hf_dir.source_model(root)
        dtype = hf_dir.output_dtype("auto", ckpt, spec)
        say(f"model.path {cfg.model.path} is a learner checkpoint: converting step {step} into {out} ({dtype})")
        with staged_dir(out, overwrite=True) as tmp:
            hf_dir.write_hf_dir(tmp, ckpt, spec, config, dtype=dtype, max_shard_bytes=5 * 10**9,
                                assets=hf_dir.asset_source(root, run))
            (tmp / _SOURCE_FILE).write_text(json.dumps(source) + "\n")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(out)))


def tokenizer_for(cfg: RunConfig) -> Any:
    """The tokenizer of `model.tokenizer` (else `model.path`); a generated task without either
    (arithmetic, calculator, search) gets the character tokenizer with its tool markers."""
    source = cfg.model.tokenizer or cfg.model.path
    if source:
        return load_tokenizer(source)
    tokenizer = default_tokenizer(cfg.task.name)
    if tokenizer is not None:
        return tokenizer
    raise ValueError(f"task.name={cfg.task.name!r} needs a tokenizer: set model.path or model.tokenizer")


def build_task(cfg: RunConfig, tokenizer: Any) -> Any:
    """The task of `cfg.task` with the policy's tokenizer; prompts longer than model.max_prompt_len
    tokens are left out (math) or refused (arithmetic). Bad data files raise here, before training."""
    # the config admits only these names
    task = TASK_BUILDERS[cfg.task.name](cfg.task, tokenizer, cfg.model.max_prompt_len)
    if hasattr(task, "set_tool_limits"):  # tool tasks: rollout.agent's limits on every call
        task.set_tool_limits(cfg.rollout.agent.tool_timeout_s, cfg.rollout.agent.max_tool_output_chars)
    return task


def prepare_model(cfg: RunConfig, paths: RunPaths, tokenizer: Any) -> Path:
    """The HF directory the run starts from: `model.path`, or a model built from
    `model.architecture` (random weights seeded by controller.seed, the tokenizer beside it)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    out = paths.model_init
    if (out / "config.json").exists():
        return out
    import transformers  # lazy: seconds of import, only to build a model from model.architecture

    arch = dict(cfg.model.architecture)
    model_type = arch.pop("model_type")
    # A model's vocabulary may be larger than its tokenizer's (Qwen: 151936 rows, 151665 tokens).
    vocab_size = arch.pop("vocab_size", len(tokenizer))
    if not isinstance(vocab_size, int) or vocab_size < len(tokenizer):
        raise ValueError(f"model.architecture.vocab_size={vocab_size!r} is not valid; must be an integer >= the "
                         f"tokenizer's {len(tokenizer)} tokens (or left out to take exactly those)")
    hf_config = transformers.AutoConfig.for_model(
        model_type, **arch, vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.controller.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    say(f"built {model_type} model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"vocab {len(tokenizer)}) in {out}")
    return out

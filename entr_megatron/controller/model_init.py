"""What a run starts from: the policy's tokenizer, the task, and the initial HF model.

    tokenizer = tokenizer_for(cfg)                 # model.tokenizer / model.path, or the character tokenizer
    task = build_task(cfg, tokenizer)              # rollout.tasks.TASK_BUILDERS[cfg.task.name]
    model_dir = prepare_model(cfg, paths, tokenizer)   # model.path, or run_dir/model_init built once
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from entr_megatron.config.run import RunConfig
from entr_megatron.controller.console import say
from entr_megatron.controller.run_dir import RunPaths

__all__ = ["build_task", "prepare_model", "tokenizer_for"]


def tokenizer_for(cfg: RunConfig) -> Any:
    """The tokenizer of `model.tokenizer` (else `model.path`); a generated task without either
    (arithmetic, calculator, search) gets the character tokenizer with its tool markers."""
    from entr_megatron.rollout.tasks import default_tokenizer, load_tokenizer

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
    from entr_megatron.rollout.tasks import TASK_BUILDERS

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
    import transformers

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

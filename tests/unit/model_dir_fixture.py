"""A small HF model directory on disk for the input checks: config.json, one safetensors file
(headers are what is checked, so the tensors need not be a whole model), a tokenizer file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}


def write_model_dir(path: Path, *, tokenizer: bool = True) -> Path:
    """`path` made an HF model directory; returns it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32), "model.norm.weight": torch.ones(32)},
              str(path / "model.safetensors"))
    if tokenizer:
        (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path

"""The file names of a Hugging Face model directory, for every module that reads or writes one
(learner/hf_load.py and hf_export.py, checkpoint/hf_files.py, the CLI). Layer L0."""

from __future__ import annotations

__all__ = ["HF_CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE"]

HF_CONFIG_FILE = "config.json"
"""The model's configuration (transformers' `PretrainedConfig.to_json_file`)."""
SINGLE_FILE = "model.safetensors"
"""The weights in one safetensors file (no index)."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of sharded weights: {"metadata", "weight_map": {tensor name: shard file}}."""

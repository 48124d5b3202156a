"""Megatron-core's known start-up warnings, collapsed into one line per run.

Without TransformerEngine and apex (always on CPU, sometimes on GPU) megatron-core warns once
per module that falls back to a local implementation: four "Transformer Engine and Apex are not
installed" and two "Apex is not installed" per process that builds a model, plus a deprecation
its own default triggers (`cuda_graph_scope="full"`). A `train` run has three such processes
(the driver and, at least, one SFT and one RL rank), so a new user's first screen was a wall
of them. Every process calls `quiet_megatron_fallbacks()` where it starts (the CLI's `main`,
`utils.spawn.enter_rank` for every rank) and the driver says once what is missing and what it
costs (`fallback_summary`). Layer L0: nothing here imports megatron or torch.
"""

from __future__ import annotations

import importlib.util
import warnings

__all__ = ["KNOWN_WARNINGS", "fallback_summary", "missing_fast_paths", "quiet_megatron_fallbacks"]

KNOWN_WARNINGS: tuple[str, ...] = (
    # optimizer/__init__, optimizer/optimizer, optimizer/clip_grads, megatron_fsdp/mixed_precision
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    # models/backends, models/gpt/gpt_layer_specs (and the other models' specs)
    r"Apex is not installed\. Falling back to Torch Norm",
    # transformer_config: megatron-core 0.16's own default cuda_graph_scope="full" (we use no CUDA graphs)
    r"full scope is deprecated\. Use empty cuda_graph_scope",
)
"""Regular expressions matched against the start of each warning's message (warnings.filterwarnings)."""

FAST_PATHS = {"transformer_engine": "Transformer Engine", "apex": "Apex"}
"""Importable name -> what the user would install."""


def quiet_megatron_fallbacks() -> None:
    """Ignore KNOWN_WARNINGS in this process from now on (every other warning still shows).
    Idempotent; call it before megatron is first imported."""
    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def missing_fast_paths() -> list[str]:
    """The names (FAST_PATHS' values) of the fast-path packages that are not importable here."""
    return [label for name, label in FAST_PATHS.items() if importlib.util.find_spec(name) is None]


def fallback_summary(on_gpu: bool) -> str | None:
    """One line saying which fast paths are missing and what that costs, or None when both are
    there. `on_gpu`: whether the learner runs on CUDA (on CPU neither package runs anyway)."""
    missing = missing_fast_paths()
    if not missing:
        return None
    what = " and ".join(missing)
    cost = ("on GPU this costs speed: no fused TE layers, attention or FP8, torch norms, multi-tensor "
            "optimizer steps in Python (the NGC image in docker/ has both)" if on_gpu
            else "expected on CPU, where neither runs: no cost")
    verb = "are" if len(missing) > 1 else "is"
    return f"{what} {verb} not installed: Megatron uses its local PyTorch layers, norms and optimizer ({cost})"

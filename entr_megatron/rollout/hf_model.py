"""The HF `transformers` causal LM an embedded engine runs, and the few cache calls it needs.

transformers is imported lazily (it is an optional dependency). The KV-cache
helpers hide the API differences between transformers 4.x (`past_key_values`,
`key_cache` lists) and 5.x (`cache`, `cache.layers`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Any

import torch

__all__ = ["DTYPES", "CausalLM", "RouteRecorder", "eos_token_ids", "has_weights", "load_causal_lm", "route_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INITS = ("auto", "pretrained", "random")
_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


def has_weights(model_dir: str) -> bool:
    """Whether the directory holds a checkpoint (not only a config)."""
    return any(os.path.exists(os.path.join(model_dir, f)) for f in _WEIGHT_FILES)


def load_causal_lm(
    model_dir: str, *, dtype: str = "float32", init: str = "auto", seed: int = 0, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """The model of `model_dir` (config.json), in eval mode and `dtype`.

    init: "pretrained" loads the checkpoint in the directory, "random" initialises from
    the config with `seed` (the same weights for the same seed), "auto" loads when a
    checkpoint is there.
    """
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model_dir {model_dir!r} has no config.json")
    with open(os.path.join(model_dir, "config.json")) as f:
        layer_types = json.load(f).get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{model_dir}: layer_types {sorted(set(layer_types))} not supported (only 'full_attention')")
    pretrained = init == "pretrained" or (init == "auto" and has_weights(model_dir))
    if pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation)
    else:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(DTYPES[dtype]).eval().requires_grad_(False)


def eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """The model's EOS id(s): generation config first (as `generate` does), then the config."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids below `num_experts` (routes are kept per token)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class RouteRecorder:
    """The top-k expert ids HF's router picked in every MoE layer, captured by forward hooks.

    An MoE block is a module with a `gate` and `experts` (Qwen3-MoE, Mixtral; transformers
    4.x and 5.x; GLM-4.5 and DeepSeek-V3, whose dense first layers have none, so the routes'
    `moe_layers` axis counts the MoE layers only, as the learner's does). A 5.x gate returns
    `(router_logits, router_scores, router_indices)` (DeepSeek's sigmoid router with its score
    bias and group limit too): the indices the experts were run with are taken as they are.
    A 4.x gate is a Linear that returns logits, and the block picks
    `topk(softmax(logits.float()), k)` (the same rule; `norm_topk_prob` rescales the weights
    only): that is recomputed here. No hook is installed on a dense model (`num_layers == 0`).
    """

    def __init__(self, model: torch.nn.Module):
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        self.num_layers = len(gates)
        num_experts = getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", 256)
        self.dtype = route_dtype(int(num_experts))
        self._layers: list[torch.Tensor] = []
        self._handles = [g.register_forward_hook(self._hook) for g in gates]

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 3:
            indices = output[2]
        elif isinstance(output, tuple) and len(output) == 2 and not output[0].is_floating_point():
            indices = output[0]  # transformers 4.x DeepSeek-V3 / GLM-4.5 router: (indices, weights)
        else:
            indices = torch.topk(torch.softmax(output.float(), dim=-1), self.top_k, dim=-1).indices
        self._layers.append(indices.reshape(-1, indices.shape[-1]).to(self.dtype))

    def reset(self) -> None:
        """Drop routes of a forward that did not finish."""
        self._layers = []

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The routes of the forward just run, ``[batch, seq, num_layers, k]``; clears them."""
        layers, self._layers = self._layers, []
        assert len(layers) == self.num_layers, f"{len(layers)} MoE gates ran, the model has {self.num_layers}"
        return torch.stack(layers, dim=1).view(batch, seq, self.num_layers, -1)


class CausalLM:
    """Forward passes of an HF causal LM over a caller-held KV cache of plain tensors.

    `record_routes`: each forward also keeps the MoE routes of its tokens in `last_routes`
    (``[B, S, moe_layers, k]``; None for a dense model or when off)."""

    def __init__(self, model: torch.nn.Module, record_routes: bool = False):
        self.model = model
        recorder = RouteRecorder(model) if record_routes else None
        self._routes = recorder if recorder is not None and recorder.num_layers else None
        self.last_routes: torch.Tensor | None = None
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        position_ids_BS: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits of the last position [B, V] and the grown cache (per layer K, V [B, H, L, D]).
        `attention_mask_BL` covers the cache and the new tokens (L = cached + S)."""
        cache = _make_cache(kv)
        if self._routes is not None:
            self._routes.reset()
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        out = self.model(
            input_ids=input_ids_BS, attention_mask=attention_mask_BL.long(), position_ids=position_ids_BS, **kwargs
        )
        if self._routes is not None:
            self.last_routes = self._routes.take(*input_ids_BS.shape)
        return out.logits[:, -1], _cache_tensors(cache)


@functools.lru_cache(maxsize=1)
def _cache_from_tensors_kw() -> str | None:
    from transformers import DynamicCache

    return "ddp_cache_data" if "ddp_cache_data" in inspect.signature(DynamicCache.__init__).parameters else None


def _make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
    from transformers import DynamicCache

    if kv is None:
        return DynamicCache()
    if _cache_from_tensors_kw() is not None:
        return DynamicCache(ddp_cache_data=kv)
    return DynamicCache.from_legacy_cache(tuple(kv))  # transformers 4.x


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4.x

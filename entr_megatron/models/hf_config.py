"""Reading HF `config.json` contents: required fields, RoPE settings, refused features.

Accepts both spellings transformers has used: `rope_theta` + `rope_scaling`
(config files written by transformers 4.x, i.e. most checkpoints) and
`rope_parameters` (transformers >= 5 `to_dict()`). Every error names the field.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

# Megatron's Llama-3 RoPE scaling (RotaryEmbedding._apply_scaling) hard-codes these;
# a checkpoint with other values would get different frequencies.
MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# The RoPE spellings of transformers 4.x config files; transformers >= 5 folds them into
# `rope_parameters` when a config class has that field (PreTrainedConfig.convert_rope_params_to_dict).
LEGACY_ROPE_FIELDS = ("rope_theta", "rope_scaling", "partial_rotary_factor")


def config_dict(hf_config: Any) -> dict:
    """A plain dict from a config mapping (parsed config.json) or a transformers config."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"expected a config dict or a transformers PretrainedConfig, got {type(hf_config)}")


@functools.cache
def hf_config_fields(model_type: str) -> tuple[str, frozenset[str]]:
    """(class name, field names) of transformers' config class for `model_type`: the parameters of
    its `__init__`, the attributes and `to_dict()` keys of a default instance, its `attribute_map`
    aliases (num_experts for num_local_experts) and, when it has `rope_parameters`, the RoPE
    spellings it converts (LEGACY_ROPE_FIELDS). Anything else given to it is kept as a plain
    attribute that no model reads. Imports transformers."""
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    names = {n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind not in skip} - {"self"}
    default = cls()
    names |= set(vars(default)) | set(default.to_dict()) | set(getattr(cls, "attribute_map", {})) | {"model_type"}
    if "rope_parameters" in names:
        names |= set(LEGACY_ROPE_FIELDS)
    return cls.__name__, frozenset(n for n in names if not n.startswith("_"))


class ConfigReader:
    """Field access on one HF config with errors that say which model and field."""

    def __init__(self, cfg: Mapping, model_type: str):
        self.cfg = cfg
        self.model_type = model_type
        self.seen: set[str] = set()  # the fields asked for (families.architecture_fields)

    def get(self, field: str, default: Any = None) -> Any:
        """The value, or `default` when the field is absent or null."""
        self.seen.add(field)
        value = self.cfg.get(field)
        return default if value is None else value

    def positive_int(self, field: str, default: int | None = None, alias: str | None = None) -> int:
        """A required (or defaulted) positive integer; `alias` is another spelling of `field`."""
        value = self.get(field)
        if value is None and alias is not None:
            field, value = alias, self.get(alias)
        value = default if value is None else value
        if value is None:
            raise ValueError(f"{self.model_type} config: required field {field!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{self.model_type} config: field {field!r} must be a positive integer, got {value!r}"
            )
        return value

    def refuse(self, field: str, value: Any, reason: str, allowed: str) -> None:
        """Raise the standard 'unsupported feature' error."""
        raise ValueError(
            f"{self.model_type} config: {field}={value!r} is not supported ({reason}); "
            f"allowed: {allowed}"
        )

    def require_value(self, field: str, allowed: tuple, reason: str, default: Any = None) -> None:
        """Refuse unless the field (absent/null counts as `default`) is one of `allowed`."""
        value = self.get(field, default)
        if value not in allowed:
            self.refuse(field, value, reason, " or ".join(repr(a) for a in allowed))

    def refuse_common(self) -> None:
        """Checks shared by every family we support."""
        self.require_value("hidden_act", ("silu",), "only SwiGLU MLPs are implemented", "silu")
        if self.get("quantization_config") is not None:
            self.refuse(
                "quantization_config",
                self.cfg["quantization_config"].get("quant_method", "?")
                if isinstance(self.cfg["quantization_config"], Mapping)
                else self.cfg["quantization_config"],
                "quantized checkpoints cannot be trained; use the bf16/fp32 weights",
                "absent",
            )
        layer_types = self.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            self.refuse(
                "layer_types",
                sorted(set(layer_types)),
                "sliding-window / non-full attention layers are not implemented",
                "only 'full_attention'",
            )

    def rope(self, default_theta: float) -> tuple[float, float | None]:
        """(rope_theta, llama3 scaling factor or None); refuses other RoPE variants."""
        params = self.get("rope_parameters")
        if params is not None:
            where, scaling = "rope_parameters", dict(params)
            theta = scaling.get("rope_theta", self.get("rope_theta", default_theta))
        else:
            where, scaling = "rope_scaling", dict(self.get("rope_scaling", {}))
            theta = self.get("rope_theta", default_theta)
        partial = scaling.get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            self.refuse("partial_rotary_factor", partial, "partial RoPE is not implemented", "1.0")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return float(theta), None
        if rope_type != "llama3":
            self.refuse(
                f"{where}.rope_type",
                rope_type,
                "Megatron's GPTModel implements plain RoPE and Llama-3 scaling only",
                " or ".join(repr(t) for t in SUPPORTED_ROPE_TYPES),
            )
        for key, expected in MEGATRON_LLAMA3_ROPE.items():
            if scaling.get(key) != expected:
                self.refuse(
                    f"{where}.{key}",
                    scaling.get(key),
                    "Megatron's Llama-3 RoPE scaling hard-codes this value",
                    repr(expected),
                )
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            self.refuse(f"{where}.factor", factor, "Llama-3 RoPE needs a positive factor", "> 0")
        return float(theta), float(factor)

"""Reading HF `config.json` contents: required fields, RoPE settings, refused features.

Accepts both spellings transformers has used: `rope_theta` + `rope_scaling`
(config files written by transformers 4.x, i.e. most checkpoints) and
`rope_parameters` (transformers >= 5 `to_dict()`). Every error names the field.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

from entr_megatron.models.spec import YarnRope

# Megatron's Llama-3 RoPE scaling (RotaryEmbedding._apply_scaling) hard-codes these;
# a checkpoint with other values would get different frequencies.
MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# HF's YaRN defaults (modeling_rope_utils._compute_yarn_parameters: `beta_fast or 32`, ...).
HF_YARN_BETA_FAST, HF_YARN_BETA_SLOW = 32.0, 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature term (the same function in HF and in Megatron)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
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

    def rope(self, default_theta: float, *, partial_default: float | None = None, yarn: bool = False) -> dict[str, Any]:
        """The RoPE fields of a `ModelSpec` (rope_theta, llama3_rope_factor, rotary_percent, yarn).

        partial_default: accept partial_rotary_factor < 1 (the first dims of each head rotate), this
        being transformers' default when the config omits it; None: refuse it. yarn: accept
        rope_type 'yarn' (instead of 'llama3': multi-latent attention's RoPE). Anything else is refused."""
        params = self.get("rope_parameters")
        if params is not None:
            where, scaling = "rope_parameters", dict(params)
            theta = scaling.get("rope_theta", self.get("rope_theta", default_theta))
        else:
            where, scaling = "rope_scaling", dict(self.get("rope_scaling", {}))
            theta = self.get("rope_theta", default_theta)
        fields: dict[str, Any] = dict(rope_theta=float(theta), llama3_rope_factor=None, rotary_percent=1.0, yarn=None)
        percent = scaling.get("partial_rotary_factor", self.get("partial_rotary_factor", partial_default or 1.0))
        if percent != 1.0:
            if partial_default is None:
                self.refuse("partial_rotary_factor", percent, "partial RoPE is not implemented for this family", "1.0")
            if not isinstance(percent, (int, float)) or isinstance(percent, bool) or not 0 < percent < 1:
                self.refuse("partial_rotary_factor", percent, "must be a fraction of the head dims", "(0, 1]")
            fields["rotary_percent"] = float(percent)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        allowed = ("default", "yarn" if yarn else "llama3")
        if rope_type == "default":
            return fields
        if rope_type not in allowed:
            reason = ("Megatron's multi-latent attention implements plain RoPE and YaRN only" if yarn
                      else "Megatron's GPTModel implements plain RoPE and Llama-3 scaling only")
            self.refuse(f"{where}.rope_type", rope_type, reason, " or ".join(repr(t) for t in allowed))
        if rope_type == "yarn":
            return fields | dict(yarn=self._yarn(where, scaling))
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
        return fields | dict(llama3_rope_factor=float(factor))

    def _yarn(self, where: str, scaling: Mapping) -> YarnRope:
        """HF's YaRN parameters as Megatron takes them, refusing what Megatron would compute differently."""
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            self.refuse(f"{where}.original_max_position_embeddings", original, "YaRN needs the pre-training length",
                        "a positive integer")
        factor = scaling.get("factor")
        if factor is None:  # HF: the ratio of the lengths (DeepSeek-V3's convention)
            factor = self.positive_int("max_position_embeddings") / original
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            self.refuse(f"{where}.factor", factor, "YaRN needs a positive factor", "> 0")
        if scaling.get("truncate", True) is not True:
            self.refuse(f"{where}.truncate", scaling.get("truncate"),
                        "Megatron's YaRN always rounds the correction range to integers", "true")
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        # HF's factor on cos/sin (an explicit attention_factor, else from mscale / mscale_all_dim when
        # both are set, else from the factor alone); Megatron's is always the mscale ratio.
        hf = scaling.get("attention_factor")
        if hf is None:
            hf = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                  else yarn_get_mscale(factor))
        rope = YarnRope(factor=float(factor), original_max_position_embeddings=original,
                        beta_fast=float(scaling.get("beta_fast") or HF_YARN_BETA_FAST),
                        beta_slow=float(scaling.get("beta_slow") or HF_YARN_BETA_SLOW),
                        mscale=float(mscale or 1.0), mscale_all_dim=float(mscale_all_dim or 0.0))
        megatron = yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        if not math.isclose(hf, megatron, rel_tol=1e-12):
            field = "attention_factor" if scaling.get("attention_factor") is not None else "mscale"
            self.refuse(f"{where}.{field}", scaling.get(field),
                        f"HF scales cos/sin by {hf!r}, Megatron's YaRN by get_mscale(factor, mscale) / "
                        f"get_mscale(factor, mscale_all_dim) = {megatron!r}", "values that agree")
        return rope

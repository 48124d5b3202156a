"""Model families: how each HF `model_type` reads its config, and the registry.

A family is data plus one small reader function. The reader validates the HF
config (refusing what Megatron would compute differently) and returns the fields
of a `ModelSpec`; everything else (Megatron kwargs, names, layouts) is derived
from the spec by shared code.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from entr_megatron.models import mapping, megatron_config, tables
from entr_megatron.models.hf_config import ConfigReader, config_dict, hf_config_fields
from entr_megatron.models.spec import MegatronNaming, ModelSpec


@dataclass(frozen=True)
class HfDefaults:
    """Values transformers' config class uses when a config.json omits the field."""

    rms_norm_eps: float
    rope_theta: float
    head_dim: int | None  # None: hidden_size // num_attention_heads


def _read_dense(r: ConfigReader, defaults: HfDefaults) -> dict[str, Any]:
    """Fields every family shares (attention, embeddings, dense MLP width, RoPE)."""
    r.refuse_common()
    hidden = r.positive_int("hidden_size")
    heads = r.positive_int("num_attention_heads")
    head_dim_default = defaults.head_dim if defaults.head_dim is not None else hidden // heads
    theta, llama3_factor = r.rope(defaults.rope_theta)
    return dict(
        num_layers=r.positive_int("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=r.positive_int("num_key_value_heads"),
        head_dim=r.positive_int("head_dim", head_dim_default),
        ffn_hidden_size=r.positive_int("intermediate_size"),
        vocab_size=r.positive_int("vocab_size"),
        max_position_embeddings=r.positive_int("max_position_embeddings"),
        rms_norm_eps=float(r.get("rms_norm_eps", defaults.rms_norm_eps)),
        rope_theta=theta,
        llama3_rope_factor=llama3_factor,
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=False,
    )


_NO_BIAS = "Megatron's add_bias_linear would also add biases HF does not have"
_NO_SLIDING = "sliding-window attention is not implemented"
_NO_DENSE_IN_MOE = "dense layers inside an MoE model are not implemented"


def read_llama(r: ConfigReader) -> dict[str, Any]:
    """Llama-3 (3.0, 3.1/3.2 with Llama-3 RoPE scaling)."""
    r.require_value("attention_bias", (False,), _NO_BIAS, False)
    r.require_value("mlp_bias", (False,), _NO_BIAS, False)
    return _read_dense(r, HfDefaults(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=None))


def read_qwen2(r: ConfigReader) -> dict[str, Any]:
    """Qwen2 / Qwen2.5: bias on q, k, v only (hard-wired in HF, not a config field)."""
    r.require_value("use_sliding_window", (False,), _NO_SLIDING, False)
    fields = _read_dense(r, HfDefaults(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=None))
    return fields | dict(qkv_bias=True)


def read_qwen3(r: ConfigReader) -> dict[str, Any]:
    """Qwen3 dense: per-head RMSNorm on q and k, no biases, head_dim defaults to 128."""
    r.require_value("attention_bias", (False,), _NO_BIAS, False)
    r.require_value("use_sliding_window", (False,), _NO_SLIDING, False)
    fields = _read_dense(r, HfDefaults(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=128))
    return fields | dict(qk_norm=True)


def read_qwen3_moe(r: ConfigReader) -> dict[str, Any]:
    """Qwen3-MoE: every layer MoE, no shared expert; softmax, top-k, renormalise iff norm_topk_prob."""
    r.require_value("attention_bias", (False,), _NO_BIAS, False)
    r.require_value("use_sliding_window", (False,), _NO_SLIDING, False)
    if r.get("mlp_only_layers", []):
        r.refuse("mlp_only_layers", r.get("mlp_only_layers"), _NO_DENSE_IN_MOE, "[]")
    r.require_value("decoder_sparse_step", (1,), _NO_DENSE_IN_MOE, 1)
    fields = _read_dense(r, HfDefaults(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=None))
    norm_topk = r.get("norm_topk_prob", False)
    if not isinstance(norm_topk, bool):
        r.refuse("norm_topk_prob", norm_topk, "must be a boolean", "true or false")
    return fields | dict(
        qk_norm=True,
        # config.json says num_experts; transformers >= 5 to_dict() says num_local_experts.
        num_experts=r.positive_int("num_experts", alias="num_local_experts"),
        moe_router_topk=r.positive_int("num_experts_per_tok"),
        moe_ffn_hidden_size=r.positive_int("moe_intermediate_size"),
        # Renormalised top-k of a softmax == softmax over the top-k logits (Megatron's
        # default); without renormalisation Megatron must softmax first.
        moe_router_pre_softmax=not norm_topk,
    )


def read_mixtral(r: ConfigReader) -> dict[str, Any]:
    """Mixtral: every layer MoE; softmax, top-k, renormalise (= softmax over top-k logits)."""
    if r.get("sliding_window") is not None:
        r.refuse("sliding_window", r.get("sliding_window"), _NO_SLIDING, "null")
    r.require_value("router_jitter_noise", (0, 0.0), "router jitter is not implemented", 0.0)
    fields = _read_dense(r, HfDefaults(rms_norm_eps=1e-5, rope_theta=1e6, head_dim=None))
    return fields | dict(
        num_experts=r.positive_int("num_local_experts"),
        moe_router_topk=r.positive_int("num_experts_per_tok"),
        moe_ffn_hidden_size=fields["ffn_hidden_size"],
        moe_router_pre_softmax=False,
    )


@dataclass(frozen=True)
class ModelFamily:
    """One architecture: its config reader and its name tables."""

    model_type: str
    read: Callable[[ConfigReader], dict[str, Any]]
    table: tables.FamilyTable

    def spec(
        self, hf_config: Any, *, te_fused_norms: bool = False, grouped_experts: bool = False
    ) -> ModelSpec:
        """Validated `ModelSpec` from an HF config (dict or transformers config object)."""
        cfg = config_dict(hf_config)
        found = cfg.get("model_type", self.model_type)
        if found != self.model_type:
            raise ValueError(
                f"config model_type={found!r} given to the {self.model_type!r} family; "
                f"use get_family({found!r})"
            )
        fields = self.read(ConfigReader(cfg, self.model_type))
        naming = MegatronNaming(te_fused_norms=te_fused_norms, grouped_experts=grouped_experts)
        return ModelSpec(model_type=self.model_type, table=self.table, naming=naming, **fields)

    def transformer_config_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """Megatron `TransformerConfig` kwargs (see `megatron_config.transformer_config_kwargs`)."""
        return megatron_config.transformer_config_kwargs(self.spec(hf_config))

    def gpt_model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """Megatron `GPTModel` kwargs (see `megatron_config.gpt_model_kwargs`)."""
        return megatron_config.gpt_model_kwargs(self.spec(hf_config))

    def to_hf(self, megatron_name: str, tensor: torch.Tensor, spec: ModelSpec):
        """See `mapping.to_hf`."""
        return mapping.to_hf(megatron_name, tensor, spec)

    def from_hf(self, source: Mapping | Callable, spec: ModelSpec, **kwargs):
        """See `mapping.from_hf`."""
        return mapping.from_hf(source, spec, **kwargs)

    def to_hf_state_dict(self, megatron_params: Mapping | Iterable, spec: ModelSpec, **kwargs):
        """See `mapping.to_hf_state_dict`."""
        return mapping.to_hf_state_dict(megatron_params, spec, **kwargs)

    def hf_names(self, spec: ModelSpec, layout: str = "checkpoint") -> list[str]:
        """See `mapping.hf_names`."""
        return mapping.hf_names(spec, layout)


FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", read_llama, tables.LLAMA),
    "qwen2": ModelFamily("qwen2", read_qwen2, tables.QWEN2),
    "qwen3": ModelFamily("qwen3", read_qwen3, tables.QWEN3),
    "qwen3_moe": ModelFamily("qwen3_moe", read_qwen3_moe, tables.QWEN3_MOE),
    "mixtral": ModelFamily("mixtral", read_mixtral, tables.MIXTRAL),
}
"""The registry: HF `model_type` -> family."""


def get_family(model_type_or_config: Any) -> ModelFamily:
    """The family for an HF `model_type` string, config dict or transformers config."""
    if isinstance(model_type_or_config, str):
        model_type = model_type_or_config
    else:
        model_type = config_dict(model_type_or_config).get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return family


def model_spec(hf_config: Any, *, te_fused_norms: bool = False, grouped_experts: bool = False) -> ModelSpec:
    """`get_family(hf_config).spec(hf_config, ...)`: the usual entry point."""
    return get_family(hf_config).spec(
        hf_config, te_fused_norms=te_fused_norms, grouped_experts=grouped_experts
    )


# --- a model built from config fields (a run's model.architecture) --------------------------


@functools.cache
def architecture_fields(model_type: str) -> tuple[str, frozenset[str]]:
    """(name of transformers' config class, the keys an architecture of this family may hold): the
    class's fields (`hf_config_fields`) and those the family's reader consults (head_dim, which
    Qwen2Config lacks but HF's Qwen2 attention reads when present). Imports transformers."""
    import transformers

    family = get_family(model_type)
    name, fields = hf_config_fields(model_type)
    reader = ConfigReader(transformers.CONFIG_MAPPING[model_type]().to_dict(), model_type)
    family.read(reader)
    return name, fields | reader.seen


def check_architecture(architecture: Mapping[str, Any], where: str = "model.architecture") -> None:
    """Refuse HF config fields (e.g. a run's `model.architecture`) whose model_type has no family, or
    holding a key that transformers' config class of that model_type does not know: transformers
    keeps such a key as an attribute no model reads, so a typo (`num_hidden_layer: 2`) would build
    the default instead. Errors name `<where>.<key>` and the closest valid names."""
    model_type = architecture.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{where}.model_type={model_type!r} is not valid; allowed: {', '.join(FAMILIES)}")
    class_name, fields = architecture_fields(model_type)
    for key in architecture:
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=3, cutoff=0.6)
            hint = (f": did you mean {close[0]!r}? Closest valid names: {', '.join(close)}" if close
                    else f"; valid names: {', '.join(sorted(fields))}")
            raise ValueError(f"unknown key {where}.{key} (transformers' {class_name} has no such field and "
                             f"would ignore it){hint}")


def architecture_hf_config(architecture: Mapping[str, Any], where: str = "model.architecture") -> dict:
    """The HF config (what its config.json would hold) transformers builds from `architecture`, its
    keys checked first (`check_architecture`). A left-out vocab_size takes transformers' default
    (a run's tokenizer sets the real one when it builds the model). Raises ValueError naming `where`."""
    import transformers

    check_architecture(architecture, where)
    fields = dict(architecture)
    model_type = fields.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' own checks of the values: the input is at fault
        raise ValueError(f"{where}: transformers refuses it: {' '.join(str(e).split())}") from None

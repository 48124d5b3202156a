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
from entr_megatron.models.spec import LatentAttention, MegatronNaming, ModelSpec


@dataclass(frozen=True)
class HfDefaults:
    """Values transformers' config class uses when a config.json omits the field."""

    rms_norm_eps: float
    rope_theta: float
    head_dim: int | None  # None: hidden_size // num_attention_heads


def _read_common(r: ConfigReader, defaults: HfDefaults, **rope: Any) -> dict[str, Any]:
    """Fields every family shares (embeddings, layers, dense MLP width, norms, RoPE); `rope` goes to
    `ConfigReader.rope` (partial RoPE, YaRN)."""
    r.refuse_common()
    return dict(
        num_layers=r.positive_int("num_hidden_layers"),
        hidden_size=r.positive_int("hidden_size"),
        num_attention_heads=r.positive_int("num_attention_heads"),
        ffn_hidden_size=r.positive_int("intermediate_size"),
        vocab_size=r.positive_int("vocab_size"),
        max_position_embeddings=r.positive_int("max_position_embeddings"),
        rms_norm_eps=float(r.get("rms_norm_eps", defaults.rms_norm_eps)),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=False,
        **r.rope(defaults.rope_theta, **rope),
    )


def _read_dense(r: ConfigReader, defaults: HfDefaults, **rope: Any) -> dict[str, Any]:
    """`_read_common` and grouped-query attention's shape."""
    fields = _read_common(r, defaults, **rope)
    head_dim_default = (defaults.head_dim if defaults.head_dim is not None
                        else fields["hidden_size"] // fields["num_attention_heads"])
    return fields | dict(
        num_query_groups=r.positive_int("num_key_value_heads"),
        head_dim=r.positive_int("head_dim", head_dim_default),
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


def _boolean(r: ConfigReader, field: str, default: bool) -> bool:
    value = r.get(field, default)
    if not isinstance(value, bool):
        r.refuse(field, value, "must be a boolean", "true or false")
    return value


def _non_negative_int(r: ConfigReader, field: str, default: int, alias: str | None = None) -> int:
    value = r.get(field)
    if value is None and alias is not None:
        field, value = alias, r.get(alias)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{r.model_type} config: field {field!r} must be an integer >= 0, got {value!r}")
    return value


def _read_sigmoid_router(r: ConfigReader, *, groups: tuple[int, int], scaling: float,
                         first_dense: int) -> dict[str, Any]:
    """DeepSeek-V3's MoE layers (GLM-4.5's are the same): sigmoid scores, `e_score_correction_bias`
    added to choose the experts (from the best `topk_group` of `n_group` groups, a group scored by
    its two best experts), the chosen scores renormalised and multiplied by routed_scaling_factor;
    a shared expert MLP beside them; the first `first_k_dense_replace` layers dense.

    Megatron's sigmoid router (moe_utils.topk_routing_with_score_function) always renormalises when
    top-k > 1 and never at top-k = 1, and scores a group by its best top_k // group_topk experts:
    configs where that differs from HF are refused."""
    experts = r.positive_int("n_routed_experts", alias="num_local_experts")
    topk = r.positive_int("num_experts_per_tok")
    if not _boolean(r, "norm_topk_prob", True):
        r.refuse("norm_topk_prob", False, "Megatron's sigmoid router always renormalises the top-k weights", "true")
    if topk == 1:
        r.refuse("num_experts_per_tok", 1, "Megatron's sigmoid router does not renormalise a single expert's "
                 "weight, HF does (to 1)", ">= 2")
    n_group, topk_group = r.positive_int("n_group", groups[0]), r.positive_int("topk_group", groups[1])
    if experts % n_group or experts // n_group < 2:
        r.refuse("n_group", n_group, f"must split n_routed_experts={experts} into groups of 2 or more experts",
                 f"a divisor of {experts} at most {experts // 2}")
    if topk_group > n_group:
        r.refuse("topk_group", topk_group, f"more groups than n_group={n_group}", f"<= {n_group}")
    grouped = topk_group < n_group  # choosing every group is no choice
    if grouped and topk // topk_group != 2:
        r.refuse("topk_group", topk_group, "HF scores a group by its 2 best experts, Megatron by its best "
                 f"num_experts_per_tok // topk_group = {topk // topk_group}", f"num_experts_per_tok / 2 = {topk / 2:g}")
    factor = r.get("routed_scaling_factor", scaling)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        r.refuse("routed_scaling_factor", factor, "must be a positive number", "> 0")
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=r.positive_int("moe_intermediate_size"),
        moe_router_score="sigmoid",
        moe_expert_bias=True,
        moe_router_num_groups=n_group if grouped else None,
        moe_router_group_topk=topk_group if grouped else None,
        moe_router_scaling_factor=float(factor),
        moe_shared_expert_size=r.positive_int("moe_intermediate_size") * r.positive_int("n_shared_experts", 1),
        first_k_dense=_non_negative_int(r, "first_k_dense_replace", first_dense),
        mtp_layers=_non_negative_int(r, "num_nextn_predict_layers", 1, alias="num_mtp_layers"),
    )


def read_glm4_moe(r: ConfigReader) -> dict[str, Any]:
    """GLM-4.5 / 4.6 MoE: Llama attention with q/k/v bias (attention_bias), optional per-head q/k
    RMSNorm (use_qk_norm), partial RoPE (default half of each head), DeepSeek-V3's router."""
    fields = _read_dense(r, HfDefaults(rms_norm_eps=1e-5, rope_theta=10000.0, head_dim=None), partial_default=0.5)
    return fields | dict(
        qkv_bias=_boolean(r, "attention_bias", False),
        qk_norm=_boolean(r, "use_qk_norm", False),
    ) | _read_sigmoid_router(r, groups=(1, 1), scaling=1.0, first_dense=1)


def read_deepseek_v3(r: ConfigReader) -> dict[str, Any]:
    """DeepSeek-V3 (and V3-style checkpoints): multi-latent attention (q/kv LoRA ranks, decoupled
    RoPE dims, interleaved RoPE, YaRN with mscale), DeepSeek's router, dense first layers."""
    r.require_value("attention_bias", (False,), "Megatron's MLA projections have no biases", False)
    r.require_value("rope_interleave", (True,), "Megatron's MLA de-interleaves the RoPE dims of q and k "
                    "(HF rope_interleave=true)", True)
    eps = float(r.get("rms_norm_eps", 1e-6))
    if eps != 1e-6:
        r.refuse("rms_norm_eps", eps, "HF's latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever "
                 "rms_norm_eps says, Megatron's use rms_norm_eps", "1e-06")
    fields = _read_common(r, HfDefaults(rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=None), yarn=True)
    # q_lora_rank: null in config.json means one q projection (DeepSeek-V2-Lite); absent, transformers' 1536.
    q_lora = None if "q_lora_rank" in r.cfg and r.cfg["q_lora_rank"] is None else r.positive_int("q_lora_rank", 1536)
    mla = LatentAttention(
        q_lora_rank=q_lora,
        kv_lora_rank=r.positive_int("kv_lora_rank", 512),
        qk_nope_head_dim=r.positive_int("qk_nope_head_dim", 128),
        qk_rope_head_dim=r.positive_int("qk_rope_head_dim", 64),
        v_head_dim=r.positive_int("v_head_dim", 128),
    )
    return fields | dict(
        mla=mla, num_query_groups=fields["num_attention_heads"], head_dim=mla.v_head_dim,
    ) | _read_sigmoid_router(r, groups=(8, 4), scaling=2.5, first_dense=3)


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
    "glm4_moe": ModelFamily("glm4_moe", read_glm4_moe, tables.GLM4_MOE),
    "deepseek_v3": ModelFamily("deepseek_v3", read_deepseek_v3, tables.DEEPSEEK_V3),
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

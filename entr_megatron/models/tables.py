"""Megatron <-> HF parameter-name tables, one per architecture. Data only.

Megatron names are those of `megatron.core.models.gpt.GPTModel` (no DDP/`module.`
prefix) with *global* layer and expert indices. The tables are written with the
names of Megatron's local/portable layer spec and SequentialMLP experts; the
TransformerEngine spec (norms fused into the following linear) and grouped-GEMM
experts (TEGroupedMLP) are explicit rename tables applied on top.

HF names are those of the safetensors checkpoint on disk (and of what SGLang and
vLLM load). transformers >= 5 holds MoE experts differently in memory (one
stacked tensor per layer); that layout is described by `transformers_*` below.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Layout(enum.Enum):
    """How one Megatron tensor relates to its HF tensor(s)."""

    IDENTITY = "identity"  # one HF tensor, same values and shape
    VOCAB = "vocab"  # identity, but Megatron may carry zero padding rows past the vocab
    QKV = "qkv"  # linear_qkv <-> (q_proj, k_proj, v_proj), interleaved per query group
    GATED = "gated"  # linear_fc1 <-> (gate_proj, up_proj), concatenated gate first


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter template and the HF template(s) it is made of."""

    megatron: str
    hf: tuple[str, ...]
    layout: Layout = Layout.IDENTITY
    untied_only: bool = False  # exists only when embeddings and output are not tied


@dataclass(frozen=True)
class StackedExperts:
    """transformers >= 5 in-memory expert tensor: `fused[e] = cat(parts[e], dim=0)`."""

    fused: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class FamilyTable:
    """Everything name-related about one architecture."""

    rules: tuple[Rule, ...]
    te_fused_norms: tuple[tuple[str, str], ...]  # local-spec Megatron name -> TE-spec name
    grouped_experts: tuple[tuple[str, str], ...]  # SequentialMLP name -> TEGroupedMLP name
    transformers_renames: tuple[tuple[str, str], ...] = ()  # checkpoint HF -> in-memory HF
    transformers_stacked: tuple[StackedExperts, ...] = ()


# --- Megatron templates -------------------------------------------------------------

_ML = "decoder.layers.{layer}."
_MEXP = _ML + "mlp.experts.local_experts.{expert}."

MEGATRON_EMBEDDING = "embedding.word_embeddings.weight"
MEGATRON_FINAL_NORM = "decoder.final_layernorm.weight"
MEGATRON_OUTPUT = "output_layer.weight"
MEGATRON_INPUT_NORM = _ML + "input_layernorm.weight"
MEGATRON_QKV_WEIGHT = _ML + "self_attention.linear_qkv.weight"
MEGATRON_QKV_BIAS = _ML + "self_attention.linear_qkv.bias"
MEGATRON_PROJ = _ML + "self_attention.linear_proj.weight"
MEGATRON_Q_NORM = _ML + "self_attention.q_layernorm.weight"
MEGATRON_K_NORM = _ML + "self_attention.k_layernorm.weight"
MEGATRON_PRE_MLP_NORM = _ML + "pre_mlp_layernorm.weight"
MEGATRON_FC1 = _ML + "mlp.linear_fc1.weight"
MEGATRON_FC2 = _ML + "mlp.linear_fc2.weight"
MEGATRON_ROUTER = _ML + "mlp.router.weight"
MEGATRON_EXPERT_FC1 = _MEXP + "linear_fc1.weight"
MEGATRON_EXPERT_FC2 = _MEXP + "linear_fc2.weight"

# TransformerEngine spec: TELayerNormColumnParallelLinear carries the preceding norm.
MEGATRON_TE_INPUT_NORM = _ML + "self_attention.linear_qkv.layer_norm_weight"
MEGATRON_TE_PRE_MLP_NORM = _ML + "mlp.linear_fc1.layer_norm_weight"
# TEGroupedMLP: one TEGroupedLinear per projection, parameters weight0..weight{E-1}.
MEGATRON_GROUPED_FC1 = _ML + "mlp.experts.linear_fc1.weight{expert}"
MEGATRON_GROUPED_FC2 = _ML + "mlp.experts.linear_fc2.weight{expert}"

# A dense layer's MLP norm fuses into linear_fc1; an MoE layer keeps it separate
# (the router and experts both read the normed input).
DENSE_TE_NORMS = (
    (MEGATRON_INPUT_NORM, MEGATRON_TE_INPUT_NORM),
    (MEGATRON_PRE_MLP_NORM, MEGATRON_TE_PRE_MLP_NORM),
)
MOE_TE_NORMS = ((MEGATRON_INPUT_NORM, MEGATRON_TE_INPUT_NORM),)
GROUPED_EXPERTS = (
    (MEGATRON_EXPERT_FC1, MEGATRON_GROUPED_FC1),
    (MEGATRON_EXPERT_FC2, MEGATRON_GROUPED_FC2),
)

# --- HF templates and the per-family tables -----------------------------------------

_HL = "model.layers.{layer}."
_HATT = _HL + "self_attn."

_EMBEDDINGS = (
    Rule(MEGATRON_EMBEDDING, ("model.embed_tokens.weight",), Layout.VOCAB),
    Rule(MEGATRON_FINAL_NORM, ("model.norm.weight",)),
    Rule(MEGATRON_OUTPUT, ("lm_head.weight",), Layout.VOCAB, untied_only=True),
)
_ATTENTION = (
    Rule(MEGATRON_INPUT_NORM, (_HL + "input_layernorm.weight",)),
    Rule(
        MEGATRON_QKV_WEIGHT,
        (_HATT + "q_proj.weight", _HATT + "k_proj.weight", _HATT + "v_proj.weight"),
        Layout.QKV,
    ),
    Rule(MEGATRON_PROJ, (_HATT + "o_proj.weight",)),
    Rule(MEGATRON_PRE_MLP_NORM, (_HL + "post_attention_layernorm.weight",)),
)
_QKV_BIAS = (
    Rule(
        MEGATRON_QKV_BIAS,
        (_HATT + "q_proj.bias", _HATT + "k_proj.bias", _HATT + "v_proj.bias"),
        Layout.QKV,
    ),
)
_QK_NORM = (
    Rule(MEGATRON_Q_NORM, (_HATT + "q_norm.weight",)),
    Rule(MEGATRON_K_NORM, (_HATT + "k_norm.weight",)),
)
_DENSE_MLP = (
    Rule(MEGATRON_FC1, (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"), Layout.GATED),
    Rule(MEGATRON_FC2, (_HL + "mlp.down_proj.weight",)),
)

_QWEN_EXP = _HL + "mlp.experts.{expert}."
_QWEN_MOE_MLP = (
    Rule(MEGATRON_ROUTER, (_HL + "mlp.gate.weight",)),
    Rule(
        MEGATRON_EXPERT_FC1,
        (_QWEN_EXP + "gate_proj.weight", _QWEN_EXP + "up_proj.weight"),
        Layout.GATED,
    ),
    Rule(MEGATRON_EXPERT_FC2, (_QWEN_EXP + "down_proj.weight",)),
)
# Mixtral checkpoints: w1 = gate, w3 = up, w2 = down.
_MIX_EXP = _HL + "block_sparse_moe.experts.{expert}."
_MIXTRAL_MOE_MLP = (
    Rule(MEGATRON_ROUTER, (_HL + "block_sparse_moe.gate.weight",)),
    Rule(MEGATRON_EXPERT_FC1, (_MIX_EXP + "w1.weight", _MIX_EXP + "w3.weight"), Layout.GATED),
    Rule(MEGATRON_EXPERT_FC2, (_MIX_EXP + "w2.weight",)),
)

# transformers >= 5 in memory: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I].
_QWEN_MOE_STACKED = (
    StackedExperts(
        _HL + "mlp.experts.gate_up_proj",
        (_QWEN_EXP + "gate_proj.weight", _QWEN_EXP + "up_proj.weight"),
    ),
    StackedExperts(_HL + "mlp.experts.down_proj", (_QWEN_EXP + "down_proj.weight",)),
)
_MIXTRAL_STACKED = (
    StackedExperts(
        _HL + "mlp.experts.gate_up_proj", (_MIX_EXP + "w1.weight", _MIX_EXP + "w3.weight")
    ),
    StackedExperts(_HL + "mlp.experts.down_proj", (_MIX_EXP + "w2.weight",)),
)

LLAMA = FamilyTable(_EMBEDDINGS + _ATTENTION + _DENSE_MLP, DENSE_TE_NORMS, GROUPED_EXPERTS)
QWEN2 = FamilyTable(
    _EMBEDDINGS + _ATTENTION + _QKV_BIAS + _DENSE_MLP, DENSE_TE_NORMS, GROUPED_EXPERTS
)
QWEN3 = FamilyTable(
    _EMBEDDINGS + _ATTENTION + _QK_NORM + _DENSE_MLP, DENSE_TE_NORMS, GROUPED_EXPERTS
)
QWEN3_MOE = FamilyTable(
    _EMBEDDINGS + _ATTENTION + _QK_NORM + _QWEN_MOE_MLP,
    MOE_TE_NORMS,
    GROUPED_EXPERTS,
    transformers_stacked=_QWEN_MOE_STACKED,
)
MIXTRAL = FamilyTable(
    _EMBEDDINGS + _ATTENTION + _MIXTRAL_MOE_MLP,
    MOE_TE_NORMS,
    GROUPED_EXPERTS,
    transformers_renames=((_HL + "block_sparse_moe.gate.weight", _HL + "mlp.gate.weight"),),
    transformers_stacked=_MIXTRAL_STACKED,
)

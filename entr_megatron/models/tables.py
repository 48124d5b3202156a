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


class LayerKind(enum.Enum):
    """Which decoder layers a rule's `{layer}` ranges over."""

    ALL = "all"
    DENSE = "dense"  # layers with a dense MLP (every layer of a dense model, the first k of some MoE ones)
    MOE = "moe"  # layers with a mixture of experts


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter template and the HF template(s) it is made of."""

    megatron: str
    hf: tuple[str, ...]
    layout: Layout = Layout.IDENTITY
    untied_only: bool = False  # exists only when embeddings and output are not tied
    layers: LayerKind = LayerKind.ALL
    when: str | None = None  # a boolean ModelSpec attribute the parameter exists under (e.g. "qk_norm")


@dataclass(frozen=True)
class StackedExperts:
    """transformers >= 5 in-memory expert tensor: `fused[e] = cat(parts[e], dim=0)`."""

    fused: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class FamilyTable:
    """Everything name-related about one architecture."""

    rules: tuple[Rule, ...]
    te_fused_norms: tuple[tuple[str, str], ...] | None  # local-spec Megatron name -> TE-spec name
    # (applied to ALL- and DENSE-layer rules: an MoE layer keeps its pre-MLP norm, which the router
    # and the experts both read); None: the family has no TransformerEngine naming (portable spec only)
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
MEGATRON_EXPERT_BIAS = _ML + "mlp.router.expert_bias"  # a float32 buffer, not a parameter
MEGATRON_SHARED_FC1 = _ML + "mlp.shared_experts.linear_fc1.weight"
MEGATRON_SHARED_FC2 = _ML + "mlp.shared_experts.linear_fc2.weight"
# Multi-latent attention (MLASelfAttention, portable spec: separate q/kv latent norms).
_MATT = _ML + "self_attention."
MEGATRON_MLA_Q = _MATT + "linear_q_proj.weight"
MEGATRON_MLA_Q_DOWN = _MATT + "linear_q_down_proj.weight"
MEGATRON_MLA_Q_UP = _MATT + "linear_q_up_proj.weight"
MEGATRON_MLA_Q_NORM = MEGATRON_Q_NORM  # the same module name: MLA's q latent norm (q_lora_rank wide)
MEGATRON_MLA_KV_DOWN = _MATT + "linear_kv_down_proj.weight"
MEGATRON_MLA_KV_UP = _MATT + "linear_kv_up_proj.weight"
MEGATRON_MLA_KV_NORM = _MATT + "kv_layernorm.weight"

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

_HL = HF_LAYER = "model.layers.{layer}."
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
    Rule(MEGATRON_FC1, (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"), Layout.GATED,
         layers=LayerKind.DENSE),
    Rule(MEGATRON_FC2, (_HL + "mlp.down_proj.weight",), layers=LayerKind.DENSE),
)

_MOE = LayerKind.MOE
_QWEN_EXP = _HL + "mlp.experts.{expert}."
_QWEN_MOE_MLP = (
    Rule(MEGATRON_ROUTER, (_HL + "mlp.gate.weight",), layers=_MOE),
    Rule(
        MEGATRON_EXPERT_FC1,
        (_QWEN_EXP + "gate_proj.weight", _QWEN_EXP + "up_proj.weight"),
        Layout.GATED,
        layers=_MOE,
    ),
    Rule(MEGATRON_EXPERT_FC2, (_QWEN_EXP + "down_proj.weight",), layers=_MOE),
)
# Mixtral checkpoints: w1 = gate, w3 = up, w2 = down.
_MIX_EXP = _HL + "block_sparse_moe.experts.{expert}."
_MIXTRAL_MOE_MLP = (
    Rule(MEGATRON_ROUTER, (_HL + "block_sparse_moe.gate.weight",), layers=_MOE),
    Rule(MEGATRON_EXPERT_FC1, (_MIX_EXP + "w1.weight", _MIX_EXP + "w3.weight"), Layout.GATED, layers=_MOE),
    Rule(MEGATRON_EXPERT_FC2, (_MIX_EXP + "w2.weight",), layers=_MOE),
)
# DeepSeek-V3 / GLM-4.5 MoE layers: Qwen-style experts, a sigmoid gate with its score-correction
# bias, one shared expert MLP (n_shared_experts of them fused into one wider MLP).
_SHARED = _HL + "mlp.shared_experts."
_DEEPSEEK_MOE_MLP = _QWEN_MOE_MLP + (
    Rule(MEGATRON_EXPERT_BIAS, (_HL + "mlp.gate.e_score_correction_bias",), layers=_MOE),
    Rule(MEGATRON_SHARED_FC1, (_SHARED + "gate_proj.weight", _SHARED + "up_proj.weight"), Layout.GATED,
         layers=_MOE, when="shared_expert"),
    Rule(MEGATRON_SHARED_FC2, (_SHARED + "down_proj.weight",), layers=_MOE, when="shared_expert"),
)
# A model with dense and MoE layers: the pre-MLP norm is one rule per kind, so that the TE naming
# fuses it into linear_fc1 of the dense layers only.
_MIXED_ATTENTION_NORMS = (
    Rule(MEGATRON_INPUT_NORM, (_HL + "input_layernorm.weight",)),
    Rule(MEGATRON_PRE_MLP_NORM, (_HL + "post_attention_layernorm.weight",), layers=LayerKind.DENSE),
    Rule(MEGATRON_PRE_MLP_NORM, (_HL + "post_attention_layernorm.weight",), layers=_MOE),
)
# GLM-4.5: Llama attention with optional q/k/v bias and per-head q/k norms.
_GLM4_ATTENTION = (
    Rule(
        MEGATRON_QKV_WEIGHT,
        (_HATT + "q_proj.weight", _HATT + "k_proj.weight", _HATT + "v_proj.weight"),
        Layout.QKV,
    ),
    Rule(MEGATRON_PROJ, (_HATT + "o_proj.weight",)),
    Rule(
        MEGATRON_QKV_BIAS,
        (_HATT + "q_proj.bias", _HATT + "k_proj.bias", _HATT + "v_proj.bias"),
        Layout.QKV,
        when="qkv_bias",
    ),
    Rule(MEGATRON_Q_NORM, (_HATT + "q_norm.weight",), when="qk_norm"),
    Rule(MEGATRON_K_NORM, (_HATT + "k_norm.weight",), when="qk_norm"),
)
# DeepSeek-V3 multi-latent attention: every projection keeps its HF layout (q_b_proj rows are
# per head [nope; rope], kv_b_proj rows per head [k_nope; v], kv_a_proj rows [latent; rope]: what
# MLASelfAttention splits them by).
_MLA = (
    Rule(MEGATRON_MLA_Q, (_HATT + "q_proj.weight",), when="q_full"),
    Rule(MEGATRON_MLA_Q_DOWN, (_HATT + "q_a_proj.weight",), when="q_lora"),
    Rule(MEGATRON_MLA_Q_NORM, (_HATT + "q_a_layernorm.weight",), when="q_lora"),
    Rule(MEGATRON_MLA_Q_UP, (_HATT + "q_b_proj.weight",), when="q_lora"),
    Rule(MEGATRON_MLA_KV_DOWN, (_HATT + "kv_a_proj_with_mqa.weight",)),
    Rule(MEGATRON_MLA_KV_NORM, (_HATT + "kv_a_layernorm.weight",)),
    Rule(MEGATRON_MLA_KV_UP, (_HATT + "kv_b_proj.weight",)),
    Rule(MEGATRON_PROJ, (_HATT + "o_proj.weight",)),
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
GLM4_MOE = FamilyTable(
    _EMBEDDINGS + _MIXED_ATTENTION_NORMS + _GLM4_ATTENTION + _DENSE_MLP + _DEEPSEEK_MOE_MLP,
    DENSE_TE_NORMS,
    GROUPED_EXPERTS,
    transformers_stacked=_QWEN_MOE_STACKED,
)
# MLA has no TransformerEngine naming here: TE's MLA spec replicates the q/kv down projections over
# TP (TELinear, duplicated) where the portable spec splits them (ColumnParallelLinear).
DEEPSEEK_V3 = FamilyTable(
    _EMBEDDINGS + _MIXED_ATTENTION_NORMS + _MLA + _DENSE_MLP + _DEEPSEEK_MOE_MLP,
    None,
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

"""`ModelSpec`: the validated facts about one model that names, layouts and configs need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from entr_megatron.models.tables import FamilyTable


@dataclass(frozen=True)
class MegatronNaming:
    """Which Megatron module layout the parameter names follow.

    The two flags are independent because the learner picks them independently:
    the layer spec (TransformerEngine or portable) and, for MoE, the expert module.
    """

    te_fused_norms: bool = False
    """TransformerEngine spec: the attention input norm is `linear_qkv.layer_norm_weight`
    and a dense layer's pre-MLP norm is `linear_fc1.layer_norm_weight`. False: the
    portable/local spec's separate `input_layernorm` / `pre_mlp_layernorm`."""

    grouped_experts: bool = False
    """TEGroupedMLP (`moe_grouped_gemm=True`): experts are `mlp.experts.linear_fc1.weight{e}`.
    False: SequentialMLP, `mlp.experts.local_experts.{e}.linear_fc1.weight`."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one HF model as Megatron sees it. Build with `ModelFamily.spec`."""

    model_type: str
    """HF `model_type`, the registry key."""
    table: FamilyTable = dataclasses.field(repr=False, compare=False)
    """The family's name tables (determined by model_type, so left out of ==/hash)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    """Megatron `kv_channels`; may differ from hidden_size / num_attention_heads (Qwen3)."""
    ffn_hidden_size: int
    """Dense MLP width (HF `intermediate_size`)."""
    vocab_size: int
    """True HF vocab, without Megatron's TP padding."""
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    llama3_rope_factor: float | None
    """Llama-3.1 style RoPE frequency scaling factor, None for plain RoPE."""
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    """0 for dense models."""
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_pre_softmax: bool = False
    """True: softmax over all experts, then top-k (no renormalisation). False: top-k on
    the logits, then softmax over the k (= softmax, top-k, renormalise)."""
    naming: MegatronNaming = MegatronNaming()

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.model_type}: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads={self.num_query_groups}"
            )
        if self.is_moe and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(
                f"{self.model_type}: num_experts_per_tok={self.moe_router_topk} must be in "
                f"[1, {self.num_experts}] (the number of experts)"
            )

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    def with_naming(self, *, te_fused_norms: bool = False, grouped_experts: bool = False):
        """The same model with another Megatron naming style."""
        return dataclasses.replace(
            self, naming=MegatronNaming(te_fused_norms=te_fused_norms, grouped_experts=grouped_experts)
        )

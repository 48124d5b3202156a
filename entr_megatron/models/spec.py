"""`ModelSpec`: the validated facts about one model that names, layouts and configs need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from entr_megatron.models.tables import FamilyTable, LayerKind


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
class YarnRope:
    """YaRN RoPE scaling as Megatron's `YarnRotaryEmbedding` takes it (HF `rope_type: yarn`).

    The attention factor on cos/sin is `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`
    and the softmax scale is multiplied by `get_mscale(factor, mscale_all_dim) ** 2` (HF's
    DeepSeek-V3 `yarn_apply_mscale`); the config reader has checked HF computes the same."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class LatentAttention:
    """Multi-latent attention (DeepSeek-V2/V3): low-rank q and kv, decoupled RoPE dims."""

    q_lora_rank: int | None
    """None: one q projection (`q_proj`); else q_a_proj -> RMSNorm -> q_b_proj."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    """Per-head query/key dims without RoPE (Megatron `qk_head_dim`)."""
    qk_rope_head_dim: int
    """Per-head query dims with RoPE, and the one shared key RoPE head (Megatron `qk_pos_emb_head_dim`)."""
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    moe_router_score: str = "softmax"
    """"softmax", or "sigmoid" (DeepSeek-V3 / GLM-4.5: sigmoid scores, top-k, renormalised)."""
    moe_expert_bias: bool = False
    """Sigmoid router with HF's `e_score_correction_bias` (Megatron's `expert_bias` buffer): added
    to the scores to choose the experts, not to their weights."""
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    """Grouped top-k (HF n_group / topk_group): experts chosen only from the best groups."""
    moe_router_scaling_factor: float | None = None
    """HF routed_scaling_factor: multiplies the (renormalised) weights of the routed experts."""
    moe_shared_expert_size: int = 0
    """Width of the shared expert MLP (HF moe_intermediate_size * n_shared_experts); 0: none."""
    first_k_dense: int = 0
    """An MoE model's leading dense layers (HF first_k_dense_replace); their MLP is ffn_hidden_size wide."""
    rotary_percent: float = 1.0
    """Fraction of each head's dims RoPE rotates (HF partial_rotary_factor), the first ones."""
    yarn: YarnRope | None = None
    mla: LatentAttention | None = None
    """Multi-latent attention; then `head_dim` is the value head dim and `num_query_groups` the heads."""
    mtp_layers: int = 0
    """HF num_nextn_predict_layers: multi-token-prediction layers a checkpoint may carry after the
    decoder layers (`model.layers.{num_layers + i}.*`). They are not converted: a checkpoint holding
    them is refused unless they are skipped explicitly (`--allow-unmapped`)."""
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
        if self.is_moe and not 0 <= self.first_k_dense < self.num_layers:
            raise ValueError(
                f"{self.model_type}: first_k_dense_replace={self.first_k_dense} must leave at least one "
                f"of the num_hidden_layers={self.num_layers} layers MoE"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the model has MoE layers (all but the first `first_k_dense`)."""
        return self.num_experts > 0

    def layer_kind(self, layer: int) -> LayerKind:
        """Whether decoder layer `layer` (0-based) has a dense or an MoE MLP."""
        return LayerKind.MOE if self.is_moe and layer >= self.first_k_dense else LayerKind.DENSE

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """0-based indices of the MoE layers, in order (the routes' `moe_layers` axis)."""
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i) is LayerKind.MOE)

    @property
    def has_dense_layers(self) -> bool:
        return any(self.layer_kind(i) is LayerKind.DENSE for i in range(self.num_layers))

    # Conditions the family tables' rules name (`Rule.when`).
    @property
    def q_lora(self) -> bool:
        return self.mla is not None and self.mla.q_lora_rank is not None

    @property
    def q_full(self) -> bool:
        return self.mla is not None and self.mla.q_lora_rank is None

    @property
    def shared_expert(self) -> bool:
        return self.moe_shared_expert_size > 0

    def with_naming(self, *, te_fused_norms: bool = False, grouped_experts: bool = False):
        """The same model with another Megatron naming style."""
        return dataclasses.replace(
            self, naming=MegatronNaming(te_fused_norms=te_fused_norms, grouped_experts=grouped_experts)
        )

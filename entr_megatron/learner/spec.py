"""Layer specs: TransformerEngine's where it runs, a portable one everywhere else.

``get_layer_spec`` returns the decoder block spec (this pipeline stage's layers
plus the final norm) that ``GPTModel`` takes as ``transformer_layer_spec``.

The portable spec is the same model as TransformerEngine's, built from
megatron-core's local modules:

==================  ===========================================  =================================
piece               TransformerEngine spec                        portable spec
==================  ===========================================  =================================
input norm + QKV    ``TELayerNormColumnParallelLinear``            ``PortableNorm`` + ``ColumnParallelLinear``
core attention      ``TEDotProductAttention``                      ``SDPACoreAttention`` (causal, GQA, thd)
q/k norm (Qwen3)    ``TENorm`` on each head                        ``PortableNorm`` on each head
MLA (DeepSeek-V3)   (not used: down projections replicated)        ``MLASelfAttention``: local linears,
                                                                   ``PortableNorm`` latent norms
out projection      ``TERowParallelLinear``                        ``RowParallelLinear``
MLP norm + fc1      ``TELayerNormColumnParallelLinear``            ``PortableNorm`` + ``ColumnParallelLinear``
MoE                 router, ``TEGroupedMLP``/``SequentialMLP``,    router, ``SequentialMLP``, shared experts
                    shared experts                                 (local linears)
final norm          ``TENorm``                                     ``PortableNorm``
==================  ===========================================  =================================

Parameters are the same tensors with different module paths where TE fuses the
norm into the next linear (``input_layernorm.weight`` here is
``self_attention.linear_qkv.layer_norm_weight`` there); ``sharded_state_dict_keys_map``
maps them, so dist checkpoints are interchangeable between the two specs.
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from entr_megatron.learner.attention import SDPACoreAttention
from entr_megatron.learner.norm import PortableNorm

__all__ = ["get_layer_spec", "portable_layer_spec", "te_available", "moe_layer_pattern"]


def te_available() -> bool:
    """TransformerEngine is importable and a GPU is present (its kernels need both)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


class _PortableBackend(LocalSpecProvider):
    """Megatron's local modules, with our norm (SP-capable) and SDPA core attention."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return PortableNorm

    def core_attention(self) -> type:
        return SDPACoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
        # GroupedMLP needs the grouped_gemm CUDA package; SequentialMLP is the same math.
        return super().grouped_mlp_modules(False, False)


def _mla_attention() -> ModuleSpec:
    """Megatron's multi-latent attention from local modules: the q/kv down projections are
    ColumnParallelLinear (outputs gathered over TP before the latent norms), the latent norms
    separate modules (TE fuses them into the up projections)."""
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=SDPACoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=PortableNorm,
            kv_layernorm=PortableNorm,
        ),
    )


def portable_layer_spec(config, moe: bool) -> ModuleSpec:
    """One transformer layer of the portable spec (dense MLP, or MoE when ``moe``; grouped-query or
    multi-latent attention)."""
    backend = _PortableBackend()
    qk_norm = PortableNorm if config.qk_layernorm else IdentityOp
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if config.multi_latent_attention:
        keys_map = {}  # TE's MLA spec keeps the input norm separate
        attention = _mla_attention()
    else:
        attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=SDPACoreAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        )
    if not moe:  # TE fuses the pre-MLP norm into fc1 only for dense MLPs
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=PortableNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=PortableNorm,
            mlp=get_mlp_module_spec_for_backend(
                backend=backend, num_experts=config.num_moe_experts if moe else None
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def moe_layer_pattern(config) -> list[bool]:
    """Which of the ``config.num_layers`` layers are MoE (``moe_layer_freq``: int N = every Nth, or a 0/1 list)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    if isinstance(freq, list) and len(freq) == config.num_layers and set(freq) <= {0, 1}:
        return [bool(x) for x in freq]
    raise ValueError(f"moe_layer_freq must be an int or a 0/1 list of num_layers={config.num_layers} entries, got {freq!r}")


def get_layer_spec(config, use_te: bool | None = None, vp_stage: int | None = None,
                   pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """Decoder block spec for (virtual) pipeline stage ``vp_stage`` of rank ``pp_rank``.

    Args:
        config: megatron ``TransformerConfig``.
        use_te: TransformerEngine spec (True), portable spec (False), or TE when
            available (None: TE importable and CUDA present).
        vp_stage: virtual pipeline chunk index (None without interleaving).
        pp_rank: pipeline rank (None: Megatron's current one).
    """
    if use_te is None:
        use_te = te_available()
    if use_te:
        if not te_available():
            raise ValueError("use_te=True but TransformerEngine is not importable or no GPU is present")
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization=config.normalization,
            vp_stage=vp_stage, pp_rank=pp_rank,
        )
    dense, moe = portable_layer_spec(config, moe=False), None
    pattern = moe_layer_pattern(config)
    if any(pattern):
        moe = portable_layer_spec(config, moe=True)
    specs = [moe if is_moe else dense for is_moe in pattern]
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
        local = [specs[i] for i in ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local = specs[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=PortableNorm)

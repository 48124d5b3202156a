"""Megatron constructor kwargs for a `ModelSpec`, as plain dicts (this layer never imports megatron).

Two dicts because Megatron splits the settings over two constructors:

    config = TransformerConfig(**{**transformer_config_kwargs(spec),
                                  "activation_func": ACTIVATIONS[kw["activation_func"]],
                                  <learner choices: dtype, parallel sizes, fusions, ...>})
    model = GPTModel(config, layer_spec, **gpt_model_kwargs(spec), <vocab padding>, ...)

Only settings that decide *which function the model computes* are here; how it is
computed (parallelism, fusions, dtypes, MoE dispatcher, grouped GEMM, recompute)
is the learner's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from entr_megatron.models.spec import ModelSpec

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu}
"""The callables behind the `activation_func` names used below."""


def transformer_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """`megatron.core.transformer.TransformerConfig` field -> value for this model.

    Every key is a TransformerConfig field. `activation_func` is given by name
    ("silu"); the learner replaces it with `ACTIVATIONS[name]` (`F.silu`), since a
    callable does not belong in a config dict that is logged and compared.
    Dropout is 0: RL log-probs must be deterministic functions of the weights.
    """
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        layernorm_zero_centered_gamma=False,
        gated_linear_unit=True,
        activation_func="silu",
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        rotary_interleaved=False,  # HF rotate_half pairs dim i with i + head_dim/2
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    if spec.is_moe:
        kwargs.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_score_function=spec.moe_router_score,
            moe_router_pre_softmax=spec.moe_router_pre_softmax,
            moe_router_topk_scaling_factor=spec.moe_router_scaling_factor,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_size or None,
            # 1: every layer MoE; else a 0/1 list (dense first layers)
            moe_layer_freq=[int(i in spec.moe_layers) for i in range(spec.num_layers)] if spec.first_k_dense else 1,
        )
        if spec.moe_router_score == "sigmoid":  # DeepSeek-V3's router (families._read_sigmoid_router)
            kwargs.update(
                moe_router_enable_expert_bias=spec.moe_expert_bias,
                moe_router_num_groups=spec.moe_router_num_groups,
                moe_router_group_topk=spec.moe_router_group_topk,
                moe_router_dtype="fp32",  # HF computes the gate in float32 (its weight kept in fp32)
            )
    if spec.mla is not None:
        mla = spec.mla
        kwargs.update(
            multi_latent_attention=True,
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            rotary_base=spec.rope_theta,
            rotary_percent=spec.rotary_percent,
        )
        yarn = spec.yarn
        if yarn is None:
            kwargs.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        else:
            kwargs.update(rope_type="yarn", rotary_scaling_factor=yarn.factor,
                          original_max_position_embeddings=yarn.original_max_position_embeddings,
                          beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=yarn.mscale,
                          mscale_all_dim=yarn.mscale_all_dim)
    return kwargs


def gpt_model_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """`megatron.core.models.gpt.GPTModel` constructor kwargs for this model.

    `vocab_size` is the true HF vocab: the learner pads it for vocab-parallel
    layers (`layouts.padded_vocab_size`) and must mask the padded logits.
    `rope_scaling`/`rope_scaling_factor` select Megatron's Llama-3.1 RoPE scaling,
    whose other constants the config reader has checked. With multi-latent attention the
    attention builds its own RoPE (the `transformer_config_kwargs` fields) and GPTModel none.
    """
    return dict(
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,
        rotary_base=spec.rope_theta,
        rope_scaling=spec.llama3_rope_factor is not None,
        rope_scaling_factor=spec.llama3_rope_factor if spec.llama3_rope_factor is not None else 8.0,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
    )

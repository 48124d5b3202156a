"""A learner model from an HF model: config.json -> `ModelSpec` -> `TransformerConfig` -> GPTModel chunks.

    groups = initialize_model_parallel(tp=2, pp=1)
    chunks, spec = build_learner_model_from_hf("path/to/hf_model", groups)
    logits = chunks[0](ids, positions, None)                    # [b, s, V_padded / tp]
    lp, ent = vocab_parallel_logprobs_entropy(logits, targets, groups.tp, vocab_size=spec.vocab_size)

What the model computes comes from `models` (`transformer_config_kwargs`,
`gpt_model_kwargs`); this module adds how it is computed: parallel sizes from
`groups`, dtypes, sequence parallelism where Megatron requires it, the MoE
dispatcher that works on the machine, and the vocabulary padding.

Vocabulary padding: Megatron's vocab-parallel embedding and output layer need the
vocabulary divisible by the TP size. It is padded only when it is not
(`learner_vocab_size`), to the next multiple of the TP size; the padding rows are
zero and the log-prob op must be told the true size (`vocab_size=spec.vocab_size`),
which excludes the padding columns. Always passing it is correct and free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from entr_megatron import models
from entr_megatron.learner.hf_load import load_hf_weights, read_hf_config
from entr_megatron.learner.model import build_model_chunks
from entr_megatron.learner.routing_replay import install as install_routing_replay
from entr_megatron.learner.spec import te_available

__all__ = [
    "build_learner_model_from_hf",
    "learner_transformer_config",
    "learner_vocab_size",
    "read_hf_config",
    "transformer_config_class",
]


def learner_vocab_size(spec: models.ModelSpec, tp_size: int) -> int:
    """Rows of the learner's embedding/output layer: the true vocab, padded to a multiple of `tp_size` only if needed."""
    if spec.vocab_size % tp_size == 0:
        return spec.vocab_size
    return models.padded_vocab_size(spec.vocab_size, tp_size, divisible_by=1)


def _dtype_flags(dtype: torch.dtype) -> dict[str, Any]:
    if dtype == torch.float32:
        return {}
    if dtype == torch.bfloat16:
        return dict(bf16=True)
    if dtype == torch.float16:
        return dict(fp16=True)
    raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")


def learner_transformer_config(
    spec: models.ModelSpec,
    groups,
    *,
    dtype: torch.dtype = torch.float32,
    perform_initialization: bool = True,
    overrides: Mapping[str, Any] | None = None,
    routing_replay: str = "off",
):
    """Megatron `TransformerConfig` for `spec` laid out on `groups`.

    Parallel sizes are `groups`' (they must agree: Megatron reads both). MoE:
    sequence parallelism when TP > 1 (Megatron requires it), the allgather
    dispatcher on CPU (the alltoall one needs uneven all_gathers gloo lacks when
    expert-TP > 1; allgather is correct everywhere), alltoall on GPU; no load
    balancing loss (a training choice: pass it in `overrides`). `overrides`
    replaces any field last (e.g. `calculate_per_token_loss`, recompute settings).
    `routing_replay` ('off', 'r2', 'r3': `AlgorithmConfig.routing_replay`) other than 'off'
    turns on `moe_enable_routing_replay` (refused for a dense model). A router with an expert bias
    (DeepSeek-V3, GLM-4.5) keeps it as loaded (`moe_router_bias_update_rate=0`: the engines route
    with the same bias; aux-loss-free balancing is a pre-training device), unless overridden.
    """
    kwargs = models.transformer_config_kwargs(spec)
    kwargs["activation_func"] = models.ACTIVATIONS[kwargs["activation_func"]]
    kwargs.update(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=perform_initialization,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        virtual_pipeline_model_parallel_size=groups.vpp_size,
        context_parallel_size=groups.cp_size,
        expert_model_parallel_size=groups.ep_size,
        expert_tensor_parallel_size=groups.expert_tp_size,
        sequence_parallel=spec.is_moe and groups.tp_size > 1,
        **_dtype_flags(dtype),
    )
    if spec.is_moe:
        kwargs.update(
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,  # SequentialMLP: the naming `spec` is built with
            moe_enable_routing_replay=routing_replay != "off",
        )
        if spec.moe_expert_bias:
            kwargs.update(moe_router_bias_update_rate=0.0)
    elif routing_replay != "off":
        raise ValueError(f"algorithm.routing_replay={routing_replay!r} needs an MoE model; "
                         f"{spec.model_type} is dense (use 'off')")
    kwargs.update(overrides or {})
    return transformer_config_class(spec)(**kwargs)


def transformer_config_class(spec: models.ModelSpec) -> type:
    """The megatron.core class `models.transformer_config_kwargs(spec)` is for: MLATransformerConfig
    for multi-latent attention (its RoPE and rank fields), else TransformerConfig."""
    return MLATransformerConfig if spec.mla is not None else TransformerConfig


def build_learner_model_from_hf(
    hf_dir_or_config,
    groups,
    *,
    load_weights: bool = True,
    dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    vp_size: int | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    routing_replay: str = "off",
):
    """This rank's GPTModel chunks for an HF model, and the model's `ModelSpec`.

    Args:
        hf_dir_or_config: an HF model directory (config.json + safetensors), a
            config.json path, a config dict or a transformers config. Weights are
            loaded only from a directory.
        groups: the initialized `ParallelGroups` (TP, PP, VPP, EP, expert-TP sizes).
        load_weights: load the HF safetensors (`hf_load.load_hf_weights`); False:
            Megatron's random initialisation.
        dtype: parameter dtype (float32, bfloat16, float16); HF tensors are cast.
        use_te: TransformerEngine layer spec (None: when importable and CUDA is present).
        vp_size: virtual pipeline chunks per stage; must equal `groups.vpp_size`
            (the groups decide; this only guards against a mismatch).
        config_overrides: `TransformerConfig` fields set last (see `learner_transformer_config`).
        routing_replay: `AlgorithmConfig.routing_replay`; 'r2'/'r3' install megatron's router
            replay on every MoE layer (`routing_replay.install`).

    Returns:
        `(model_chunks, spec)`: one chunk per virtual stage (Megatron's order) and
        the `ModelSpec` whose naming matches the chunks' parameters. The embedding
        and output layer have `learner_vocab_size(spec, tp)` rows; pass
        `vocab_size=spec.vocab_size` to the log-prob op.
    """
    if vp_size is not None and vp_size != groups.vpp_size:
        raise ValueError(f"vp_size={vp_size} but the process groups were initialized with vpp={groups.vpp_size}")
    hf_config = read_hf_config(hf_dir_or_config)
    if load_weights and not (isinstance(hf_dir_or_config, (str, os.PathLike)) and os.path.isdir(hf_dir_or_config)):
        raise ValueError("load_weights=True needs an HF model directory (config.json + *.safetensors); "
                         "pass load_weights=False to build a randomly initialised model from a config")
    has_te_spec = models.get_family(hf_config).table.te_fused_norms is not None
    if use_te is None:
        use_te = te_available() and has_te_spec  # MLA (deepseek_v3) runs on the portable spec
    elif use_te and not has_te_spec:
        raise ValueError(f"use_te=True: {hf_config.get('model_type')} has no TransformerEngine layer spec here "
                         "(the portable spec runs it, on GPU too)")
    spec = models.model_spec(hf_config, te_fused_norms=use_te, grouped_experts=False)
    config = learner_transformer_config(
        spec, groups, dtype=dtype, perform_initialization=not load_weights, overrides=config_overrides,
        routing_replay=routing_replay,
    )
    gpt = models.gpt_model_kwargs(spec)
    chunks = build_model_chunks(
        config,
        learner_vocab_size(spec, groups.tp_size),
        gpt["max_sequence_length"],
        groups,
        use_te=use_te,
        tie_embeddings=gpt["share_embeddings_and_output_weights"],
        rotary_base=gpt["rotary_base"],
        rotary_percent=gpt["rotary_percent"],
        rope_scaling=gpt["rope_scaling"],
        rope_scaling_factor=gpt["rope_scaling_factor"],
        position_embedding_type=gpt["position_embedding_type"],
    )
    if load_weights:
        load_hf_weights(chunks, spec, groups, hf_dir_or_config)
    if routing_replay != "off":
        install_routing_replay(chunks, routing_replay)
    return chunks, spec

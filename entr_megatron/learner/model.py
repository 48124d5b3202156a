"""Megatron ``GPTModel`` construction for every (virtual) pipeline stage, and its log-probs.

The model is megatron-core's own ``GPTModel``: RoPE positions, optional tied
embeddings, and ``parallel_output=True`` so the output logits stay sharded over
the vocabulary (each TP rank holds ``V/tp`` columns); log-probs and entropy are
then computed on the shards by ``vocab_parallel_logprobs_entropy`` without ever
gathering ``[tokens, V]``.
"""

from __future__ import annotations

from typing import Literal

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.moe.moe_layer import MoELayer

from entr_megatron.learner.spec import get_layer_spec
from entr_megatron.parallel.cpu_compat import check_cpu_config, enable_cpu_compat
from entr_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = [
    "build_gpt_model",
    "build_model_chunks",
    "check_config_matches_groups",
    "logits_to_logprobs_entropy",
    "reduce_experts_over_expert_dp",
    "set_tensor_parallel_attributes",
]


def check_config_matches_groups(config, groups) -> None:
    """Raise ``ValueError`` when the config's parallel sizes differ from the initialized layout.

    Megatron reads sizes from both places (layers from the config, collectives
    from the groups); a mismatch builds a model that silently computes garbage.
    """
    expert_tp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    pairs = (
        ("tensor_model_parallel_size", config.tensor_model_parallel_size, groups.tp_size),
        ("pipeline_model_parallel_size", config.pipeline_model_parallel_size, groups.pp_size),
        ("context_parallel_size", config.context_parallel_size, groups.cp_size),
        ("expert_model_parallel_size", config.expert_model_parallel_size, groups.ep_size),
        ("expert_tensor_parallel_size", expert_tp, groups.expert_tp_size),
        ("virtual_pipeline_model_parallel_size", config.virtual_pipeline_model_parallel_size, groups.vpp_size),
    )
    for field, in_config, in_groups in pairs:
        if in_config != in_groups:
            raise ValueError(f"TransformerConfig.{field}={in_config} but the initialized process groups have {in_groups}")


def build_gpt_model(
    config,
    vocab_size: int,
    max_seq_len: int,
    pre_process: bool = True,
    post_process: bool = True,
    *,
    groups=None,
    vp_stage: int | None = None,
    spec=None,
    use_te: bool | None = None,
    tie_embeddings: bool = False,
    rotary_base: float = 10000,
    rotary_percent: float = 1.0,
    rope_scaling: bool = False,
    rope_scaling_factor: float = 8.0,
    position_embedding_type: str = "rope",
) -> GPTModel:
    """One ``GPTModel`` chunk: the layers of pipeline stage ``groups.pp_rank`` (virtual stage ``vp_stage``).

    Args:
        config: megatron ``TransformerConfig`` whose parallel sizes match ``groups``.
        vocab_size: vocabulary size, divisible by the TP size (pad it first).
        max_seq_len: longest sequence the positions must cover.
        pre_process / post_process: whether this chunk holds the embedding / the
            output layer (first / last stage).
        groups: ``ParallelGroups`` of the layout (None: Megatron's current state).
        vp_stage: virtual pipeline chunk index, None without interleaving.
        spec: a block/layer spec; default ``get_layer_spec(config, use_te, ...)``.
        tie_embeddings: share the input embedding with the output layer.
        rotary_base: RoPE theta (10000 Llama-2, 500000 Llama-3, 1e6 Qwen).
        rotary_percent: fraction of each head's dims that RoPE rotates.
        rope_scaling / rope_scaling_factor: Llama-3.1-style frequency scaling.
        position_embedding_type: "rope" (all supported families) or Megatron's others.
    """
    enable_cpu_compat()
    check_cpu_config(config)
    if groups is not None:
        check_config_matches_groups(config, groups)
    tp = groups.tp_size if groups is not None else config.tensor_model_parallel_size
    if vocab_size % tp:
        raise ValueError(f"vocab_size={vocab_size} must be divisible by the tensor parallel size {tp} (pad the vocabulary)")
    if spec is None:
        spec = get_layer_spec(config, use_te=use_te, vp_stage=vp_stage,
                              pp_rank=groups.pp_rank if groups is not None else None)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type=position_embedding_type,
        rotary_percent=rotary_percent,
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        pg_collection=groups.pg_collection if groups is not None else None,
        vp_stage=vp_stage,
    )
    if not config.perform_initialization:
        set_tensor_parallel_attributes(model, config)
    reduce_experts_over_expert_dp(model, config)
    return model


# Megatron's own TP-split layers (TE's set these attributes themselves) -> the weight's split dimension.
_SPLIT_DIM = ((VocabParallelEmbedding, 0), (ColumnParallelLinear, 0), (RowParallelLinear, 1))


def set_tensor_parallel_attributes(model, config) -> None:
    """Mark the TP-split weights as megatron-core does when it initialises them.

    megatron-core 0.16.1 sets ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``
    on a weight only inside ``_initialize_affine_weight_cpu/_gpu`` (tensor_parallel/layers.py
    l. 137, 170), which its layers call only ``if config.perform_initialization`` (l. 244, 265,
    855, 877, 1178, 1201). A model built to load weights (``perform_initialization=False``) has
    no split weight marked, and the optimizer's gradient norm counts an unmarked weight on TP
    rank 0 only (``param_is_not_tensor_parallel_duplicate``, l. 89-98): at TP=2 the norm misses
    the other half of every split gradient, and clipping scales the step by that wrong norm.
    The stride is the MLP's (mlp.py l. 107-114: 2 for a gated fc1, whose rows interleave).
    """
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        dim = next((d for cls, d in _SPLIT_DIM if isinstance(module, cls)), None)
        if dim is None or weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        gated_fc1 = name.endswith("linear_fc1") and config.gated_linear_unit and not config.use_kitchen
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=2 if gated_fc1 else 1)


def reduce_experts_over_expert_dp(model, config) -> None:
    """Have DDP reduce the routed experts' gradients over the expert-data-parallel group when it
    differs from the data-parallel one at expert-parallel size 1 (expert-TP != TP).

    megatron-core 0.16.1 routes an expert weight's gradient to the expert-DP reduction only with
    expert parallelism: its layers set ``allreduce = not (is_expert and expert_model_parallel_size
    > 1)`` (tensor_parallel/layers.py l. 829 + 886, 1149 + 1209; moe/experts.py l. 203-204), and
    DDP reduces ``allreduce`` parameters over the DP group (distributed_data_parallel.py l. 122,
    290-300). At EP=1 with expert-TP=1 < TP the TP ranks each run every expert on their own
    sequence-parallel share of the tokens (the dispatcher gathers over expert-TP x EP only,
    token_dispatcher.py l. 260-275): each holds a partial expert gradient that the DP reduction
    never sums over TP (at TP=2, DP=1: not at all). Marked ``allreduce=False`` they go where EP>1
    puts them: the expert-DP reduction (DP x TP / expert-TP ranks) and the expert optimizer.
    """
    expert_tp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if config.expert_model_parallel_size > 1 or expert_tp == config.tensor_model_parallel_size:
        return
    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():  # routed experts only: not the shared expert
                param.allreduce = False


def build_model_chunks(config, vocab_size: int, max_seq_len: int, groups, **kwargs) -> list[GPTModel]:
    """The model chunks of this rank, in the order Megatron's schedules expect.

    One chunk per virtual stage with interleaving (``groups.vpp_size``), else one.
    ``kwargs`` go to ``build_gpt_model``.
    """
    stages = [None] if groups.vpp_size is None else list(range(groups.vpp_size))
    return [
        build_gpt_model(
            config, vocab_size, max_seq_len,
            pre_process=groups.is_first_stage(vp), post_process=groups.is_last_stage(vp),
            groups=groups, vp_stage=vp, **kwargs,
        )
        for vp in stages
    ]


def logits_to_logprobs_entropy(logits_shard, targets, tp_group, temperature: float = 1.0,
                               layout: Literal["bsv", "sbv"] = "bsv", chunk_size: int | None = None):
    """Per-token log-prob of ``targets`` and entropy from this rank's vocabulary shard.

    Args:
        logits_shard: ``[b, s, V/tp]`` (``layout="bsv"``, what ``GPTModel`` returns)
            or ``[s, b, V/tp]`` (``"sbv"``, the output layer's own layout).
        targets: ``[b, s]`` global token ids, whatever the logits layout.
        tp_group: the tensor-parallel group (``groups.tp``); None for one rank.
        temperature: the sampling temperature the distribution is taken at.

    Returns:
        ``(logprobs, entropy)``, float32 ``[b, s]``. No ``[tokens, V]`` copy of
        the logits is made: for ``"sbv"`` the targets are transposed instead.
    """
    if layout == "bsv":
        return vocab_parallel_logprobs_entropy(logits_shard, targets, tp_group, temperature, chunk_size)
    if layout == "sbv":
        lp, ent = vocab_parallel_logprobs_entropy(logits_shard, targets.transpose(0, 1), tp_group, temperature, chunk_size)
        return lp.transpose(0, 1), ent.transpose(0, 1)
    raise ValueError(f"layout must be 'bsv' or 'sbv', got {layout!r}")

"""L1: per-architecture data: Megatron <-> HF parameter names, layouts and configs.

Typical use (the learner loading HF weights into a Megatron GPTModel):

    from entr_megatron import models
    family = models.get_family(hf_config)              # registry keyed by HF model_type
    spec = family.spec(hf_config, te_fused_norms=use_te, grouped_experts=grouped_gemm)
    tc_kwargs = family.transformer_config_kwargs(hf_config)   # TransformerConfig fields
    gpt_kwargs = family.gpt_model_kwargs(hf_config)           # GPTModel kwargs
    full = family.from_hf(safetensors_getter, spec)    # Megatron name -> full tensor
    local = models.shard(name, full[name], tp_rank, tp_size)

and back (weight sync, export): `family.to_hf(name, full_tensor, spec)` or
`to_hf_state_dict(...)`. Names use global layer/expert indices; `offset_layer`
and `expert_local_name` translate to a PP stage's / EP rank's local names.
Before a run starts: `check_architecture(fields)` / `architecture_hf_config(fields)`
(a model built from config fields) and `layout_conflicts(spec, tp=, pp=, ...)` (the
sizes Megatron cannot split the model by).
This package never imports megatron, torch.distributed or (at import) transformers.
"""

from entr_megatron.models.families import (
    FAMILIES,
    ModelFamily,
    architecture_fields,
    architecture_hf_config,
    check_architecture,
    get_family,
    model_spec,
)
from entr_megatron.models.layouts import (
    interleave_qkv,
    merge_gated,
    pad_vocab_rows,
    padded_vocab_size,
    split_gated,
    split_qkv,
)
from entr_megatron.models.mapping import (
    HF_LAYOUTS,
    check_hf_keys,
    detect_hf_layout,
    from_hf,
    hf_names,
    megatron_names,
    megatron_shape,
    mtp_hf_prefixes,
    to_hf,
    to_hf_state_dict,
)
from entr_megatron.models.megatron_config import (
    ACTIVATIONS,
    gpt_model_kwargs,
    transformer_config_kwargs,
)
from entr_megatron.models.sharding import (
    LAYOUT_REASONS,
    TP_SPLITS,
    LayoutConflict,
    TpSplit,
    expert_global_name,
    expert_local_name,
    is_expert_param,
    layout_conflicts,
    offset_layer,
    shard,
    tp_split,
    unshard,
)
from entr_megatron.models.spec import LatentAttention, MegatronNaming, ModelSpec, YarnRope

__all__ = [
    "ACTIVATIONS",
    "FAMILIES",
    "HF_LAYOUTS",
    "LAYOUT_REASONS",
    "TP_SPLITS",
    "LatentAttention",
    "LayoutConflict",
    "MegatronNaming",
    "ModelFamily",
    "ModelSpec",
    "TpSplit",
    "YarnRope",
    "architecture_fields",
    "architecture_hf_config",
    "check_architecture",
    "check_hf_keys",
    "detect_hf_layout",
    "expert_global_name",
    "expert_local_name",
    "from_hf",
    "get_family",
    "gpt_model_kwargs",
    "hf_names",
    "interleave_qkv",
    "is_expert_param",
    "layout_conflicts",
    "megatron_names",
    "megatron_shape",
    "merge_gated",
    "mtp_hf_prefixes",
    "model_spec",
    "offset_layer",
    "pad_vocab_rows",
    "padded_vocab_size",
    "shard",
    "split_gated",
    "split_qkv",
    "tp_split",
    "to_hf",
    "to_hf_state_dict",
    "transformer_config_kwargs",
    "unshard",
]

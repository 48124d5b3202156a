"""HF config -> Megatron kwargs for every family, refusals, and defaults that match transformers."""

import ast
import importlib.util
import pathlib

import pytest

from entr_megatron import models

# config.json of released checkpoints (the fields that matter), as on the Hub.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256,
}
LLAMA31_8B = LLAMA3_8B | {
    "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 152064,
}

DENSE_COMMON = dict(
    normalization="RMSNorm", gated_linear_unit=True, activation_func="silu", add_bias_linear=False,
    attention_dropout=0.0, hidden_dropout=0.0, rotary_interleaved=False,
)


def test_qwen3_8b():
    kw = models.get_family("qwen3").transformer_config_kwargs(QWEN3_8B)
    assert kw == DENSE_COMMON | dict(
        num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=12288, layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=False, add_qkv_bias=False, qk_layernorm=True,
    )
    gpt = models.get_family("qwen3").gpt_model_kwargs(QWEN3_8B)
    assert gpt == dict(
        vocab_size=151936, max_sequence_length=40960, position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=1e6, rope_scaling=False, rope_scaling_factor=8.0,
        share_embeddings_and_output_weights=False,
    )


def test_qwen3_30b_a3b():
    kw = models.get_family(QWEN3_30B_A3B).transformer_config_kwargs(QWEN3_30B_A3B)
    assert kw == DENSE_COMMON | dict(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
        kv_channels=128, ffn_hidden_size=6144, layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=False, add_qkv_bias=False, qk_layernorm=True,
        num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # norm_topk_prob: softmax over the top-k logits
        moe_router_topk_scaling_factor=None, moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1,
    )
    no_norm = models.get_family("qwen3_moe").transformer_config_kwargs(
        QWEN3_30B_A3B | {"norm_topk_prob": False}
    )
    assert no_norm["moe_router_pre_softmax"] is True


def test_llama3_8b_and_31():
    fam = models.get_family("llama")
    kw = fam.transformer_config_kwargs(LLAMA3_8B)
    assert kw == DENSE_COMMON | dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=14336, layernorm_epsilon=1e-5,
        layernorm_zero_centered_gamma=False, add_qkv_bias=False, qk_layernorm=False,
    )
    gpt = fam.gpt_model_kwargs(LLAMA3_8B)
    assert (gpt["rotary_base"], gpt["rope_scaling"], gpt["vocab_size"], gpt["max_sequence_length"]) == (
        500000.0, False, 128256, 8192,
    )
    gpt31 = fam.gpt_model_kwargs(LLAMA31_8B)
    assert gpt31["rope_scaling"] is True
    assert (gpt31["rope_scaling_factor"], gpt31["max_sequence_length"]) == (8.0, 131072)


def test_mixtral_8x7b():
    kw = models.get_family("mixtral").transformer_config_kwargs(MIXTRAL_8X7B)
    assert kw == DENSE_COMMON | dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=14336, layernorm_epsilon=1e-5,
        layernorm_zero_centered_gamma=False, add_qkv_bias=False, qk_layernorm=False,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=None, moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1,
    )
    assert models.get_family("mixtral").gpt_model_kwargs(MIXTRAL_8X7B)["rotary_base"] == 1e6


def test_qwen25_7b_has_qkv_bias_and_unused_window_is_fine():
    kw = models.get_family("qwen2").transformer_config_kwargs(QWEN25_7B)
    assert (kw["add_qkv_bias"], kw["add_bias_linear"]) == (True, False)
    assert (kw["kv_channels"], kw["num_query_groups"]) == (128, 4)


@pytest.mark.parametrize(
    "base, change, field",
    [
        (QWEN25_7B, {"use_sliding_window": True}, "use_sliding_window"),
        (QWEN3_8B, {"use_sliding_window": True}, "use_sliding_window"),
        (QWEN3_8B, {"attention_bias": True}, "attention_bias"),
        (QWEN3_8B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        (QWEN3_8B, {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}},
         "rope_parameters.rope_type"),
        (QWEN3_8B, {"hidden_act": "gelu"}, "hidden_act"),
        (QWEN3_8B, {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (QWEN3_8B, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (QWEN3_8B, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (LLAMA3_8B, {"mlp_bias": True}, "mlp_bias"),
        (LLAMA3_8B, {"attention_bias": True}, "attention_bias"),
        (LLAMA31_8B, {"rope_scaling": LLAMA31_8B["rope_scaling"] | {"high_freq_factor": 2.0}},
         "rope_scaling.high_freq_factor"),
        (LLAMA31_8B, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        (MIXTRAL_8X7B, {"sliding_window": 4096}, "sliding_window"),
        (MIXTRAL_8X7B, {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        (QWEN3_30B_A3B, {"mlp_only_layers": [0, 1]}, "mlp_only_layers"),
        (QWEN3_30B_A3B, {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        (QWEN3_30B_A3B, {"num_experts_per_tok": 200}, "num_experts_per_tok"),
        (QWEN3_8B, {"num_key_value_heads": 7}, "num_key_value_heads"),
        (QWEN3_8B, {"hidden_size": None}, "hidden_size"),
        (QWEN3_8B, {"vocab_size": -1}, "vocab_size"),
    ],
)
def test_unsupported_fields_raise_naming_the_field(base, change, field):
    cfg = base | change
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        models.model_spec(cfg)


def test_registry_and_model_type_errors():
    assert sorted(models.FAMILIES) == ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
    with pytest.raises(ValueError, match="'gemma2'.*supported"):
        models.get_family("gemma2")
    with pytest.raises(ValueError, match="model_type='llama'"):
        models.get_family("qwen3").spec(LLAMA3_8B)


def test_activation_names_resolve():
    import torch.nn.functional as F

    kw = models.get_family("llama").transformer_config_kwargs(LLAMA3_8B)
    assert models.ACTIVATIONS[kw["activation_func"]] is F.silu


def _dataclass_fields(path: pathlib.Path, class_name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_kwargs_are_megatron_fields():
    """Every key names a real TransformerConfig field / GPTModel argument (read from source, no import)."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None:
        pytest.skip("megatron-core not installed")
    root = pathlib.Path(spec.submodule_search_locations[0])
    fields = _dataclass_fields(root / "transformer/transformer_config.py", "TransformerConfig")
    fields |= _dataclass_fields(root / "model_parallel_config.py", "ModelParallelConfig")
    gpt_tree = ast.parse((root / "models/gpt/gpt_model.py").read_text())
    gpt_cls = next(n for n in ast.walk(gpt_tree) if isinstance(n, ast.ClassDef) and n.name == "GPTModel")
    init = next(n for n in gpt_cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    gpt_args = {a.arg for a in init.args.args + init.args.kwonlyargs}
    for cfg in (QWEN3_30B_A3B, LLAMA31_8B, QWEN25_7B):
        assert set(models.get_family(cfg).transformer_config_kwargs(cfg)) <= fields
        assert set(models.get_family(cfg).gpt_model_kwargs(cfg)) <= gpt_args


def test_transformers_config_objects_and_defaults():
    """transformers >= 5 objects (rope_parameters, num_local_experts) read like config.json,
    and the defaults we assume for omitted fields are transformers' own."""
    transformers = pytest.importorskip("transformers")
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=128, intermediate_size=96)
    classes = {
        "llama": (transformers.LlamaConfig, {}),
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen3": (transformers.Qwen3Config, {}),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        ),
        "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    }
    for model_type, (cls, extra) in classes.items():
        obj = cls(**tiny, **extra)
        spec = models.model_spec(obj)
        assert spec.model_type == model_type
        assert spec.num_experts == extra.get("num_experts", extra.get("num_local_experts", 0))
        # The same model as a minimal config.json: defaults must reproduce the object.
        minimal = {"model_type": model_type, "max_position_embeddings": 4096, **tiny, **extra}
        from_json = models.model_spec(minimal)
        assert from_json.rms_norm_eps == obj.rms_norm_eps
        assert from_json.rope_theta == obj.rope_parameters["rope_theta"]
        assert from_json.tie_word_embeddings == obj.tie_word_embeddings
        hf_head_dim = getattr(obj, "head_dim", None) or obj.hidden_size // obj.num_attention_heads
        assert from_json.head_dim == hf_head_dim, model_type

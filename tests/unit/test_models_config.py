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
# bf16 releases (the original DeepSeek-V3 carries an fp8 quantization_config, refused below).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_qk_norm": False, "vocab_size": 151552,
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


SIGMOID_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                      moe_router_enable_expert_bias=True, moe_router_dtype="fp32")


def test_deepseek_v3():
    kw = models.get_family("deepseek_v3").transformer_config_kwargs(DEEPSEEK_V3)
    assert kw == DENSE_COMMON | SIGMOID_ROUTER | dict(
        num_layers=61, hidden_size=7168, num_attention_heads=128, num_query_groups=128,
        kv_channels=128, ffn_hidden_size=18432, layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=False, add_qkv_bias=False, qk_layernorm=False,
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0, 0, 0] + [1] * 58,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, rotary_base=10000.0, rotary_percent=1.0, rope_type="yarn",
        rotary_scaling_factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0,
    )
    spec = models.model_spec(DEEPSEEK_V3)
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from entr_megatron.learner.build import transformer_config_class

    assert (spec.mtp_layers, spec.moe_layers[:2]) == (1, (3, 4))
    assert transformer_config_class(spec) is MLATransformerConfig
    assert transformer_config_class(models.model_spec(QWEN3_30B_A3B)) is TransformerConfig
    assert models.model_spec(DEEPSEEK_V3 | {"q_lora_rank": None}).mla.q_lora_rank is None  # V2-Lite style
    plain = models.get_family("deepseek_v3").transformer_config_kwargs(DEEPSEEK_V3 | {"rope_scaling": None})
    assert (plain["rope_type"], plain["rotary_scaling_factor"], plain["mscale_all_dim"]) == ("rope", 1.0, 0.0)


def test_glm45_air():
    kw = models.get_family("glm4_moe").transformer_config_kwargs(GLM45_AIR)
    assert kw == DENSE_COMMON | SIGMOID_ROUTER | dict(
        num_layers=46, hidden_size=4096, num_attention_heads=96, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=10944, layernorm_epsilon=1e-5,
        layernorm_zero_centered_gamma=False, add_qkv_bias=True, qk_layernorm=False,
        num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1408,
        moe_router_num_groups=None, moe_router_group_topk=None,  # one group: no group limit
        moe_router_topk_scaling_factor=1.0, moe_shared_expert_intermediate_size=1408,
        moe_layer_freq=[0] + [1] * 45,
    )
    gpt = models.get_family("glm4_moe").gpt_model_kwargs(GLM45_AIR)
    assert (gpt["rotary_percent"], gpt["rotary_base"]) == (0.5, 1e6)
    # transformers' Glm4MoeConfig rotates half of each head when partial_rotary_factor is absent
    no_factor = {k: v for k, v in GLM45_AIR.items() if k != "partial_rotary_factor"}
    assert models.model_spec(no_factor).rotary_percent == 0.5
    qk_norm = models.get_family("glm4_moe").transformer_config_kwargs(GLM45_AIR | {"use_qk_norm": True})
    assert qk_norm["qk_layernorm"] is True


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
        (DEEPSEEK_V3, {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (DEEPSEEK_V3, {"rope_interleave": False}, "rope_interleave"),
        (DEEPSEEK_V3, {"attention_bias": True}, "attention_bias"),
        (DEEPSEEK_V3, {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        (DEEPSEEK_V3, {"norm_topk_prob": False}, "norm_topk_prob"),
        (DEEPSEEK_V3, {"num_experts_per_tok": 1}, "num_experts_per_tok"),
        (DEEPSEEK_V3, {"topk_group": 2}, "topk_group"),  # groups scored by top-4 in Megatron, top-2 in HF
        (DEEPSEEK_V3, {"n_group": 7}, "n_group"),
        (DEEPSEEK_V3, {"first_k_dense_replace": 61}, "first_k_dense_replace"),
        (DEEPSEEK_V3, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        (DEEPSEEK_V3, {"rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"mscale": 0.707, "mscale_all_dim": 0}},
         "rope_scaling.mscale"),
        (DEEPSEEK_V3, {"rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"truncate": False}}, "rope_scaling.truncate"),
        (DEEPSEEK_V3, {"rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"attention_factor": 2.0}},
         "rope_scaling.attention_factor"),
        (GLM45_AIR, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        (GLM45_AIR, {"routed_scaling_factor": 0}, "routed_scaling_factor"),
        (GLM45_AIR, {"use_qk_norm": "yes"}, "use_qk_norm"),
    ],
)
def test_unsupported_fields_raise_naming_the_field(base, change, field):
    cfg = base | change
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        models.model_spec(cfg)


def test_registry_and_model_type_errors():
    assert sorted(models.FAMILIES) == ["deepseek_v3", "glm4_moe", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
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
    mla_fields = fields | _dataclass_fields(root / "transformer/transformer_config.py", "MLATransformerConfig")
    gpt_tree = ast.parse((root / "models/gpt/gpt_model.py").read_text())
    gpt_cls = next(n for n in ast.walk(gpt_tree) if isinstance(n, ast.ClassDef) and n.name == "GPTModel")
    init = next(n for n in gpt_cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    gpt_args = {a.arg for a in init.args.args + init.args.kwonlyargs}
    for cfg in (QWEN3_30B_A3B, LLAMA31_8B, QWEN25_7B, GLM45_AIR, DEEPSEEK_V3):
        allowed = mla_fields if cfg is DEEPSEEK_V3 else fields
        assert set(models.get_family(cfg).transformer_config_kwargs(cfg)) <= allowed
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
    # DeepSeek-style families: the router, MLA and RoPE defaults of a minimal config.json are
    # those transformers' config classes fill in.
    moe = dict(num_experts_per_tok=8, moe_intermediate_size=32)
    for model_type, cls, extra in (
        ("glm4_moe", transformers.Glm4MoeConfig, dict(moe, n_routed_experts=8)),
        ("deepseek_v3", transformers.DeepseekV3Config, dict(moe, n_routed_experts=16, num_hidden_layers=4)),
    ):
        obj = cls(**(tiny | extra), max_position_embeddings=4096)
        minimal = {"model_type": model_type, "max_position_embeddings": 4096, **tiny, **extra}
        got, want = models.model_spec(minimal), models.model_spec(obj)
        assert got == want, model_type
        assert (got.first_k_dense, got.moe_router_scaling_factor, got.mtp_layers) == (
            obj.first_k_dense_replace, obj.routed_scaling_factor, obj.num_nextn_predict_layers)
        assert got.moe_shared_expert_size == obj.moe_intermediate_size * obj.n_shared_experts
        assert got.rotary_percent == obj.rope_parameters.get("partial_rotary_factor", 1.0)
        assert (got.moe_router_num_groups or 1, got.moe_router_group_topk or 1) == (obj.n_group, obj.topk_group) or \
            obj.topk_group == obj.n_group
        if model_type == "deepseek_v3":
            assert got.mla == models.LatentAttention(obj.q_lora_rank, obj.kv_lora_rank, obj.qk_nope_head_dim,
                                                     obj.qk_rope_head_dim, obj.v_head_dim)

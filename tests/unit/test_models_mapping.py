"""Megatron <-> HF names and layouts: bit-exact round trips on tiny random HF models, and
layouts checked against hand-built expectations."""

import functools

import pytest
import torch

from entr_megatron import models

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
FAMILY_CONFIGS = {
    "llama": lambda tied: transformers.LlamaConfig(**TINY, intermediate_size=96, tie_word_embeddings=tied),
    "qwen2": lambda tied: transformers.Qwen2Config(**TINY, intermediate_size=96, tie_word_embeddings=tied),
    "qwen3": lambda tied: transformers.Qwen3Config(
        **TINY, intermediate_size=96, head_dim=16, tie_word_embeddings=tied
    ),
    "qwen3_moe": lambda tied: transformers.Qwen3MoeConfig(
        **TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        head_dim=16, norm_topk_prob=True, tie_word_embeddings=tied,
    ),
    "mixtral": lambda tied: transformers.MixtralConfig(
        **TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied
    ),
    # layer 0 dense, layer 1 MoE with a shared expert and the router's score-correction bias
    "glm4_moe": lambda tied: transformers.Glm4MoeConfig(
        **TINY, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, head_dim=16, use_qk_norm=True, attention_bias=True, tie_word_embeddings=tied,
    ),
    "deepseek_v3": lambda tied: transformers.DeepseekV3Config(
        **TINY, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, tie_word_embeddings=tied,
    ),
}
CASES = [(mt, tied) for mt in FAMILY_CONFIGS for tied in (False, True)]
NAMINGS = [dict(), dict(te_fused_norms=True, grouped_experts=True)]


@functools.lru_cache(maxsize=None)
def tiny_model(model_type, tied):
    torch.manual_seed(0)
    cfg = FAMILY_CONFIGS[model_type](tied)
    return cfg, transformers.AutoModelForCausalLM.from_config(cfg)


def _assert_same(a, b):
    assert set(a) == set(b), (sorted(set(a) - set(b)), sorted(set(b) - set(a)))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("model_type, tied", CASES)
@pytest.mark.parametrize("naming", NAMINGS, ids=["local", "te_grouped"])
def test_in_memory_state_dict_round_trip(model_type, tied, naming):
    cfg, model = tiny_model(model_type, tied)
    sd = model.state_dict()
    spec = models.model_spec(cfg, **naming)
    if naming and models.get_family(model_type).table.te_fused_norms is None:  # MLA: portable spec only
        with pytest.raises(ValueError, match="TransformerEngine layer spec is not supported"):
            models.megatron_names(spec)
        return
    meg = models.from_hf(sd, spec, layout="auto")
    assert list(meg) == models.megatron_names(spec)
    assert ("output_layer.weight" in meg) == (not tied)
    for name, t in meg.items():
        assert tuple(t.shape) == models.megatron_shape(name, spec)
    _assert_same(models.to_hf_state_dict(meg, spec, layout="transformers"), sd)
    # Per-parameter API, checkpoint layout, then back again.
    pairs = [p for name, t in meg.items() for p in models.to_hf(name, t, spec)]
    checkpoint = dict(pairs)
    assert len(checkpoint) == len(pairs)
    assert sorted(checkpoint) == sorted(models.hf_names(spec))
    _assert_same(models.from_hf(checkpoint, spec), meg)


@pytest.mark.parametrize("model_type, tied", CASES)
def test_checkpoint_names_are_what_save_pretrained_writes(model_type, tied, tmp_path):
    safetensors = pytest.importorskip("safetensors")
    cfg, model = tiny_model(model_type, tied)
    model.save_pretrained(tmp_path)
    with safetensors.safe_open(tmp_path / "model.safetensors", "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
        spec = models.model_spec(cfg)
        assert sorted(on_disk) == sorted(models.hf_names(spec, "checkpoint"))
        meg = models.from_hf(f.get_tensor, spec)  # lazy getter source
    _assert_same(meg, models.from_hf(model.state_dict(), spec, layout="transformers"))
    _assert_same(models.to_hf_state_dict(meg, spec), on_disk)


def _qkv_spec(heads=4, groups=2, head_dim=3, hidden=5):
    cfg = dict(
        model_type="qwen2", hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=groups, head_dim=head_dim, intermediate_size=7, vocab_size=11,
        max_position_embeddings=16,
    )
    return models.model_spec(cfg)


def test_qkv_interleave_matches_hand_built_rows():
    spec = _qkv_spec()  # 4 query heads, 2 groups, head_dim 3: 2 query heads per group
    hd, hidden = 3, 5

    def rows(kind, head):  # row r of head h of projection kind: a unique, recognisable value
        return torch.stack([torch.full((hidden,), kind * 100.0 + head * 10 + r) for r in range(hd)])

    q = torch.cat([rows(1, h) for h in range(4)])
    k = torch.cat([rows(2, g) for g in range(2)])
    v = torch.cat([rows(3, g) for g in range(2)])
    expected = torch.cat([rows(1, 0), rows(1, 1), rows(2, 0), rows(3, 0),  # group 0
                          rows(1, 2), rows(1, 3), rows(2, 1), rows(3, 1)])  # group 1
    p = "model.layers.0.self_attn."
    hf = models.to_hf_state_dict(
        {n: torch.zeros(models.megatron_shape(n, spec)) for n in models.megatron_names(spec)}, spec
    )
    hf |= {p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v}
    hf |= {p + "q_proj.bias": q[:, 0], p + "k_proj.bias": k[:, 0], p + "v_proj.bias": v[:, 0]}
    meg = models.from_hf(hf, spec)
    assert torch.equal(meg["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
    assert torch.equal(meg["decoder.layers.0.self_attention.linear_qkv.bias"], expected[:, 0])
    assert torch.equal(models.interleave_qkv(q, k, v, num_query_groups=2, head_dim=hd), expected)
    # Through the per-parameter API, weight and bias:
    back = dict(models.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", expected, spec))
    assert torch.equal(back[p + "q_proj.weight"], q) and torch.equal(back[p + "k_proj.weight"], k)
    assert torch.equal(back[p + "v_proj.weight"], v)
    back_b = dict(models.to_hf("decoder.layers.0.self_attention.linear_qkv.bias", expected[:, 0], spec))
    assert torch.equal(back_b[p + "v_proj.bias"], v[:, 0])


def test_gated_fc1_is_gate_then_up_and_experts_follow_their_index():
    cfg, model = tiny_model("mixtral", False)
    spec = models.model_spec(cfg, grouped_experts=True)
    sd = models.to_hf_state_dict(models.from_hf(model.state_dict(), spec, layout="transformers"), spec)
    meg = models.from_hf(sd, spec)
    pre = "model.layers.1.block_sparse_moe.experts.3."
    fc1 = meg["decoder.layers.1.mlp.experts.linear_fc1.weight3"]
    assert torch.equal(fc1, torch.cat([sd[pre + "w1.weight"], sd[pre + "w3.weight"]]))
    assert torch.equal(meg["decoder.layers.1.mlp.experts.linear_fc2.weight3"], sd[pre + "w2.weight"])
    router = sd["model.layers.1.block_sparse_moe.gate.weight"]
    assert torch.equal(meg["decoder.layers.1.mlp.router.weight"], router)
    dense_cfg, dense = tiny_model("llama", False)
    dense_meg = models.from_hf(dense.state_dict(), models.model_spec(dense_cfg))
    d = dense.state_dict()
    assert torch.equal(
        dense_meg["decoder.layers.0.mlp.linear_fc1.weight"],
        torch.cat([d["model.layers.0.mlp.gate_proj.weight"], d["model.layers.0.mlp.up_proj.weight"]]),
    )


def test_te_naming_fuses_norms_into_linears_except_moe_pre_mlp():
    cfg, _ = tiny_model("qwen3", False)
    dense = set(models.megatron_names(models.model_spec(cfg, te_fused_norms=True)))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in dense
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in dense
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in dense)
    moe_cfg, _ = tiny_model("qwen3_moe", False)
    moe = set(models.megatron_names(models.model_spec(moe_cfg, te_fused_norms=True)))
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in moe
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in moe
    local = set(models.megatron_names(models.model_spec(moe_cfg)))
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in local
    # dense first layer, MoE second: only the dense layer's pre-MLP norm is fused
    glm_cfg, _ = tiny_model("glm4_moe", False)
    mixed = set(models.megatron_names(models.model_spec(glm_cfg, te_fused_norms=True)))
    assert {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
            "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"} <= mixed
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in mixed
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in mixed


def test_tied_output_layer_and_vocab_padding():
    cfg, model = tiny_model("qwen2", True)
    spec = models.model_spec(cfg)
    assert models.to_hf("output_layer.weight", torch.zeros(128, 64), spec) == []
    meg = models.from_hf(model.state_dict(), spec, layout="transformers", padded_vocab_size=256)
    emb = meg["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64) and not emb[128:].any()
    ((name, back),) = models.to_hf("embedding.word_embeddings.weight", emb, spec)
    assert name == "model.embed_tokens.weight" and torch.equal(back, model.state_dict()[name])


def test_key_mismatches_are_named():
    cfg, model = tiny_model("qwen3", False)
    spec = models.model_spec(cfg)
    sd = dict(model.state_dict())
    del sd["model.layers.1.self_attn.k_norm.weight"]
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    missing = r"missing 1: model\.layers\.1\.self_attn\.k_norm\.weight"
    unexpected = r"unexpected 1: model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"
    with pytest.raises(ValueError, match=missing + ".*" + unexpected):
        models.from_hf(sd, spec)
    k_norm = "model.layers.1.self_attn.k_norm.weight"
    sd[k_norm] = model.state_dict()[k_norm]
    assert len(models.from_hf(sd, spec, strict=False)) == len(models.megatron_names(spec))
    with pytest.raises(ValueError, match="missing"):
        deeper = models.model_spec(cfg.to_dict() | {"num_hidden_layers": 3})
        models.from_hf(model.state_dict(), deeper)


def test_wrong_shapes_and_unknown_names_raise():
    cfg, model = tiny_model("llama", False)
    spec = models.model_spec(cfg)
    sd = dict(model.state_dict())
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    with pytest.raises(ValueError, match="down_proj"):
        models.from_hf(sd, spec)
    with pytest.raises(ValueError, match="not a parameter"):
        models.to_hf("decoder.layers.0.self_attention.q_layernorm.weight", torch.zeros(16), spec)
    with pytest.raises(ValueError, match="global indices"):
        models.to_hf("decoder.layers.2.input_layernorm.weight", torch.zeros(64), spec)
    with pytest.raises(ValueError, match="expected the full"):
        models.to_hf("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(96, 64), spec)  # a TP shard
    with pytest.raises(ValueError, match="were not given"):
        models.to_hf_state_dict({"decoder.final_layernorm.weight": torch.zeros(64)}, spec)

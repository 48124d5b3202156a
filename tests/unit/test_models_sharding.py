"""TP / EP sharding metadata: shard/unshard round trips, gated fc1 and QKV shards, expert names."""

import pytest
import torch

from entr_megatron import models
from entr_megatron.models import TpSplit

QWEN3_MOE = dict(
    model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
    num_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
)
QWEN2 = dict(
    model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=96, vocab_size=128, max_position_embeddings=64,
)
GLM4_MOE = dict(
    model_type="glm4_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=2, vocab_size=128, max_position_embeddings=64, attention_bias=True, use_qk_norm=True,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=14, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, vocab_size=128, max_position_embeddings=64,
)
SPECS = [
    models.model_spec(cfg, **naming)
    for cfg in (QWEN3_MOE, QWEN2, QWEN2 | {"tie_word_embeddings": True}, GLM4_MOE)
    for naming in (dict(), dict(te_fused_norms=True, grouped_experts=True))
] + [models.model_spec(DEEPSEEK_V3), models.model_spec(DEEPSEEK_V3 | {"q_lora_rank": None})]


def _full_params(spec):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(models.megatron_shape(n, spec), generator=g) for n in models.megatron_names(spec)}


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"{s.model_type}-te{s.naming.te_fused_norms:d}-tied{s.tie_word_embeddings:d}"
)
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_unshard_round_trip(spec, tp):
    for name, full in _full_params(spec).items():
        shards = [models.shard(name, full, r, tp) for r in range(tp)]
        kind = models.tp_split(name)
        if kind is not TpSplit.REPLICATED:
            dim = 1 if kind is TpSplit.ROW else 0
            assert all(s.shape[dim] == full.shape[dim] // tp and s.is_contiguous() for s in shards), name
        assert torch.equal(models.unshard(name, shards), full), name


def test_split_kinds_cover_every_parameter():
    kinds = {}
    for spec in SPECS:
        for name in models.megatron_names(spec):
            kinds[name] = models.tp_split(name)
    assert kinds["embedding.word_embeddings.weight"] is TpSplit.VOCAB
    assert kinds["output_layer.weight"] is TpSplit.VOCAB
    assert kinds["decoder.layers.0.self_attention.linear_qkv.weight"] is TpSplit.COLUMN
    assert kinds["decoder.layers.0.self_attention.linear_qkv.bias"] is TpSplit.COLUMN
    assert kinds["decoder.layers.0.self_attention.linear_proj.weight"] is TpSplit.ROW
    assert kinds["decoder.layers.0.mlp.linear_fc1.weight"] is TpSplit.GATED_COLUMN
    assert kinds["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] is TpSplit.GATED_COLUMN
    assert kinds["decoder.layers.1.mlp.experts.linear_fc2.weight3"] is TpSplit.ROW
    assert kinds["decoder.layers.0.mlp.router.weight"] is TpSplit.REPLICATED
    assert kinds["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] is TpSplit.REPLICATED
    assert kinds["decoder.layers.0.self_attention.q_layernorm.weight"] is TpSplit.REPLICATED
    assert models.is_expert_param("decoder.layers.1.mlp.experts.linear_fc1.weight0")
    assert not models.is_expert_param("decoder.layers.1.mlp.router.weight")
    assert kinds["decoder.layers.1.mlp.router.expert_bias"] is TpSplit.REPLICATED
    assert kinds["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] is TpSplit.GATED_COLUMN
    assert kinds["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"] is TpSplit.ROW
    assert not models.is_expert_param("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")  # split by TP
    mla = "decoder.layers.0.self_attention."
    for name in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
        assert kinds[mla + name + ".weight"] is TpSplit.COLUMN, name
    assert kinds[mla + "kv_layernorm.weight"] is TpSplit.REPLICATED


def test_latent_attention_and_shared_expert_layout_conflicts():
    spec = models.model_spec(DEEPSEEK_V3)  # kv_lora_rank + qk_rope_head_dim = 22
    assert [(c.size, c.field) for c in models.layout_conflicts(spec, tp=4)] == [
        ("tp", "kv_lora_rank + qk_rope_head_dim")]
    assert models.layout_conflicts(spec, tp=2, ep=2) == []
    glm = models.model_spec(GLM4_MOE | {"moe_intermediate_size": 18})  # shared expert 36 wide, experts 18
    assert [(c.size, c.field) for c in models.layout_conflicts(glm, tp=8, expert_tp=8)] == [
        ("tp", "num_attention_heads"), ("tp", "moe_intermediate_size * n_shared_experts"),
        ("expert_tp", "moe_intermediate_size")]


def test_fc1_shard_is_cat_of_gate_and_up_shards():
    spec = models.model_spec(QWEN2)
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    full = models.merge_gated(gate, up)
    for tp in (2, 4):
        for r in range(tp):
            got = models.shard("decoder.layers.0.mlp.linear_fc1.weight", full, r, tp)
            rows = slice(r * 96 // tp, (r + 1) * 96 // tp)
            assert torch.equal(got, torch.cat([gate[rows], up[rows]])), (tp, r)
    # The same for an expert under expert-TP.
    name = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"
    g, u = torch.randn(32, 64), torch.randn(32, 64)
    assert torch.equal(models.shard(name, torch.cat([g, u]), 1, 2), torch.cat([g[16:], u[16:]]))
    assert spec.ffn_hidden_size == 96


def test_qkv_tp_shard_holds_whole_query_groups():
    heads, groups, hd, hidden = 8, 4, 2, 3
    q = torch.randn(heads * hd, hidden)
    k, v = torch.randn(groups * hd, hidden), torch.randn(groups * hd, hidden)
    full = models.interleave_qkv(q, k, v, groups, hd)
    tp = 2
    per_q, per_kv = heads // tp * hd, groups // tp * hd
    for r in range(tp):
        got = models.shard("decoder.layers.0.self_attention.linear_qkv.weight", full, r, tp)
        # Rank r's attention runs heads [r*h/tp, (r+1)*h/tp) with kv groups [r*g/tp, ...):
        want = models.interleave_qkv(
            q[r * per_q:(r + 1) * per_q], k[r * per_kv:(r + 1) * per_kv], v[r * per_kv:(r + 1) * per_kv],
            groups // tp, hd,
        )
        assert torch.equal(got, want)


def test_row_parallel_splits_columns():
    full = torch.arange(12.0).reshape(2, 6)
    assert torch.equal(
        models.shard("decoder.layers.3.self_attention.linear_proj.weight", full, 1, 3), full[:, 2:4]
    )


def test_sharding_errors():
    with pytest.raises(ValueError, match="pad the vocab"):
        models.shard("embedding.word_embeddings.weight", torch.zeros(127, 4), 0, 2)
    with pytest.raises(ValueError, match="tp_rank"):
        models.shard("decoder.final_layernorm.weight", torch.zeros(4), 2, 2)
    with pytest.raises(ValueError, match="rank 1 differs"):
        models.unshard("decoder.final_layernorm.weight", [torch.zeros(4), torch.ones(4)])
    with pytest.raises(ValueError, match="not a known Megatron"):
        models.tp_split("decoder.layers.0.mlp.linear_fc3.weight")
    assert models.padded_vocab_size(151936, tp_size=1) == 151936  # 1187 * 128
    assert models.padded_vocab_size(151936, tp_size=8) == 149 * 1024
    assert models.padded_vocab_size(32000, tp_size=3, divisible_by=128) == 32256


@pytest.mark.parametrize(
    "global_name, local_name",
    [
        ("decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight",
         "decoder.layers.5.mlp.experts.local_experts.2.linear_fc1.weight"),
        ("decoder.layers.5.mlp.experts.linear_fc2.weight6",
         "decoder.layers.5.mlp.experts.linear_fc2.weight2"),
    ],
)
def test_expert_parallel_names(global_name, local_name):
    # 8 experts over EP=2: expert 6 is local expert 2 of EP rank 1.
    assert models.expert_local_name(global_name, num_experts=8, ep_size=2) == (1, local_name)
    assert models.expert_global_name(local_name, ep_rank=1, num_experts=8, ep_size=2) == global_name
    with pytest.raises(ValueError, match="not divisible"):
        models.expert_local_name(global_name, num_experts=8, ep_size=3)
    with pytest.raises(ValueError, match="not an expert"):
        models.expert_local_name("decoder.layers.5.mlp.router.weight", num_experts=8, ep_size=2)


def test_offset_layer_for_pipeline_stages():
    assert models.offset_layer("decoder.layers.1.mlp.experts.linear_fc1.weight3", 24) == (
        "decoder.layers.25.mlp.experts.linear_fc1.weight3"
    )
    assert models.offset_layer("decoder.final_layernorm.weight", 24) == "decoder.final_layernorm.weight"

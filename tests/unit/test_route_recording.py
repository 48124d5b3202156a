"""MoE routing replay without ranks: the embedded engine's recorded routes, their packing, the config.

The engine's routes are checked against an independent recomputation: HF's own router
logits of the finished sequence (``output_router_logits``, one forward without a cache),
``topk(softmax(logits), k)`` as the HF blocks route, compared as expert sets per
(token, layer). The learner side (replay in Megatron) is tests/distributed/test_routing_replay.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.3, max_position_embeddings=128, vocab_size=64)


def tiny_configs():
    """model_type -> the config of a tiny HF model (both MoE families, both router normalisations, one dense)."""
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=16,
                                                 num_experts=4, num_experts_per_tok=2, head_dim=8,
                                                 norm_topk_prob=False),
        "mixtral": transformers.MixtralConfig(**TINY, intermediate_size=16, num_local_experts=4,
                                              num_experts_per_tok=2),
        "llama": transformers.LlamaConfig(**TINY, intermediate_size=48),
    }


def tiny_models():
    """model_type -> a random tiny HF model of `tiny_configs`."""
    torch.manual_seed(0)
    return {k: transformers.AutoModelForCausalLM.from_config(c).eval() for k, c in tiny_configs().items()}


def generate(model, record_routes=True):
    from entr_megatron.rollout.decoder import BatchDecoder
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

    # max_batch_size 3 < 6 samples: later ones are prefilled while others decode (merged caches).
    decoder = BatchDecoder(model, max_batch_size=3, record_routes=record_routes)
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2]]
    for i, p in enumerate(prompts):
        decoder.add(GenerateRequest(p, SamplingParams(max_new_tokens=4 + 2 * i, n=2, seed=i, ignore_eos=True),
                                    request_id=str(i)))
    results = []
    while decoder.has_work():
        results += decoder.step()
    return results


def hf_routes(model, tokens):
    """``[L_tokens, moe_layers, k]`` sorted expert ids from HF's router logits of one plain forward."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    per_layer = [torch.topk(torch.softmax(logits.float(), -1), k, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).sort(-1).values


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_engine_routes_equal_hf_router_recomputation(model_type):
    model = tiny_models()[model_type]
    results = generate(model)
    assert len(results) == 6
    for r in results:
        routes = r.routed_experts
        fed = r.prompt_ids + r.output_ids[:-1]
        assert routes is not None and routes.dtype == torch.uint8
        assert tuple(routes.shape) == (len(fed), model.config.num_hidden_layers, 2)
        want = hf_routes(model, fed)
        assert torch.equal(routes.long().sort(-1).values, want), f"{model_type} request {r.request_id}"
        sample = r.to_sample()
        assert sample.routed_experts is routes


def grouped_sigmoid_routes(model, tokens):
    """``[L_tokens, moe_layers, k]`` sorted expert ids of DeepSeek's router recomputed from HF's router
    logits: sigmoid + score-correction bias, the best `topk_group` of `n_group` groups (a group
    scored by its two best experts), top-k among their experts."""
    cfg, k = model.config, model.config.num_experts_per_tok
    gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    per_layer = []
    for logits, gate in zip(out.router_logits, gates, strict=True):
        scores = logits.float().sigmoid() + gate.e_score_correction_bias
        per_group = scores.view(len(tokens), cfg.n_group, -1)
        best_groups = per_group.topk(2, -1).values.sum(-1).topk(cfg.topk_group, -1).indices
        allowed = torch.zeros(len(tokens), cfg.n_group, dtype=torch.bool).scatter(1, best_groups, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(per_group.shape[-1], 1), float("-inf"))
        per_layer.append(scores.topk(k, -1).indices)
    return torch.stack(per_layer, dim=1).sort(-1).values


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_engine_routes_of_deepseek_style_routers(model_type):
    """Dense first layer (no route), sigmoid router with a non-zero score bias and a group limit."""
    router = dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                  n_group=4, topk_group=2, first_k_dense_replace=1)
    cfg = (transformers.Glm4MoeConfig(**TINY, **router, head_dim=8) if model_type == "glm4_moe" else
           transformers.DeepseekV3Config(**(TINY | dict(num_key_value_heads=4)), **router, q_lora_rank=16,
                                         kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(0.3 * torch.randn_like(m.e_score_correction_bias))
    for r in generate(model):
        fed = r.prompt_ids + r.output_ids[:-1]
        assert tuple(r.routed_experts.shape) == (len(fed), 1, 4)  # one MoE layer of two
        assert torch.equal(r.routed_experts.long().sort(-1).values, grouped_sigmoid_routes(model, fed)), r.request_id


def test_routes_off_or_dense_cost_nothing():
    models = tiny_models()
    assert all(r.routed_experts is None for r in generate(models["qwen3_moe"], record_routes=False))
    assert all(r.routed_experts is None for r in generate(models["llama"], record_routes=True))
    from entr_megatron.rollout.hf_model import CausalLM

    lm = CausalLM(models["llama"], record_routes=True)
    assert lm._routes is None and not models["llama"].model.layers[0].mlp._forward_hooks


def test_sample_checks_the_route_rows():
    from entr_megatron.types import Sample

    with pytest.raises(ValueError, match=r"routed_experts has shape \(3, 2, 2\), expected \[4, moe_layers, k\]"):
        Sample([1, 2, 3], [4, 5], [0.0, 0.0], [0, 0], routed_experts=torch.zeros(3, 2, 2, dtype=torch.uint8))


def test_routes_pack_by_token_position_and_follow_sequence_selection():
    from entr_megatron.learner.batching import ENGINE_ROUTES, select_sequences, split_for_data_parallel
    from entr_megatron.types import Sample, TrainBatch

    def sample(p, r, base):
        routes = torch.arange(base, base + (p + r - 1) * 2, dtype=torch.uint8).view(-1, 1, 2)
        return Sample(list(range(p)), list(range(r)), [0.0] * r, [0] * r, routed_experts=routes)

    samples = [sample(3, 2, 0), sample(2, 3, 100), Sample([1], [2], [0.0], [0])]  # the last: no routes
    batch = TrainBatch.from_samples(samples, torch.zeros(3))
    routes = batch.extras[ENGINE_ROUTES]
    assert routes.dtype == torch.int16 and tuple(routes.shape) == (5 + 5 + 2, 1, 2)
    assert routes[:4].flatten().tolist() == list(range(8)) and routes[4].tolist() == [[-1, -1]]
    assert routes[5:9].flatten().tolist() == list(range(100, 108)) and (routes[9:] == -1).all()
    picked = select_sequences(batch, [1])
    assert torch.equal(picked.extras[ENGINE_ROUTES], routes[5:10])
    shares = split_for_data_parallel(batch, 2)
    assert torch.equal(torch.cat([s.extras[ENGINE_ROUTES] for s in shares]), routes)
    dense = [Sample([1], [2], [0.0], [0])]
    assert ENGINE_ROUTES not in TrainBatch.from_samples(dense, torch.zeros(1)).extras


def test_routing_replay_config_names_the_field():
    from entr_megatron.config.algorithm import AlgorithmConfig
    from entr_megatron.config.rollout import RolloutConfig

    assert AlgorithmConfig(routing_replay="r3").routing_replay == "r3"
    with pytest.raises(ValueError, match=r"routing_replay='r4' is not valid; allowed: off, r2, r3"):
        AlgorithmConfig(routing_replay="r4")
    from entr_megatron.config.loader import load_config

    # an unquoted `off` in a YAML file is PyYAML's false: it means 'off'
    assert load_config(None, ["algorithm.routing_replay=off"]).algorithm.routing_replay == "off"
    # SGLang records routes too (servers with --enable-return-routed-experts, rollout/sglang/answers.py)
    on_gpus = ["rollout.engine=sglang", "launcher.device=cuda", "launcher.gpus_per_node=2"]
    r3 = load_config(None, ["algorithm.routing_replay=r3", *on_gpus])
    assert r3.algorithm.routing_replay == "r3" and r3.records_routes and not r3.rollout.record_routes
    assert RolloutConfig(engine="sglang", dtype="auto", record_routes=True).record_routes
    assert not load_config(None, on_gpus).records_routes


def test_sglang_route_layout_comes_from_the_model_config(tmp_path):
    from entr_megatron.controller.job.sglang_setup import route_layout
    from entr_megatron.rollout.sglang import RouteLayout

    configs = tiny_configs()
    for model_type in ("qwen3_moe", "mixtral"):
        configs[model_type].to_json_file(tmp_path / "config.json")
        assert route_layout(tmp_path) == RouteLayout(num_layers=2, top_k=2, num_experts=4)
    # A dense first layer (GLM-4.5 / DeepSeek-V3's first_k_dense_replace): SGLang's layer 0 column
    # is not ours.
    glm = transformers.Glm4MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16,
                                     num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                                     head_dim=8)
    glm.to_json_file(tmp_path / "config.json")
    assert route_layout(tmp_path) == RouteLayout(num_layers=2, top_k=4, num_experts=16, moe_layers=(1,))
    configs["llama"].to_json_file(tmp_path / "config.json")
    assert route_layout(tmp_path) is None  # dense: nothing asked, no server flag
    with pytest.raises(ValueError, match=r"rollout\.record_routes: cannot read the model config"):
        route_layout(tmp_path / "missing")


def test_replay_needs_an_moe_model():
    from types import SimpleNamespace

    from entr_megatron import models
    from entr_megatron.learner.build import learner_transformer_config

    groups = SimpleNamespace(tp_size=1, pp_size=1, vpp_size=None, cp_size=1, ep_size=1, expert_tp_size=1)
    dense = models.model_spec(transformers.LlamaConfig(**TINY, intermediate_size=48))
    with pytest.raises(ValueError, match=r"algorithm\.routing_replay='r3' needs an MoE model; llama is dense"):
        learner_transformer_config(dense, groups, routing_replay="r3")
    moe = models.model_spec(tiny_models()["qwen3_moe"].config)
    assert learner_transformer_config(moe, groups, routing_replay="r2").moe_enable_routing_replay
    assert not learner_transformer_config(moe, groups).moe_enable_routing_replay


@pytest.mark.parametrize("model_type, overrides, flagged", [
    ("qwen3_moe", ["rollout.record_routes=true"], True),
    ("qwen3_moe", ["algorithm.routing_replay=r3"], True),
    ("qwen3_moe", [], False),
    ("llama", ["rollout.record_routes=true"], False),  # dense: SGLang's capturer needs num_experts_per_tok
])
def test_train_launches_sglang_with_the_routes_flag_only_when_recording(tmp_path, monkeypatch, model_type, overrides,
                                                                       flagged):
    from contextlib import ExitStack

    import entr_megatron.rollout.sglang as sglang
    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.job.sglang_servers import sglang_engine

    class Launched(Exception):
        pass

    def launch_servers(configs, log_dir, startup_timeout_s, progress=None):
        raise Launched([sglang.server_command(c) for c in configs])

    monkeypatch.setattr(sglang, "launch_servers", launch_servers)
    tiny_configs()[model_type].to_json_file(tmp_path / "config.json")
    cfg = load_config(None, ["rollout.engine=sglang", "launcher.device=cuda", "launcher.gpus_per_node=2", *overrides])
    with ExitStack() as stack, pytest.raises(Launched) as e:
        sglang_engine(cfg, tmp_path, stack, tmp_path / "logs")
    (command,) = e.value.args[0]
    assert (sglang.ROUTES_FLAG in command) == flagged

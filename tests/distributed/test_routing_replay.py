"""MoE routing replay: with the engine's routes replayed (R3) the learner computes the engine's log-probs.

The "engine" is an HF Qwen3-MoE forward of each whole sequence with the embedded engine's
route recorder on (`rollout.hf_model.RouteRecorder`; tests/unit/test_routing_replay.py shows the
engine's incremental routes equal this recomputation): its routes and its log-probs are
the reference. The learner loads the same weights (fp32) from the saved HF directory.

Two weight sets:
  plain:     random weights. R3 log-probs = HF's within 1e-5.
  near tie:  in every layer expert 1's gate row is a copy of expert 0's in the learner's
             weights (an exact tie), and that row times (1 + 1e-6) in the engine's only: where
             the pair straddles the top-k boundary the engine picks expert 1 for tokens with a
             positive gate logit, the learner's top-k breaks the tie its own way. Without
             replay the learner routes differently (counted from its own recorded routes) and
             its log-probs move; with R3 the routes it used (its routers' routing maps) are
             the engine's and the log-probs are the engine's within 1e-5.
Layouts: one rank, then EP=2, TP=2 (sequence parallel) and, on a 4-layer copy of the near tie,
PP=2 x VPP=2 on two gloo ranks, against the same reference. A train step reports routing/disagree_frac (R3), overall and per
entropy bin, the mismatch without replay (measure_unreplayed) and replays R2 routes.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from common import close
from entr_megatron.algorithm.metrics import DEFAULT_ENTROPY_BIN_EDGES, entropy_bin_labels
from entr_megatron.utils.spawn import run_gloo

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TIE_EPS = 1e-6
LENGTHS = ((3, 9), (2, 5), (6, 11), (1, 4), (4, 7))  # (prompt, response)
CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              initializer_range=0.3, max_position_embeddings=128, vocab_size=128, intermediate_size=96,
              moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)


def engine_samples(model, seed=3):
    """Samples whose routes and behaviour log-probs are the HF "engine"'s (teacher-forced), and
    the engine's log-probs of every target position of each."""
    from entr_megatron.rollout.hf_model import RouteRecorder
    from entr_megatron.types import Sample

    recorder = RouteRecorder(model)
    g = torch.Generator().manual_seed(seed)
    samples, full = [], []
    for p, r in LENGTHS:
        tokens = torch.randint(0, CONFIG["vocab_size"], (p + r,), generator=g)
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens[None]).logits[0].double(), -1)
        routes = recorder.take(1, p + r)[0]
        lp = logp[:-1].gather(-1, tokens[1:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)[:-1]
        samples.append(Sample(tokens[:p].tolist(), tokens[p:].tolist(), lp[p - 1:].tolist(), [0] * r,
                              rollout_entropy=entropy[p - 1:].tolist(), routed_experts=routes[:-1].clone()))
        full.append(lp)
    return samples, full


def batch_of(samples, full):
    """(TrainBatch with the engine's routes, reference log-probs [T] in the batch layout: 0 at
    each sequence's last position, as compute_logprobs)."""
    from entr_megatron.types import TrainBatch

    batch = TrainBatch.from_samples(samples, torch.linspace(-1, 1, len(samples)))
    want = torch.zeros(batch.tokens_T.numel(), dtype=torch.float64)
    at = 0
    for lp in full:
        want[at:at + lp.numel()] = lp
        at += lp.numel() + 1
    return batch, want


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """plain and tie (2 layers), and tie4: the near tie in a 4-layer model (PP=2 x VPP=2)."""
    root = tmp_path_factory.mktemp("routing_replay")
    out = {}
    for suffix, layers in (("", 2), ("4", 4)):
        torch.manual_seed(7)
        config = transformers.Qwen3MoeConfig(**{**CONFIG, "num_hidden_layers": layers})
        plain = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in plain.parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
        tied = copy.deepcopy(plain)
        engine = copy.deepcopy(plain)
        with torch.no_grad():
            for mine, theirs in zip(tied.model.layers, engine.model.layers):
                mine.mlp.gate.weight[1] = mine.mlp.gate.weight[0]
                theirs.mlp.gate.weight[1] = theirs.mlp.gate.weight[0] * (1 + TIE_EPS)
        pairs = (("plain", plain, plain), ("tie", tied, engine)) if not suffix else (("tie", tied, engine),)
        for name, learner_model, engine_model in pairs:
            path = os.path.join(root, name + suffix)
            learner_model.save_pretrained(path)
            batch, want = batch_of(*engine_samples(engine_model))
            out[name + suffix] = dict(path=path, batch=batch, want=want)
    return out


# --- in the spawned ranks -------------------------------------------------------------------


def learner_cfg():
    from entr_megatron.config.learner import LearnerConfig, OptimConfig

    # One micro-batch of everything (routing maps then line up with batch positions) at 1 rank.
    return LearnerConfig(max_tokens_per_microbatch=256, optim=OptimConfig(lr=1e-3, weight_decay=0.0))


def build(case, mode, tp=1, pp=1, ep=1, vpp=None):
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.parallel.groups import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp, ep=ep, vpp=vpp)
    chunks, _ = build_learner_model_from_hf(case["path"], groups, routing_replay=mode, vp_size=vpp,
                                            config_overrides={"calculate_per_token_loss": True})
    return chunks, groups


def score(case, chunks, groups):
    """This rank's share, its log-probs (last stage; None elsewhere) and the reference of the share."""
    from entr_megatron.learner.batching import split_for_data_parallel
    from entr_megatron.learner.trainer import compute_logprobs

    shares = split_for_data_parallel(case["batch"], groups.dp_size)
    local = shares[groups.dp_rank]
    start = sum(s.tokens_T.numel() for s in shares[:groups.dp_rank])
    want = case["want"][start:start + local.tokens_T.numel()]
    logprobs, _ = compute_logprobs(chunks, local, groups, learner_cfg())
    return local, logprobs, want


def set_disagreement(a, b, valid):
    """Rows (``[T, k]`` or ``[T, layers, k]``) of ``valid`` tokens whose expert sets differ."""
    differs = (a.sort(-1).values != b.sort(-1).values).any(-1)
    return int((differs & valid.view(-1, *[1] * (differs.dim() - 1))).sum())


def routing_maps(chunks):
    """Forward hooks keeping each router's routing map [T, E] (the experts actually used), by layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps = {}
    for m in chunks[0].modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(lambda mod, inp, out: maps.__setitem__(mod.layer_number, out[1].detach()))
    return maps


def train_metrics(chunks, groups, batch, mode, measure_unreplayed=False):
    from entr_megatron.config.algorithm import AlgorithmConfig
    from entr_megatron.learner.optimizer import build_optimizer, wrap_model_chunks
    from entr_megatron.learner.trainer import train_rollout_batch

    cfg = learner_cfg()
    ddp = wrap_model_chunks(chunks, groups, cfg)
    optimizer, scheduler = build_optimizer(ddp, cfg)
    gates = [p for c in ddp for n, p in c.named_parameters() if n.endswith("router.weight")]
    before = [p.detach().clone() for p in gates]
    algo = AlgorithmConfig(routing_replay=mode, measure_unreplayed=measure_unreplayed)
    metrics = train_rollout_batch(ddp, optimizer, scheduler, batch, groups, algo, cfg)[0]
    # Replay fixes the experts only: the gate weights still get gradients (no weight decay here).
    assert gates and all(not torch.equal(p.detach(), p0) for p, p0 in zip(gates, before)), mode
    return metrics


def _one_rank(rank, world, cases):
    from entr_megatron.learner.batching import ENGINE_ROUTES, OLD_POLICY_ROUTES
    from entr_megatron.learner.trainer import compute_logprobs
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.types import TrainBatch

    enable_cpu_compat()
    # (b) identical weights: R3 gives HF's log-probs.
    plain = cases["plain"]
    chunks, groups = build(plain, "r3")
    _, logprobs, want = score(plain, chunks, groups)
    close(logprobs, want, "plain r3 vs HF", tol=0, atol=TOL)
    bare = TrainBatch(**{f: getattr(plain["batch"], f) for f in ("tokens_T", "cu_seqlens", "loss_mask_T",
                                                                  "behaviour_logprobs_T", "advantages_B")})
    with pytest.raises(ValueError, match=r"routing_replay='r3' needs the engine's routes in the batch"):
        compute_logprobs(chunks, bare, groups, learner_cfg())

    # (c) near tie, without replay: the learner's own routes (recorded by r2's scoring) differ from
    # the engine's and so do its log-probs.
    tie = cases["tie"]
    engine_routes = tie["batch"].extras[ENGINE_ROUTES].long()
    valid = engine_routes[:, 0, 0] >= 0
    chunks, groups = build(tie, "r2")
    batch, logprobs_off, want = score(tie, chunks, groups)
    own = batch.extras[OLD_POLICY_ROUTES].long()
    _, entropy_off = compute_logprobs(chunks, batch, groups, learner_cfg())
    disagree = set_disagreement(own, engine_routes, valid)
    assert disagree > 0, "the near tie must flip some routes"
    gap = (logprobs_off.double() - want).abs().max().item()
    assert gap > 100 * TOL, f"different routes should move the log-probs, max gap {gap:.2e}"
    # r2's training forward replays the routes it recorded: no disagreement with itself.
    metrics = train_metrics(chunks, groups, batch, "r2")
    assert metrics["routing/disagree_frac"] == 0.0, metrics

    # (c) with R3: the experts used are the engine's, the log-probs the engine's.
    chunks, groups = build(tie, "r3")
    maps = routing_maps(chunks)
    _, logprobs, _ = score(tie, chunks, groups)
    close(logprobs, want, "near tie r3 vs engine", tol=0, atol=TOL)
    for moe_index, layer_number in enumerate(sorted(maps)):
        used = maps[layer_number].nonzero()[:, 1].view(-1, 2)  # one micro-batch, no padding: batch positions
        assert set_disagreement(used, engine_routes[:, moe_index], valid) == 0, f"layer {layer_number}"
    # The train step's metric counts the learner's own routing against the engine's, overall and
    # per entropy bin of the engine's entropy at policy tokens; measure_unreplayed's extra pass
    # scores the batch with the learner's own routing, as r2's scoring did above.
    metrics = train_metrics(chunks, groups, tie["batch"], "r3", measure_unreplayed=True)
    frac = disagree / (int(valid.sum()) * engine_routes.shape[1])
    assert abs(metrics["routing/disagree_frac"] - frac) < 1e-12, (metrics, frac)
    want_bins = bin_reference(tie["batch"], own, engine_routes)
    got_bins = {k: v for k, v in metrics.items() if k.startswith("routing/entropy_bin/")}
    assert got_bins.keys() == want_bins.keys() and len(want_bins) >= 2, (got_bins, want_bins)
    assert all(abs(got_bins[k] - want_bins[k]) < 1e-12 for k in want_bins), (got_bins, want_bins)
    assert set(k for k in metrics if k.startswith("routing/") and k not in got_bins) == {
        "routing/disagree_frac", "routing/disagree_frac/layer0", "routing/disagree_frac/layer1"}
    mask = batch.loss_mask_T
    delta = (logprobs_off.double() - batch.behaviour_logprobs_T.double())[mask]
    k3_off = (torch.expm1(delta) - delta).mean().item()
    assert metrics["mismatch_unreplayed/tokens"] == int(mask.sum())
    assert abs(metrics["mismatch_unreplayed/k3"] - k3_off) <= 1e-6 * k3_off, (metrics["mismatch_unreplayed/k3"], k3_off)
    assert metrics["mismatch_unreplayed/k3"] > 1000 * metrics["mismatch/k3"], metrics
    for label, (lo, hi) in zip(entropy_bin_labels(DEFAULT_ENTROPY_BIN_EDGES),
                               zip(DEFAULT_ENTROPY_BIN_EDGES[:-1], DEFAULT_ENTROPY_BIN_EDGES[1:])):
        d = [x for x, h in zip(delta.tolist(), entropy_off[mask].tolist()) if lo <= h < hi]
        want_k3 = sum(math.expm1(x) - x for x in d) / max(len(d), 1)
        assert abs(metrics[f"mismatch_unreplayed/entropy_bin/{label}/k3"] - want_k3) <= 1e-6 * want_k3 + 1e-12, label
    print(f"  ok near tie: {disagree} (token, layer) routes flipped ({frac:.3f}), log-prob gap without "
          f"replay {gap:.2e}", flush=True)


def _two_ranks(rank, world, cases):
    import torch.distributed as dist

    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    # (d) EP=2 (and TP=2 with sequence parallelism; PP=2 x VPP=2 of the 4-layer model: each
    # chunk its own layer).
    for case, layout in ((cases["tie"], dict(ep=2)), (cases["tie"], dict(tp=2)), (cases["tie4"], dict(pp=2, vpp=2))):
        chunks, groups = build(case, "r3", **layout)
        _, logprobs, want = score(case, chunks, groups)
        if groups.is_last_stage():
            close(logprobs, want, f"near tie r3 {layout} vs engine", tol=0, atol=TOL)
        metrics = train_metrics(chunks, groups, case["batch"], "r3")
        assert metrics["routing/disagree_frac"] > 0, (layout, metrics)
        if dist.get_rank() == 0:
            print(f"  ok r3 {layout}: disagree_frac {metrics['routing/disagree_frac']:.3f}", flush=True)


def bin_reference(batch, own, engine_routes):
    """routing/entropy_bin/<label>/disagree_frac by loops: (policy token, layer) pairs binned by
    the engine's entropy at the token's target position, own vs engine expert sets."""
    edges, labels = DEFAULT_ENTROPY_BIN_EDGES, entropy_bin_labels(DEFAULT_ENTROPY_BIN_EDGES)
    counts: dict[int, list[int]] = {}
    for j, (policy, h) in enumerate(zip(batch.loss_mask_T.tolist(), batch.rollout_entropy_T.tolist())):
        if not policy:
            continue
        b = next(i for i in range(len(edges) - 1) if edges[i] <= h < edges[i + 1])
        for layer in range(engine_routes.shape[1]):
            n_d = counts.setdefault(b, [0, 0])
            n_d[0] += 1
            n_d[1] += set(own[j, layer].tolist()) != set(engine_routes[j, layer].tolist())
    return {f"routing/entropy_bin/{labels[b]}/disagree_frac": d / n for b, (n, d) in counts.items()}


def test_r3_replays_engine_routes_on_one_rank(cases):
    run_gloo(_one_rank, 1, cases, timeout_s=200)


def test_r3_under_ep2_tp2_pp2_matches_the_engine(cases):
    run_gloo(_two_ranks, 2, cases, timeout_s=200)


def test_embedded_engine_returns_the_routes_of_its_samples(cases):
    """The spawned engine's routes come back through its queue with each sample, equal an HF
    recomputation, and its Samples pack (TrainBatch.from_samples) into a batch."""
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
    from entr_megatron.learner.batching import ENGINE_ROUTES
    from entr_megatron.rollout.hf_model import RouteRecorder
    from entr_megatron.types import TrainBatch

    path = cases["plain"]["path"]
    config = EmbeddedEngineConfig(model_dir=path, num_threads=1, max_batch_size=2, record_routes=True)
    with EmbeddedEngine(config) as engine:
        requests = [GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=5, n=2, seed=1, ignore_eos=True)),
                    GenerateRequest([9], SamplingParams(max_new_tokens=3, seed=2, ignore_eos=True))]
        results = generate(engine, requests, timeout_s=120)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    recorder = RouteRecorder(model)
    for r in results:
        fed = r.prompt_ids + r.output_ids[:-1]
        with torch.no_grad():
            model(torch.tensor([fed]))
        want = recorder.take(1, len(fed))[0]
        assert r.routed_experts.dtype == torch.uint8
        assert torch.equal(r.routed_experts.sort(-1).values, want.sort(-1).values), r.request_id
    samples = [r.to_sample() for r in results]
    batch = TrainBatch.from_samples(samples, torch.zeros(len(samples)))
    assert tuple(batch.extras[ENGINE_ROUTES].shape) == (batch.tokens_T.numel(), CONFIG["num_hidden_layers"], 2)


# --- DeepSeek's router (GLM-4.5 MoE: sigmoid, score bias, group limit, a dense first layer) ------

GLM_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  initializer_range=0.3, max_position_embeddings=128, vocab_size=128, intermediate_size=96,
                  moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  first_k_dense_replace=1, routed_scaling_factor=2.5)


GLM_TOL = 1e-4
"""The engine's gate row 1 is 1e-6 larger: its sigmoid weight differs too, not only the choice (with
logits of ~10 the log-probs move by ~2e-5; a different expert moves them by > 1e-2)."""


@pytest.fixture(scope="module")
def glm_tie(tmp_path_factory):
    """The near tie in GLM-4.5's one MoE layer (layer 1): experts 0 and 1 (one group) have equal gate
    rows and score biases in the learner's weights, row 1 times (1 + 1e-6) in the engine's."""
    torch.manual_seed(8)
    tied = transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**GLM_CONFIG)).eval()
    gate = tied.model.layers[1].mlp.gate
    with torch.no_grad():
        for p in tied.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
        gate.e_score_correction_bias.copy_(0.3 * torch.randn_like(gate.e_score_correction_bias))
        gate.weight[1] = gate.weight[0]
        gate.e_score_correction_bias[1] = gate.e_score_correction_bias[0]
    engine = copy.deepcopy(tied)
    with torch.no_grad():
        engine.model.layers[1].mlp.gate.weight[1] *= 1 + TIE_EPS
    path = str(tmp_path_factory.mktemp("routing_replay_glm") / "tie")
    tied.save_pretrained(path)
    batch, want = batch_of(*engine_samples(engine))
    return dict(path=path, batch=batch, want=want)


def _glm_one_rank(rank, world, case):
    from entr_megatron.learner.batching import ENGINE_ROUTES, OLD_POLICY_ROUTES
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    engine_routes = case["batch"].extras[ENGINE_ROUTES].long()
    assert engine_routes.shape[1:] == (1, 4)  # the dense first layer has no route
    valid = engine_routes[:, 0, 0] >= 0
    chunks, groups = build(case, "r2")
    batch, logprobs_off, want = score(case, chunks, groups)
    disagree = set_disagreement(batch.extras[OLD_POLICY_ROUTES].long(), engine_routes, valid)
    gap = (logprobs_off.double() - want).abs().max().item()
    assert disagree > 0 and gap > 100 * GLM_TOL, (disagree, gap)
    chunks, groups = build(case, "r3")
    maps = routing_maps(chunks)
    _, logprobs, _ = score(case, chunks, groups)
    close(logprobs, want, "glm4_moe near tie r3 vs engine", tol=0, atol=GLM_TOL)
    (layer_number,) = maps  # Megatron's layer 2 is the routes' MoE layer 0
    used = maps[layer_number].nonzero()[:, 1].view(-1, 4)
    assert layer_number == 2 and set_disagreement(used, engine_routes[:, 0], valid) == 0
    err = (logprobs.double() - want).abs().max().item()
    print(f"  ok glm4_moe near tie: {disagree} routes flipped, gap without replay {gap:.2e}, with r3 {err:.2e}",
          flush=True)


def test_r3_replays_the_routes_of_deepseek_style_routers(glm_tie):
    run_gloo(_glm_one_rank, 1, glm_tie, timeout_s=200)

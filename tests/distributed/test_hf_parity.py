"""HF models loaded into the learner compute HF's own log-probs; export gives back HF's tensors bit for bit.

For every family a tiny random HF model is built with transformers from a config,
saved with save_pretrained and loaded by `build_learner_model_from_hf`. The
reference is HF's forward of each sequence on its own:
`log_softmax(model(input_ids).logits)` at the next token, and the entropy of
that distribution. The learner scores the same variable-length sequences packed
into micro-batches (`score_sequences`) at TP=1 and TP=2 (plus PP=2, interleaved
PP=2 x VP=2, EP=2 and TP=2 x EP=2 for some), fp32, atol 1e-4. One launch per world
size runs every family.

Weights are perturbed away from HF's init (norm weights of 1, zero biases) so
that every tensor, the q/k norms and the qkv bias included, matters; the DeepSeek-style
routers' score-correction bias (a buffer HF initialises to 0) is set to random values,
and HF's own log-probs are checked to change without it and without the group limit. For those
two families the gradients of the summed log-probs at TP=1 are also compared with HF autograd's.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from entr_megatron import models
from entr_megatron.learner.hf_load import HfCheckpoint, check_hf_checkpoint
from entr_megatron.utils.spawn import run_gloo

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ATOL = 1e-4
LENGTHS = (9, 3, 17, 2, 12, 6, 1)
BATCH_TOKENS = 16  # several micro-batches, one sequence longer than a micro-batch
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.3, max_position_embeddings=256)


# DeepSeek-style routers: 16 experts in 4 groups, a token's 4 experts chosen among the 8 of its best
# 2 groups (the group limit excludes experts, and the choice inside the groups is not all of
# them), a shared expert, the first layer dense.
DEEPSEEK_ROUTER = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                       n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5)


def hf_configs():
    """model_type -> transformers config: tied embeddings (llama), qkv bias and an odd vocab (qwen2:
    padded at TP=2), q/k norm (qwen3, qwen3_moe), both MoE router normalisations; GLM-4.5 (partial
    RoPE, q/k/v bias and q/k norm) and DeepSeek-V3 (MLA with q LoRA, YaRN with mscale), both with
    the sigmoid router, its non-zero score-correction bias (`make_case`) and a group limit."""
    return {
        "llama": transformers.LlamaConfig(**TINY, vocab_size=128, intermediate_size=96, tie_word_embeddings=True),
        "qwen2": transformers.Qwen2Config(**TINY, vocab_size=251, intermediate_size=96),
        "qwen3": transformers.Qwen3Config(**TINY, vocab_size=256, intermediate_size=96, head_dim=16),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **TINY, vocab_size=128, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, head_dim=16, norm_topk_prob=False,
        ),
        "mixtral": transformers.MixtralConfig(
            **TINY, vocab_size=256, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
        ),
        "glm4_moe": transformers.Glm4MoeConfig(
            **TINY, **DEEPSEEK_ROUTER, vocab_size=128, head_dim=16, use_qk_norm=True, attention_bias=True,
            partial_rotary_factor=0.5,
        ),
        "deepseek_v3": transformers.DeepseekV3Config(
            **(TINY | dict(num_key_value_heads=4)), **DEEPSEEK_ROUTER, vocab_size=128, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32,
                              beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        ),
    }


def _reference(model, seqs):
    ref_lp, ref_ent = [], []
    with torch.no_grad():
        for s in seqs:
            logp = torch.log_softmax(model(s[None]).logits[0].double(), dim=-1)[:-1]
            ref_lp.append(logp.gather(-1, s[1:, None])[:, 0])
            ref_ent.append(-(logp.exp() * logp).sum(-1))
    return ref_lp, ref_ent


def _routers(model):
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


def _check_router_paths_matter(model, seqs, ref_lp):
    """DeepSeek-style routers: the expert bias and the group limit each change HF's log-probs (so
    that the learner matching them shows it computes both)."""
    routers = _routers(model)
    if not routers:
        return
    bias = [r.e_score_correction_bias.clone() for r in routers]
    for r in routers:
        r.e_score_correction_bias.zero_()
    without_bias, _ = _reference(model, seqs)
    for r, b in zip(routers, bias):
        r.e_score_correction_bias.copy_(b)
    groups = [r.topk_group for r in routers]
    for r in routers:
        assert r.topk_group < r.num_group, "the test config must exclude groups"
        r.topk_group = r.num_group
    ungrouped, _ = _reference(model, seqs)
    for r, k in zip(routers, groups):
        r.topk_group = k
    for what, other in (("the expert bias", without_bias), ("the group limit", ungrouped)):
        delta = max((a - b).abs().max().item() for a, b in zip(ref_lp, other) if a.numel())
        assert delta > 1e-3, f"{what} does not change HF's log-probs ({delta:.2g}): the test would not see it"


def make_case(model_type, cfg, root, name=None):
    """Save a random HF model; return (dir, sequences, reference log-probs, reference entropy)."""
    name = name or model_type
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms (init 1) and biases (init 0)
                p.add_(0.2 * torch.randn_like(p))
        for r in _routers(model):  # HF inits the score-correction bias (a buffer) to 0
            r.e_score_correction_bias.copy_(0.3 * torch.randn_like(r.e_score_correction_bias))
    path = os.path.join(root, name)
    # qwen3 is written as a sharded checkpoint (index + several files).
    model.save_pretrained(path, max_shard_size="100KB" if model_type == "qwen3" else "1GB")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in LENGTHS]
    ref_lp, ref_ent = _reference(model, seqs)
    _check_router_paths_matter(model, seqs, ref_lp)
    return dict(model_type=model_type, path=path, seqs=[s.tolist() for s in seqs], ref_lp=ref_lp, ref_ent=ref_ent)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_models"))
    return [make_case(mt, cfg, root) for mt, cfg in hf_configs().items()]


@pytest.fixture(scope="module")
def deep_case(tmp_path_factory):
    """A 4-layer tied Llama: interleaved PP=2 x VP=2 needs 4 layers."""
    cfg = transformers.LlamaConfig(**dict(TINY, num_hidden_layers=4), vocab_size=128, intermediate_size=96,
                                   tie_word_embeddings=True)
    return make_case("llama", cfg, str(tmp_path_factory.mktemp("deep")), name="llama_4_layers")


@pytest.fixture(scope="module")
def variant_cases(tmp_path_factory):
    """The other branches of the DeepSeek-style families: DeepSeek-V3 with one q projection (no q
    LoRA, DeepSeek-V2-Lite style) and plain RoPE; GLM-4.5 without q/k norms and biases (GLM-4.5-Air)."""
    root = str(tmp_path_factory.mktemp("variants"))
    deepseek = dict(**(TINY | dict(num_key_value_heads=4)), **DEEPSEEK_ROUTER, vocab_size=128, q_lora_rank=None,
                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    glm = dict(**TINY, **DEEPSEEK_ROUTER, vocab_size=128, head_dim=16, use_qk_norm=False, attention_bias=False)
    return [make_case("deepseek_v3", transformers.DeepseekV3Config(**deepseek), root, name="deepseek_v3_q_proj"),
            make_case("glm4_moe", transformers.Glm4MoeConfig(**glm), root, name="glm4_moe_air")]


# --- in the spawned ranks -------------------------------------------------------------------


def check_scores(case, chunks, spec, groups, where):
    from entr_megatron.learner.scoring import score_sequences

    results = score_sequences(chunks, spec, groups, case["seqs"], batch_tokens=BATCH_TOKENS)
    worst = 0.0
    for i, ((lp, ent), want_lp, want_ent) in enumerate(zip(results, case["ref_lp"], case["ref_ent"])):
        assert lp.shape == want_lp.shape and ent.shape == want_ent.shape, f"{where}: shapes of sequence {i}"
        if lp.numel() == 0:
            continue
        err = max((lp.double() - want_lp).abs().max().item(), (ent.double() - want_ent).abs().max().item())
        assert err <= ATOL, f"{where}: sequence {i} differs from HF by {err:.3g}"
        worst = max(worst, err)
    return worst


def check_round_trip(case, chunks, spec, groups, where):
    """Export (gather to rank 0) equals the HF checkpoint on disk, bit for bit; iter_hf_weights on
    every rank yields the stage's tensors with the same values."""
    import torch.distributed as dist

    from entr_megatron.learner.hf_export import gather_hf_state_dict, iter_hf_weights

    with HfCheckpoint(case["path"]) as ckpt:
        on_disk = {k: ckpt.get(k) for k in ckpt.keys()}
    for name, tensor in iter_hf_weights(chunks, spec, groups):
        assert torch.equal(tensor, on_disk[name]), f"{where}: iter_hf_weights {name}"
    exported = gather_hf_state_dict(chunks, spec, groups)
    if dist.get_rank() == 0:
        assert sorted(exported) == sorted(on_disk), f"{where}: exported names differ"
        for name, tensor in exported.items():
            assert tensor.dtype == on_disk[name].dtype and torch.equal(tensor, on_disk[name]), f"{where}: {name}"
    transformers_layout = dict(iter_hf_weights(chunks, spec, groups, layout="transformers"))
    if groups.pp_size == 1:
        assert set(transformers_layout) == set(models.hf_names(spec, "transformers")), where


def check_gradients(case, chunks, spec, groups, where):
    """One rank: the gradient of the summed next-token log-probs of a few sequences, through
    GPTModel's own forward, equals HF autograd's (rel. 1e-4 per tensor); the router's expert bias
    (a buffer) gets none in either."""
    from entr_megatron.learner.hf_load import global_param_names

    hf = transformers.AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
    for seq in case["seqs"][:3]:
        ids = torch.tensor([seq])
        for logits in (chunks[0](ids, torch.arange(len(seq))[None], None), hf(ids).logits):
            torch.log_softmax(logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None]).sum().backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    want = models.from_hf({n: grads.get(n, torch.zeros_like(t)) for n, t in hf.state_dict().items()}, spec,
                          layout="transformers")
    worst = 0.0
    for name, local, param in global_param_names(chunks[0], spec, groups):
        got = param.grad if param.requires_grad else torch.zeros_like(param)
        got = torch.zeros_like(param) if got is None else got
        worst = max(worst, (got - want[name]).abs().max().item() / max(want[name].abs().max().item(), 1e-6))
        assert worst <= 1e-4, f"{where}: gradient of {name} differs from HF's by {worst:.3g} (relative)"
    chunks[0].zero_grad()
    print(f"  ok {where}: gradients vs HF autograd, max relative error {worst:.2e}", flush=True)


def check_split_attributes(case, chunks, groups, where):
    """The loaded model (built without Megatron's initialisation) marks its TP-split weights as an
    initialised build of the same layout does: the optimizer's gradient norm counts a weight on
    every TP rank only when it is marked split (learner.model.set_tensor_parallel_attributes)."""
    from entr_megatron.learner.build import build_learner_model_from_hf

    def marks(model_chunks):
        return {f"{i}.{name}": tuple(getattr(p, a, None) for a in ("tensor_model_parallel", "partition_dim",
                                                                   "partition_stride"))
                for i, chunk in enumerate(model_chunks) for name, p in chunk.named_parameters()}

    initialised, _ = build_learner_model_from_hf(case["path"], groups, load_weights=False)
    got, want = marks(chunks), marks(initialised)
    assert got == want, f"{where}: {[(n, got[n], want.get(n)) for n in got if got[n] != want.get(n)]}"
    assert sum(m[0] is True for m in want.values()) >= 4, f"{where}: the case must have split weights"


def run_case(case, tp=1, pp=1, ep=1, vpp=None, round_trip=True):
    import torch.distributed as dist

    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.parallel.groups import initialize_model_parallel

    where = f"{os.path.basename(case['path'])} tp={tp} pp={pp} ep={ep}" + (f" vpp={vpp}" if vpp else "")
    t0 = time.perf_counter()
    groups = initialize_model_parallel(tp, pp, ep=ep, vpp=vpp)
    chunks, spec = build_learner_model_from_hf(case["path"], groups, vp_size=vpp)
    assert len(chunks) == (vpp or 1), where
    if groups.is_first_stage():
        rows = chunks[0].embedding.word_embeddings.weight.shape[0] * tp
        assert rows == (252 if case["model_type"] == "qwen2" and tp == 2 else spec.vocab_size), where
    worst = check_scores(case, chunks, spec, groups, where)
    if round_trip:
        check_round_trip(case, chunks, spec, groups, where)
    if dist.get_rank() == 0:
        print(f"  ok {where}: max |learner - HF| {worst:.2e} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return chunks, spec, groups


def _one_rank(rank, world, cases):
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    for case in cases:
        chunks, spec, groups = run_case(case, round_trip=case["model_type"] in ("llama", "qwen3_moe"))
        if case["model_type"] in ("glm4_moe", "deepseek_v3"):  # MLA, the sigmoid router, shared experts
            check_gradients(case, chunks, spec, groups, case["model_type"])


def _two_ranks(rank, world, cases, deep_case, variant_cases, save_dir):
    from entr_megatron.learner.build import read_hf_config
    from entr_megatron.learner.hf_export import save_hf_checkpoint
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    by_type = {c["model_type"]: c for c in cases}
    for case in cases:
        chunks, spec, groups = run_case(case, tp=2)
        check_split_attributes(case, chunks, groups, f"{case['model_type']} tp=2")
        if case["model_type"] == "qwen2":  # padded vocab (251 rows -> 252) survives the trip to disk
            save_hf_checkpoint(chunks, spec, groups, save_dir, hf_config=read_hf_config(case["path"]),
                               max_shard_bytes=200_000)
    run_case(by_type["llama"], pp=2)  # tied embeddings across stages
    run_case(by_type["qwen3_moe"], ep=2)
    run_case(by_type["mixtral"], pp=2, round_trip=False)
    run_case(deep_case, pp=2, vpp=2)  # interleaved schedule, tied embeddings
    for model_type in ("glm4_moe", "deepseek_v3"):  # a dense stage and an MoE stage; experts split
        run_case(by_type[model_type], pp=2)
        run_case(by_type[model_type], tp=2, ep=2)
    for case in variant_cases:
        chunks, _, groups = run_case(case, tp=2)
        check_split_attributes(case, chunks, groups, f"{os.path.basename(case['path'])} tp=2")


def test_learner_matches_hf_at_tp1(cases):
    run_gloo(_one_rank, 1, cases, timeout_s=300)


def test_learner_matches_hf_at_tp2_pp2_ep2_and_exports_hf_weights(cases, deep_case, variant_cases, tmp_path):
    save_dir = str(tmp_path / "saved")
    run_gloo(_two_ranks, 2, cases, deep_case, variant_cases, save_dir, timeout_s=300)
    # The saved directory is an HF model transformers loads, with the original weights.
    case = next(c for c in cases if c["model_type"] == "qwen2")
    assert os.path.isfile(os.path.join(save_dir, "model.safetensors.index.json"))  # sharded (small max_shard_bytes)
    original = transformers.AutoModelForCausalLM.from_pretrained(case["path"]).state_dict()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(save_dir).state_dict()
    assert sorted(reloaded) == sorted(original)
    for name in original:
        assert torch.equal(reloaded[name], original[name]), name
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_packing_keeps_order_and_one_common_length():
    from entr_megatron.learner.sequence_packing import pack_sequences

    batches, length = pack_sequences([5, 9, 2, 20, 3], batch_tokens=12, multiple_of=4)
    assert length == 20  # the longest sequence, already a multiple of 4
    assert [b.indices for b in batches] == [[0, 1, 2], [3], [4]]
    assert [b.starts for b in batches] == [[0, 5, 14], [0], [0]]
    _, length = pack_sequences([5, 9], batch_tokens=10, multiple_of=4)
    assert length == 12
    with pytest.raises(ValueError, match="at least one token"):
        pack_sequences([3, 0], batch_tokens=8)


# --- checkpoint validation (headers only, no ranks needed) -------------------------------------


def _rewrite(src, dst, edit):
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    with HfCheckpoint(src) as ckpt:
        tensors = {k: ckpt.get(k) for k in ckpt.keys()}
    edit(tensors)
    safetensors_torch.save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing 1: model\.layers\.1\.mlp\.up_proj\.weight"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), r"unexpected 1: model\.layers\.0\.extra\.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
     r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 64\], config\.json implies \[32, 64\]"),
])
def test_bad_checkpoints_are_refused_naming_the_tensors(cases, tmp_path, edit, message):
    case = next(c for c in cases if c["model_type"] == "qwen2")
    spec = models.model_spec(transformers.AutoConfig.from_pretrained(case["path"]))
    bad = _rewrite(case["path"], str(tmp_path / "bad"), edit)
    with HfCheckpoint(bad) as ckpt, pytest.raises(ValueError, match=message):
        check_hf_checkpoint(ckpt, spec)


def test_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="only safetensors checkpoints are supported"):
        HfCheckpoint(tmp_path)

"""`entr-megatron convert`: HF <-> dist checkpoint for the seven families, resharded, verified, strict.

The conversions run in the command's process without a model (one tensor at a time). Every
family goes HF -> dist checkpoint -> HF through the CLI (--no-verify) and comes back bit for bit
(GLM-4.5 and DeepSeek-V3 with a dense first layer, a shared expert and the router's non-zero
score-correction bias). The reader is checked against Megatron's own saves: one 2-rank gloo
launch loads each family into the learner at another layout (PP=2 with tied embeddings, TP=2
with a padded vocabulary and a distributed optimizer's state, TP=2 x EP=2, EP=2) and saves it
with `checkpoint.io`; converting those to HF gives the source's tensors, and the keys, global
shapes and `_extra_state` objects of the streamed writer's checkpoints are the ones Megatron's
save wrote. The CLI then converts a qwen3_moe both ways (verify on: its log-probs under the
learner loaded at TP=2 x EP=2 match transformers'), `score` reads a converted llama at PP=2,
glm4_moe at PP=2 and deepseek_v3 at TP=2 (HF's log-probs within 1e-4), and `convert verify`
fails on an HF source whose square q_proj was transposed. The refusals (truncated / corrupt
file, a shard missing from the index, an unknown model_type, a dropped tensor, MTP layers, a
config mismatch, an existing output, a checkpoint of another config) come before anything is
written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from entr_megatron.utils.spawn import run_gloo
from helpers import hf_scores

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ATOL = 1e-4
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.3, max_position_embeddings=256)


ROUTER = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
              topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5)


def hf_configs():
    """Tied embeddings (llama), qkv bias and an odd vocabulary (qwen2), q/k norms (qwen3, qwen3_moe), experts;
    GLM-4.5 (partial RoPE, q/k/v bias, q/k norms) and DeepSeek-V3 (MLA, YaRN) with DeepSeek's router."""
    return {
        "llama": transformers.LlamaConfig(**TINY, vocab_size=128, intermediate_size=96, tie_word_embeddings=True),
        "qwen2": transformers.Qwen2Config(**TINY, vocab_size=251, intermediate_size=96),
        "qwen3": transformers.Qwen3Config(**TINY, vocab_size=128, intermediate_size=96, head_dim=16),
        "qwen3_moe": transformers.Qwen3MoeConfig(**TINY, vocab_size=128, intermediate_size=96,
                                                 moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                 head_dim=16, norm_topk_prob=False),
        "mixtral": transformers.MixtralConfig(**TINY, vocab_size=128, intermediate_size=32, num_local_experts=4,
                                              num_experts_per_tok=2),
        "glm4_moe": transformers.Glm4MoeConfig(**TINY, **ROUTER, vocab_size=128, head_dim=16, use_qk_norm=True,
                                               attention_bias=True, partial_rotary_factor=0.5),
        "deepseek_v3": transformers.DeepseekV3Config(
            **(TINY | dict(num_key_value_heads=4)), **ROUTER, vocab_size=128, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                              mscale_all_dim=1.0)),
    }


def _tensors(hf_dir) -> dict[str, torch.Tensor]:
    from entr_megatron.learner.hf_load import HfCheckpoint

    with HfCheckpoint(hf_dir) as ckpt:
        return {k: ckpt.get(k) for k in ckpt.keys()}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """model_type -> HF directory of a random model (1-D weights perturbed; qwen3 sharded)."""
    root = tmp_path_factory.mktemp("convert_hf")
    out = {}
    for model_type, cfg in hf_configs().items():
        torch.manual_seed(sum(map(ord, model_type)))
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # a weight HF initialises to 0
                    b.copy_(0.3 * torch.randn_like(b))
        out[model_type] = root / model_type
        model.save_pretrained(out[model_type], max_shard_size="100KB" if model_type == "qwen3" else "1GB")
    return out


def _main(*args) -> None:
    from entr_megatron.cli.main import main

    main(["convert", *args])


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory):
    """model_type -> (checkpoint root, HF directory converted back from it), by the CLI without verify."""
    base = tmp_path_factory.mktemp("converted")
    out = {}
    for model_type, hf_dir in hf_models.items():
        ckpt, back = base / model_type / "ckpt", base / model_type / "back"
        _main("hf-to-megatron", "--hf", str(hf_dir), "--out", str(ckpt), "--no-verify")
        _main("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--max-shard-size", "200KB", "--no-verify")
        out[model_type] = (ckpt, back)
    return out


# Megatron's own saves: (family, tp, pp, ep, with a distributed optimizer's state), on 2 ranks.
SAVES = [("llama", 1, 2, 1, False), ("qwen2", 2, 1, 1, True), ("qwen3", 1, 2, 1, False),
         ("qwen3_moe", 2, 1, 2, False), ("mixtral", 1, 1, 2, False), ("glm4_moe", 1, 2, 1, False),
         ("deepseek_v3", 2, 1, 2, False)]


def _megatron_saves(rank, world, cases):
    from entr_megatron.checkpoint.io import save_checkpoint
    from entr_megatron.config.learner import LearnerConfig, OptimConfig
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.learner.hf_load import read_hf_config
    from entr_megatron.learner.optimizer import build_optimizer, wrap_model_chunks
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import destroy, initialize_model_parallel

    enable_cpu_compat()
    for hf_dir, root, tp, pp, ep, optimizer in cases:
        groups = initialize_model_parallel(tp, pp, ep=ep)
        chunks, _ = build_learner_model_from_hf(hf_dir, groups, config_overrides={"calculate_per_token_loss": True})
        opt = sched = None
        if optimizer:
            learner_cfg = LearnerConfig(optim=OptimConfig(use_distributed_optimizer=True))
            chunks = wrap_model_chunks(chunks, groups, learner_cfg)
            opt, sched = build_optimizer(chunks, learner_cfg)
        save_checkpoint(root, 3, chunks, opt, sched, model_config=read_hf_config(hf_dir))
        destroy()


@pytest.fixture(scope="module")
def megatron_saved(hf_models, tmp_path_factory):
    """model_type -> a checkpoint root Megatron's save wrote at the layout SAVES gives it (step 3)."""
    base = tmp_path_factory.mktemp("megatron_saved")
    cases = [(str(hf_models[m]), str(base / m), tp, pp, ep, opt) for m, tp, pp, ep, opt in SAVES]
    run_gloo(_megatron_saves, 2, cases, timeout_s=600)
    return {m: base / m for m, *_ in SAVES}


def _dist_entries(ckpt_dir):
    """{tensor key: global shape} and the byte-object keys of a dist checkpoint (RNG state left out)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    tensors = {k: tuple(v.size) for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    return tensors, {k for k in metadata if k not in tensors and not k.startswith("rng_state/")}


def _cli(capsys, *args):
    """Run the command in this process: (exit message or None, stdout + stderr)."""
    from entr_megatron.cli.main import main

    try:
        main(["convert", *args])
        code = None
    except SystemExit as e:
        code = str(e.code)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _same_tensors(got_dir, want_dir, what):
    want, got = _tensors(want_dir), _tensors(got_dir)
    assert sorted(got) == sorted(want), what
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), f"{what} {name}"


def test_round_trip_is_bit_identical_for_seven_families(hf_models, converted):
    for model_type, hf_dir in hf_models.items():
        ckpt, back = converted[model_type]
        assert (ckpt / "latest").read_text().strip() == "0" and (ckpt / "model_config.json").is_file()
        _same_tensors(back, hf_dir, model_type)
        assert (back / "model.safetensors.index.json").is_file(), model_type  # 200 kB shards
        config = json.loads((back / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert sorted(hf_models) == sorted(models_registry())
    assert _tensors(hf_models["deepseek_v3"])["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0


def models_registry():
    from entr_megatron import models

    return models.FAMILIES


def test_megatron_saves_of_other_layouts_convert_to_the_source(hf_models, converted, megatron_saved, tmp_path):
    assert sorted(m for m, *_ in SAVES) == sorted(hf_models), "every family needs a layout in SAVES"
    for model_type, tp, pp, ep, optimizer in SAVES:
        saved = megatron_saved[model_type]
        back = tmp_path / model_type
        _main("megatron-to-hf", "--ckpt", str(saved), "--out", str(back), "--no-verify")
        _same_tensors(back, hf_models[model_type], f"{model_type} saved at tp={tp} pp={pp} ep={ep}")
        # The streamed writer writes what Megatron's save does: keys, global shapes, _extra_state objects.
        mine, megatron = _dist_entries(converted[model_type][0] / "iter_0000000"), _dist_entries(saved / "iter_0000003")
        megatron_tensors = {k: v for k, v in megatron[0].items() if not k.startswith("optimizer.")}
        assert set(mine[0]) == set(megatron_tensors), model_type
        vocab = {"embedding.word_embeddings.weight", "output_layer.weight"}  # padded to the saving TP size
        assert all(mine[0][k] == megatron_tensors[k] for k in set(mine[0]) - vocab), model_type
        assert mine[1] == {k for k in megatron[1] if not k.startswith("optimizer.")}, model_type
        if optimizer:
            assert any(k.startswith("optimizer.") for k in megatron[0]), "no optimizer state to skip"
            assert megatron[0]["embedding.word_embeddings.weight"][0] == 252  # 251 padded to TP=2


def test_cli_qwen3_moe_both_ways_verified_at_tp2_ep2(hf_models, tmp_path, capsys):
    hf_dir, ckpt, back = hf_models["qwen3_moe"], tmp_path / "ckpt", tmp_path / "back"
    code, out = _cli(capsys, "hf-to-megatron", "--hf", str(hf_dir), "--out", str(ckpt))
    assert code is None, out
    assert "verify ok: max |delta log-prob|" in out and "mean KL" in out, out
    record = json.loads((ckpt / "conversion.json").read_text())
    assert record["model_type"] == "qwen3_moe" and record["dtype"] == "fp32"
    assert record["tensors"] == len(_tensors(hf_dir))
    assert record["verify"]["max_abs_delta_logprob"] <= ATOL
    assert set(record["source_sha256"]) == {"model.safetensors", "config.json"}
    # Resharded TP=1 -> TP=2 x EP=2 (2 ranks: the experts split over the TP ranks); verify compares the
    # learner's log-probs with transformers' of the written directory, which equals the source.
    code, out = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--tp", "2", "--ep", "2",
                     "--max-shard-size", "100KB")
    assert code is None, out
    assert "on 2 rank(s): tp=2 pp=1 ep=2" in out and "verify ok" in out, out
    want, got = _tensors(hf_dir), _tensors(back)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "conversion.json"} <= {
        p.name for p in back.iterdir()}
    assert json.loads((back / "conversion.json").read_text())["verify"]["max_abs_delta_logprob"] <= ATOL
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    code, out = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back))
    assert code is not None and "exists and is not empty (pass --overwrite" in code, code


def test_converted_checkpoint_scores_like_hf_at_pp2(hf_models, converted, tmp_path, capsys):
    from entr_megatron.cli.main import main

    ckpt, _ = converted["llama"]
    g = torch.Generator().manual_seed(5)
    lines = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (11, 7)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in lines))
    main(["score", "--model", str(ckpt), "--pp", "2", "--input", str(inp), "--output", str(out),
          "--batch-tokens", "16"])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"]).eval()
    for ids, row in zip(lines, map(json.loads, out.read_text().splitlines())):
        ref_lp, _ = hf_scores(model, ids)
        torch.testing.assert_close(torch.tensor(row["logprobs"], dtype=torch.float64), ref_lp, rtol=0, atol=ATOL)


@pytest.mark.parametrize("model_type, layout", [("glm4_moe", ("--pp", "2")), ("deepseek_v3", ("--tp", "2"))])
def test_converted_deepseek_style_checkpoints_score_like_hf(hf_models, converted, tmp_path, model_type, layout):
    """A dense stage and an MoE stage (PP=2); MLA's projections and the shared expert split over TP=2."""
    from entr_megatron.cli.main import main

    ckpt, _ = converted[model_type]
    g = torch.Generator().manual_seed(6)
    lines = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (13, 6)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in lines))
    main(["score", "--model", str(ckpt), *layout, "--input", str(inp), "--output", str(out), "--batch-tokens", "16"])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models[model_type]).eval()
    for ids, row in zip(lines, map(json.loads, out.read_text().splitlines())):
        ref_lp, _ = hf_scores(model, ids)
        torch.testing.assert_close(torch.tensor(row["logprobs"], dtype=torch.float64), ref_lp, rtol=0, atol=ATOL)


def test_transposed_square_matrix_fails_verification(hf_models, converted, tmp_path, capsys):
    src, (ckpt, _) = hf_models["llama"], converted["llama"]
    tampered = tmp_path / "tampered"
    shutil.copytree(src, tampered)
    tensors = _tensors(src)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert tensors[name].shape == (64, 64)  # square: the shapes cannot tell
    tensors[name] = tensors[name].t().contiguous()
    safetensors_torch.save_file(tensors, str(tampered / "model.safetensors"), metadata={"format": "pt"})
    code, out = _cli(capsys, "verify", "--hf", str(tampered), "--ckpt", str(ckpt))
    assert code is not None and "verify FAILED" in code and "max |delta log-prob|" in code, (code, out)
    delta = float(code.split("max |delta log-prob| ")[1].split(",")[0])
    assert delta > 100 * ATOL, code


# --- refusals, before any rank starts ---------------------------------------------------------


def _copy(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def _hf_to_megatron(capsys, hf_dir, out, *extra):
    code, text = _cli(capsys, "hf-to-megatron", "--hf", str(hf_dir), "--out", str(out), *extra)
    assert code is not None, text
    assert not Path(out).exists(), f"{out} was left behind"
    return code


def test_damaged_sources_are_refused_naming_the_file(hf_models, tmp_path, capsys):
    bad = _copy(hf_models["llama"], tmp_path / "truncated")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-1000])
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert "model.safetensors: truncated" in code and f"{len(data) - 1000} bytes" in code, code

    bad = _copy(hf_models["llama"], tmp_path / "corrupt")
    (bad / "model.safetensors").write_bytes(data[:8] + b"#" * 16 + data[24:])
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert "model.safetensors: corrupt safetensors header" in code, code

    bad = _copy(hf_models["qwen3"], tmp_path / "missing_shard")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (bad / shard).unlink()
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert f"to {shard}, which does not exist" in code, code


def test_model_errors_name_what_is_wrong(hf_models, tmp_path, capsys):
    bad = _copy(hf_models["llama"], tmp_path / "unknown")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert ("model_type='gpt2' is not supported; supported: ['deepseek_v3', 'glm4_moe', 'llama', 'mixtral', 'qwen2', "
            "'qwen3', 'qwen3_moe']") in code

    bad = _copy(hf_models["qwen2"], tmp_path / "dropped")
    tensors = _tensors(bad)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert "missing 1: model.layers.1.mlp.up_proj.weight" in code, code

    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    safetensors_torch.save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert "unexpected 1: model.layers.0.extra.weight" in code, code

    bad = _copy(hf_models["llama"], tmp_path / "untied")  # tied config, a different lm_head stored
    tensors = _tensors(bad)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    safetensors_torch.save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert "ties the embeddings" in code and "lm_head.weight differs from model.embed_tokens.weight" in code, code


def test_unmapped_tensors_are_skipped_only_when_allowed(hf_models):
    from entr_megatron import models
    from entr_megatron.learner.hf_load import HfCheckpoint, check_hf_checkpoint

    spec = models.model_spec(json.loads((hf_models["qwen2"] / "config.json").read_text()))
    with HfCheckpoint(hf_models["qwen2"]) as ckpt:
        ckpt._file_of["model.layers.0.extra.weight"] = "model.safetensors"  # headers only: never read
        with pytest.raises(ValueError, match=r"unexpected 1: model\.layers\.0\.extra\.weight"):
            check_hf_checkpoint(ckpt, spec)
        assert check_hf_checkpoint(ckpt, spec, ["model.layers.*.extra.*"]) == ["model.layers.0.extra.weight"]


def test_mtp_layers_are_refused_naming_the_field(hf_models, tmp_path, capsys):
    """GLM-4.5 and DeepSeek-V3 checkpoints carry num_nextn_predict_layers MTP layers after the decoder
    layers (transformers ignores them); they are refused, or skipped when named with --allow-unmapped."""
    from entr_megatron import models
    from entr_megatron.learner.hf_load import HfCheckpoint, check_hf_checkpoint

    bad = _copy(hf_models["glm4_moe"], tmp_path / "mtp")
    tensors = _tensors(bad)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.enorm.weight"] = torch.ones(64)
    safetensors_torch.save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    code = _hf_to_megatron(capsys, bad, tmp_path / "out")
    assert ("2 tensors of multi-token-prediction layers (num_nextn_predict_layers=1: model.layers.2.eh_proj.weight, "
            "model.layers.2.enorm.weight), which are not supported") in code, code
    assert "pass --allow-unmapped 'model.layers.2.*'" in code, code
    spec = models.model_spec(json.loads((bad / "config.json").read_text()))
    with HfCheckpoint(bad) as ckpt:
        assert check_hf_checkpoint(ckpt, spec, ["model.layers.2.*"]) == ["model.layers.2.eh_proj.weight",
                                                                          "model.layers.2.enorm.weight"]


def test_checkpoint_of_another_model_is_refused(hf_models, converted, tmp_path, capsys):
    ckpt, _ = converted["llama"]
    code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "o"),
                   "--hf-config", str(hf_models["qwen2"]))
    assert code is not None and "model_type is 'llama' in the checkpoint's model_config.json, 'qwen2'" in code, code
    config = json.loads((hf_models["llama"] / "config.json").read_text())
    other = tmp_path / "config.json"
    other.write_text(json.dumps(config | {"intermediate_size": 128}))
    code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "o"),
                   "--hf-config", str(other))
    assert code is not None and "intermediate_size is 96 in the checkpoint's model_config.json, 128" in code, code
    assert not (tmp_path / "o").exists()
    ds_ckpt, _ = converted["deepseek_v3"]
    ds = json.loads((hf_models["deepseek_v3"] / "config.json").read_text())
    for change, message in ((dict(kv_lora_rank=32), "kv_lora_rank is 16 in the checkpoint's model_config.json, 32"),
                            (dict(routed_scaling_factor=1.0),
                             "routed_scaling_factor is 2.5 in the checkpoint's model_config.json, 1.0"),
                            (dict(rope_parameters=ds["rope_parameters"] | dict(factor=8.0)),
                             "rope_scaling.factor is 4.0 in the checkpoint's model_config.json, 8.0")):
        other.write_text(json.dumps(ds | change))
        code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(ds_ckpt), "--out", str(tmp_path / "o"),
                       "--hf-config", str(other))
        assert code is not None and message in code, (change, code)
    # A checkpoint whose model_config.json is not the model it holds: caught from the tensors' global shapes.
    swapped = Path(shutil.copytree(ckpt, tmp_path / "swapped"))
    (swapped / "model_config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(swapped), "--out", str(tmp_path / "o"), "--no-verify")
    assert code is not None and "decoder.layers.mlp.linear_fc1.weight has global shape [2, 192, 64], the config " \
        "implies [2, 256, 64]" in code, code
    (swapped / "model_config.json").write_text(json.dumps(json.loads((hf_models["qwen2"] / "config.json").read_text())))
    code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(swapped), "--out", str(tmp_path / "o"), "--no-verify")
    assert code is not None and "it lacks 2 the config implies: decoder.layers.self_attention.linear_qkv.bias, " \
        "output_layer.weight" in code, code
    assert not (tmp_path / "o").exists()


def test_bf16_both_ways_and_dtype_auto(hf_models, tmp_path, capsys):
    hf_dir, ckpt, back = hf_models["qwen2"], tmp_path / "ckpt", tmp_path / "back"
    code, out = _cli(capsys, "hf-to-megatron", "--hf", str(hf_dir), "--out", str(ckpt), "--dtype", "bf16", "--no-verify")
    assert code is None, out
    code, out = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--dtype", "auto", "--no-verify")
    assert code is None and "(bf16)" in out, out
    want, got = _tensors(hf_dir), _tensors(back)
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].bfloat16()) for k in want)
    config = json.loads((back / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert json.loads((back / "conversion.json").read_text())["dtype"] == "bf16"


def test_damaged_checkpoint_is_refused_before_converting(converted, tmp_path, capsys):
    ckpt = Path(shutil.copytree(converted["llama"][0], tmp_path / "ckpt"))
    shard = next((ckpt / "iter_0000000").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "o"))
    assert code is not None and f"{shard.name}: SHA-256 differs from the manifest (damaged)" in code, code
    code, _ = _cli(capsys, "megatron-to-hf", "--ckpt", str(ckpt), "--step", "3", "--out", str(tmp_path / "o"))
    assert code is not None and "no checkpoint for step 3" in code, code
    assert not (tmp_path / "o").exists()


# --- train from a converted checkpoint ---------------------------------------------------------


def _train_config(path, run_dir, model_path):
    import yaml

    path.write_text(yaml.safe_dump({
        "model": {"path": str(model_path), "architecture": None, "max_prompt_len": 16, "max_seq_len": 32},
        "algorithm": {"correction": "entr", "tau": 0.5},
        "rollout": {"prompts_per_step": 2, "sampling": {"max_new_tokens": 6, "n": 4},
                    "embedded": {"num_threads": 1, "max_batch_size": 32}},
        "controller": {"mode": "sync", "train_steps": 1, "checkpoint_interval": 0},
        "task": {"name": "arithmetic", "eval_size": 0, "arithmetic": {"digits": 1, "operations": ["+"]}},
        "launcher": {"cpu_threads_per_rank": 1},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "log_interval": 1, "tensorboard": False}}))
    return path


def test_train_starts_from_a_converted_checkpoint(tmp_path, capsys):
    """model.path = a checkpoint root `convert hf-to-megatron` wrote: the run's model_init is the source
    bit for bit (tokenizer included), and at the first step (sync: the engine samples with the weights
    the learner scores) the learner's log-probs equal the engine's (HF transformers on those weights,
    i.e. the source's): mismatch k3 ~ 0."""
    import subprocess
    import sys

    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.job.model_init import from_learner_checkpoint
    from entr_megatron.tasks import default_tokenizer
    from entr_megatron.utils.run_log import read_metrics

    tokenizer = default_tokenizer("arithmetic")
    torch.manual_seed(3)
    hf_dir, ckpt, run_dir = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "run"
    config = transformers.Qwen3Config(**TINY, vocab_size=len(tokenizer), intermediate_size=96, head_dim=16,
                                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    code, out = _cli(capsys, "hf-to-megatron", "--hf", str(hf_dir), "--out", str(ckpt), "--no-verify")
    assert code is None, out
    cfg_file = _train_config(tmp_path / "run.yaml", run_dir, ckpt)
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(cfg_file)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "is a learner checkpoint: converting step 0" in proc.stdout + proc.stderr
    model_init = run_dir / "model_init"
    _same_tensors(model_init, hf_dir, "model_init")
    assert (model_init / "tokenizer.json").is_file()
    [row] = read_metrics(run_dir / "metrics.jsonl")  # the one step (numbered 0)
    assert row["mismatch/tokens"] > 0 and row["mismatch/k3"] <= 1e-6 and row["mismatch/mean_abs_delta"] <= 1e-5, row
    # A later start reuses it; another checkpoint in the same run directory is refused, not mixed in.
    cfg = load_config(str(cfg_file), [])
    assert from_learner_checkpoint(cfg, run_dir).model.path == str(model_init)
    shutil.copytree(ckpt, tmp_path / "other")
    with pytest.raises(ValueError, match=r"was converted from step 0 of .*ckpt/iter_0000000, the checkpoint now "
                                         r"gives step 0 of .*other/iter_0000000"):
        from_learner_checkpoint(load_config(str(cfg_file), [f"model.path={tmp_path / 'other'}"]), run_dir)

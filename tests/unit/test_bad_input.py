"""Bad input to `train | sft | eval | score` is refused up front, with the field or file named and
what would be valid: before any process starts and before anything is written to the run directory.

The CLI is called in-process (`main([...])`): its checks run before any rank or engine starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import types
import sys
import typing

import pytest

from entr_megatron.config import AlgorithmConfig, OptimConfig, RunConfig
from entr_megatron.config.loader import load_config
from entr_megatron.config.validate import FieldError

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "cpu_demo.yaml"
STUDIES = sorted(p for p in (ROOT / "examples" / "studies").rglob("*.yaml")
                 if "\nbase:" in p.read_text())  # the others: base.yaml (a run), a planner's cluster file
RUN_EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + [ROOT / "examples" / "studies" / "base.yaml",
                                                            ROOT / "examples" / "studies" / "countdown" / "base.yaml"]


def _cli(capsys, *argv) -> tuple[int, str]:
    """(exit status, stderr) of `entr-megatron ARGV` run in this process; it must exit."""
    from entr_megatron.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    code = e.value.code
    err = capsys.readouterr().err
    return (code if isinstance(code, int) else 1), (err if isinstance(code, int) else f"{err}{code}")


def _message(fn, *args, error=ValueError) -> str:
    with pytest.raises(error) as e:
        fn(*args)
    return str(e.value)


# --- 1, 2: the config file itself -----------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# and another\n", "null\n", "~\n", "{}\n"])
def test_an_empty_config_is_refused_not_run_with_the_defaults(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert _message(load_config, path) == f"{path}: the config is empty (see examples/cpu_demo.yaml)"


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("3\n", "int"), ("sync\n", "str")])
def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path, text, kind):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert _message(load_config, path) == (
        f"{path}: the top level must be a mapping of sections (model:, rollout:, ...), got {kind}")


def test_a_non_utf8_config_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("controller:\n  mode: sync  # caf\u00e9\n".encode("latin-1"))  # 0xe9 at line 2, column 20
    assert _message(load_config, path) == f"{path}:2:20: not UTF-8 text (byte 0xe9); a config is a UTF-8 YAML file"


def test_a_directory_is_not_a_config_file(tmp_path):
    assert _message(load_config, tmp_path) == f"{tmp_path}: is a directory, not a YAML file"
    assert "does not exist" in _message(load_config, tmp_path / "nope.yaml", error=FileNotFoundError)


def test_cli_prints_one_line_naming_the_file_and_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    for config, problem in [(empty, "the config is empty"), (tmp_path, "is a directory, not a YAML file")]:
        code, err = _cli(capsys, "train", "--config", str(config), "--run-dir", str(tmp_path / "run"))
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"entr-megatron train: invalid config: {config}: {problem}"), err
    assert not (tmp_path / "run").exists()


# --- 3: model.architecture keys -------------------------------------------------------------


@pytest.mark.parametrize("key, suggestion", [
    ("num_hidden_layer", "num_hidden_layers"),
    ("hidden_sizee", "hidden_size"),
    ("num_key_value_head", "num_key_value_heads"),
    ("rope_thetaa", "rope_theta"),
])
def test_an_architecture_typo_is_refused_with_the_closest_names(key, suggestion):
    from entr_megatron.controller.job.run import check_inputs

    cfg = load_config(DEMO, [f"model.architecture.{key}=2"])  # the loader takes any key: transformers decides
    msg = _message(check_inputs, cfg)
    assert f"unknown key model.architecture.{key} " in msg and "Qwen3Config" in msg, msg
    assert f"did you mean {suggestion!r}?" in msg, msg


def test_an_architecture_key_nothing_resembles_lists_the_valid_names():
    from entr_megatron import models

    msg = _message(models.check_architecture, {"model_type": "llama", "zzz": 1})
    assert msg.startswith("unknown key model.architecture.zzz (transformers' LlamaConfig has no such field"), msg
    assert "valid names: " in msg and "num_hidden_layers" in msg and "mlp_bias" in msg, msg
    msg = _message(models.check_architecture, {"model_type": "gpt2", "n_layer": 2})
    assert msg == ("model.architecture.model_type='gpt2' is not valid; allowed: llama, qwen2, qwen3, qwen3_moe, mixtral, "
                   "glm4_moe, deepseek_v3")


SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}


@pytest.mark.parametrize("arch", [
    {"model_type": "qwen3", **SMALL, "head_dim": 16, "rope_theta": 1e6, "tie_word_embeddings": True},
    # Qwen2Config / Qwen3MoeConfig have no head_dim, but HF's attention and our reader take it
    {"model_type": "qwen2", **SMALL, "head_dim": 32},
    {"model_type": "qwen3_moe", **SMALL, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
     "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": []},
    {"model_type": "mixtral", **SMALL, "num_local_experts": 4, "rope_scaling": None, "vocab_size": 100},
    {"model_type": "llama", **SMALL, "mlp_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
], ids=lambda a: a["model_type"])
def test_valid_architectures_pass(arch):
    from entr_megatron import models

    models.check_architecture(arch)
    models.model_spec(models.architecture_hf_config(arch))


@pytest.mark.parametrize("path", RUN_EXAMPLES, ids=lambda p: p.name)
def test_example_configs_still_load_and_their_architectures_pass(path):
    from entr_megatron import models

    cfg = load_config(path)
    if cfg.model.architecture:
        models.check_architecture(cfg.model.architecture)


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_study_specs_still_load_and_their_cells_validate(path):
    from entr_megatron import models
    from entr_megatron.study.spec import load_spec

    cells = load_spec(path).cells()
    assert cells
    for arch in {json.dumps(c.config.model.architecture, sort_keys=True) for c in cells}:
        if arch != "null":
            models.check_architecture(json.loads(arch))


# --- 4: non-finite numbers ------------------------------------------------------------------


def _float_fields(cls: type, prefix: str = "") -> typing.Iterator[str]:
    """Dotted paths of every float field of the typed config below `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        section = next((a for a in args if dataclasses.is_dataclass(a)), None)
        if section is not None:
            yield from _float_fields(section, f"{prefix}{f.name}.")
        elif float in args:
            yield f"{prefix}{f.name}"


FLOAT_FIELDS = sorted(_float_fields(RunConfig))


def test_there_are_float_fields_to_check():
    assert {"learner.optim.lr", "algorithm.tau", "rollout.sampling.temperature", "sft.lr"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_every_float_field_refuses_inf_and_nan(value):
    for field in FLOAT_FIELDS:
        msg = _message(load_config, DEMO, [f"{field}={value}"])
        shown = {".inf": "inf", "-.inf": "-inf", ".nan": "nan"}[value]
        assert msg.startswith(f"{field}={shown} is not valid; must be a finite number (not .inf or .nan)"), msg


def test_inf_in_a_file_and_inside_the_architecture_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(DEMO.read_text().replace("lr: 1.0e-4", "lr: .inf"))
    msg = _message(load_config, path)
    assert msg == f"learner.optim.lr=inf is not valid; must be a finite number (not .inf or .nan)  [file {path}]"
    msg = _message(load_config, DEMO, ["model.architecture.rope_theta=.nan"])
    assert msg.startswith("model.architecture.rope_theta=nan is not valid; must be a finite number"), msg


def test_sections_built_in_python_refuse_inf_too():
    with pytest.raises(FieldError, match=r"AlgorithmConfig\.tau=inf is not valid; must be a finite number"):
        AlgorithmConfig(tau=math.inf)
    with pytest.raises(FieldError, match=r"optim\.lr=nan is not valid; must be a finite number"):
        OptimConfig(lr=math.nan)


def test_a_bands_upper_end_is_the_one_place_inf_is_allowed():
    assert load_config(DEMO, ["algorithm.icepop_band=[0.5, .inf]"]).algorithm.icepop_band == (0.5, math.inf)
    for band in ("[-.inf, 2]", "[0.5, .nan]", "[.nan, 2]"):
        msg = _message(load_config, DEMO, [f"algorithm.mis_token_band={band}"])
        assert msg.startswith("algorithm.mis_token_band=") and "hi may be .inf" in msg, msg


# --- 5: the parallel layout against the model -----------------------------------------------


def _layout_error(overrides, config=DEMO) -> str:
    from entr_megatron.controller.job.run import check_model_layout

    return _message(check_model_layout, load_config(config, overrides))


def test_tp_must_divide_the_heads():
    msg = _layout_error(["parallel.tp=3", "launcher.nproc_per_node=3"])
    assert msg.startswith("parallel.tp=3 is not valid; must divide num_attention_heads=4, num_key_value_heads=2 "
                          "of the model (model.architecture)"), msg


def test_pp_and_vpp_must_divide_the_layers():
    msg = _layout_error(["parallel.pp=3", "launcher.nproc_per_node=3"])
    assert msg.startswith("parallel.pp=3 is not valid; must divide num_hidden_layers=4 of the model"), msg
    msg = _layout_error(["parallel.pp=2", "parallel.vpp=4", "launcher.nproc_per_node=2"])
    assert msg.startswith("parallel.vpp=4 is not valid with parallel.pp=2; pp * vpp = 8 must divide "
                          "num_hidden_layers=4 of the model"), msg
    from entr_megatron.controller.job.run import check_model_layout

    check_model_layout(load_config(DEMO, ["parallel.pp=2", "parallel.vpp=2", "launcher.nproc_per_node=2"]))


def test_ep_must_divide_the_experts_and_needs_an_moe_model():
    msg = _layout_error(["parallel.ep=2", "launcher.nproc_per_node=2"])
    assert msg == "parallel.ep=2 is not valid; needs an MoE model; the model of model.architecture is dense: use 1"
    moe = ["model.architecture.model_type=qwen3_moe", "model.architecture.num_experts=6",
           "model.architecture.num_experts_per_tok=2", "model.architecture.moe_intermediate_size=32"]
    msg = _layout_error([*moe, "parallel.ep=4", "launcher.nproc_per_node=4"])
    assert msg.startswith("parallel.ep=4 is not valid; must divide num_experts=6 of the model"), msg
    msg = _layout_error([*moe, "parallel.expert_tp=3", "launcher.nproc_per_node=3"])
    assert msg.startswith("parallel.expert_tp=3 is not valid; must divide moe_intermediate_size=32"), msg


def test_a_model_path_is_read_from_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}))
    over = [f"model.path={tmp_path}", "model.architecture=null", "model.tokenizer=unused"]
    msg = _layout_error([*over, "parallel.tp=3", "launcher.nproc_per_node=3"])
    assert msg.startswith(f"parallel.tp=3 is not valid; must divide num_key_value_heads=2, intermediate_size=128 "
                          f"of the model (model.path {tmp_path})"), msg
    msg = _layout_error([f"model.path={tmp_path / 'nope'}", "model.architecture=null", "model.tokenizer=unused"])
    assert msg.startswith(f"model.path='{tmp_path / 'nope'}' is not valid;") and "no HF config.json" in msg, msg


def test_score_uses_the_same_rule_with_its_flags():
    from entr_megatron import models
    from entr_megatron.cli.sequence_scoring import _check_layout

    spec = models.model_spec(models.architecture_hf_config(load_config(DEMO).model.architecture))
    assert _message(_check_layout, spec, 3, 1).startswith("--tp 3 does not divide the model's num_attention_heads=4")
    assert _message(_check_layout, spec, 1, 3).startswith("--pp 3 does not divide the model's num_hidden_layers=4")


def test_cli_refuses_the_layout_before_any_process_starts(tmp_path, capsys):
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"),
                     "parallel.tp=3", "launcher.nproc_per_node=3")
    assert code == 2 and "parallel.tp=3 is not valid; must divide num_attention_heads=4" in err, err
    code, err = _cli(capsys, "sft", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"),
                     "model.architecture.num_hidden_layer=2")
    assert code == 2 and "did you mean 'num_hidden_layers'?" in err, err
    assert not (tmp_path / "run").exists()


# --- 6: the task ----------------------------------------------------------------------------


def _math(tmp_path, *files):
    return ["task.name=math", f"task.math.train_files=[{', '.join(str(f) for f in files)}]",
            f"model.tokenizer={tmp_path / 'tok'}"]


def test_missing_or_unreadable_data_files_are_named_before_anything_is_written(tmp_path, capsys):
    missing, folder = tmp_path / "nope.jsonl", tmp_path / "folder.jsonl"
    folder.mkdir()
    run = tmp_path / "run"
    for command in ("train", "sft", "eval"):
        where = ["--model", str(tmp_path)] if command == "eval" else ["--run-dir", str(run)]  # eval: one of the two
        code, err = _cli(capsys, command, "--config", str(DEMO), *where, *_math(tmp_path, missing))
        assert code == 2, err
        assert f"invalid config: task.math.train_files=('{missing}',) is not valid; {missing} does not exist" in err
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(run), *_math(tmp_path, folder))
    assert code == 2 and f"{folder} is a directory, not a file" in err, err
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(run), f"sft.data_files=[{missing}]",
                     "sft.target_accuracy=null")  # the demo's target is checked on generated problems
    assert code == 2 and f"sft.data_files=('{missing}',) is not valid; {missing} does not exist" in err, err
    assert not run.exists()


def test_an_unknown_task_name_is_refused(tmp_path, capsys, monkeypatch):
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"), "task.name=chess")
    assert code == 2 and "task.name='chess' is not valid; allowed: arithmetic, math" in err, err
    # A name the config admits but no task builder serves (the two lists out of step) is refused too.
    from entr_megatron.controller.job.run import check_inputs
    from entr_megatron import tasks

    monkeypatch.delitem(tasks.TASK_BUILDERS, "arithmetic")
    msg = _message(check_inputs, load_config(DEMO), error=FieldError)
    assert msg.startswith("task.name='arithmetic' is not valid; allowed: math"), msg


def test_train_reads_the_task_before_it_writes_config_yaml(tmp_path):
    from entr_megatron.controller.job.run import run_train
    from entr_megatron.tasks import build_char_tokenizer, save_char_tokenizer

    save_char_tokenizer(build_char_tokenizer(), str(tmp_path / "tok"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": \n')
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="broken.jsonl"):
        run_train(load_config(DEMO, _math(tmp_path, broken)), run)
    assert not (run / "config.yaml").exists()


# --- 7: score -------------------------------------------------------------------------------


def test_score_refuses_a_line_longer_than_the_models_positions(tmp_path):
    from entr_megatron.cli.sequence_scoring import read_input

    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n\n" + json.dumps({"input_ids": [5] * 201}) + "\n")
    assert _message(read_input, str(path), 128, 64) == (
        f'{path}:3: "input_ids" has 201 tokens, more than the model\'s 64 positions (max_position_embeddings); '
        "shorten or drop the line")
    assert len(read_input(str(path), 128, 201)) == 2


def _failing_rank(rank, world, port, threads, job):
    raise ValueError(f"rank {rank} cannot load its shard")


def test_a_failed_score_rank_shows_its_own_error(monkeypatch):
    from entr_megatron.cli import sequence_scoring

    monkeypatch.setattr(sequence_scoring, "_rank_main", _failing_rank)  # what the spawned rank runs
    msg = _message(sequence_scoring._launch, 1, None, error=RuntimeError)
    assert msg.startswith("rank 0 failed:") and "ValueError: rank 0 cannot load its shard" in msg, msg


def test_a_warm_up_without_examples_is_refused_before_anything_starts(tmp_path, capsys):
    from entr_megatron.tasks import build_char_tokenizer, save_char_tokenizer

    save_char_tokenizer(build_char_tokenizer(), str(tmp_path / "tok"))
    good = tmp_path / "train.jsonl"
    good.write_text("".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(20)))
    run = tmp_path / "run"
    for command in ("train", "sft"):  # the demo has an sft section; the math task generates no SFT data
        code, err = _cli(capsys, command, "--config", str(DEMO), "--run-dir", str(run), *_math(tmp_path, good),
                         "task.eval_size=0")
        assert code == 2, err
        assert "sft.data_files=[] is not valid; task 'math' generates no SFT examples" in err, err
    assert not run.exists()


# --- 8: the model's files, checked before anything starts (checkpoint/model_inputs.py) -------


def _truncated_model(tmp_path):
    from model_dir_fixture import write_model_dir

    d = write_model_dir(tmp_path / "model")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-64])
    return d, f"{d / 'model.safetensors'}: truncated: {len(data) - 64} bytes, its header says {len(data)}"


def test_train_and_sft_refuse_a_truncated_model_or_one_without_tokenizer(tmp_path, capsys):
    from model_dir_fixture import write_model_dir

    d, problem = _truncated_model(tmp_path)
    run = tmp_path / "run"
    for command in ("train", "sft"):
        code, err = _cli(capsys, command, "--config", str(DEMO), "--run-dir", str(run), f"model.path={d}",
                         "model.architecture=null")
        assert (code, err) == (2, f"entr-megatron {command}: invalid config: model.path {d}: {problem}\n")
    bare = write_model_dir(tmp_path / "bare", tokenizer=False)
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(run), f"model.path={bare}",
                     "model.architecture=null")
    assert (code, err) == (2, f"entr-megatron train: invalid config: model.path {bare}: has no tokenizer (none of "
                              "tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json); set "
                              "model.tokenizer to a directory that has one\n")
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(run), f"model.tokenizer={bare}")
    assert code == 2 and f"invalid config: model.tokenizer {bare}: has no tokenizer (none of" in err, err
    assert not run.exists()


def test_eval_refuses_a_truncated_model(tmp_path, capsys):
    d, problem = _truncated_model(tmp_path)
    code, err = _cli(capsys, "eval", "--config", str(DEMO), "--model", str(d))
    assert (code, err) == (2, f"entr-megatron eval: --model {d}: {problem}\n")


@pytest.mark.parametrize("n", ["-5", "0", "many"])
def test_eval_n_must_be_a_positive_count(capsys, n):
    from entr_megatron.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["eval", "--config", str(DEMO), "--n", n])
    err = capsys.readouterr().err
    shown = repr(n) if n == "many" else n
    assert e.value.code == 2 and err.endswith(f"error: argument --n: must be an integer >= 1, got {shown}"
                                              + ("" if n == "many" else " (leave --n out for task.eval_size)")
                                              + "\n"), err
    assert build_parser().parse_args(["eval", "--config", str(DEMO), "--n", "3"]).n == 3


def test_generate_and_score_refuse_a_truncated_model_before_starting(tmp_path):
    from entr_megatron.cli import generation, sequence_scoring
    from entr_megatron.cli.main import build_parser

    d, problem = _truncated_model(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2]}\n')
    io = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    args = build_parser().parse_args(["generate", "--model", str(d), *io])
    assert _message(generation.check_engine_flags, args) == f"--model {d}: {problem}"
    args = build_parser().parse_args(["score", "--model", str(d), *io])
    assert _message(sequence_scoring._run, args) == f"--model {d}: {problem}"
    (d / "config.json").write_text('{"model_type": "qwen2",')  # --sglang-url: only the config is read
    assert _message(generation._model_config, str(d)) == (
        f"--model {d}: {d / 'config.json'}:1:24: not valid JSON (Expecting property name enclosed in double quotes)")
    assert not (tmp_path / "out.jsonl").exists()


# --- 9: input lines that are not UTF-8 are located ------------------------------------------


def test_a_non_utf8_input_line_is_named_with_file_line_and_byte(tmp_path):
    from entr_megatron.cli.generation import LazyTokenizer, read_prompts
    from entr_megatron.cli.sequence_scoring import read_input

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\n\n{"input_ids": [3, 4], "note": "caf\xe9"}\n')
    expected = f"{path}:3: not UTF-8 text (byte 0xe9 at column 35); JSONL files are UTF-8"  # 0xe9 is byte 35
    assert _message(read_input, str(path), 128) == expected
    assert _message(read_prompts, str(path), 128, LazyTokenizer(None), None) == expected
    path.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\n')  # a byte-order mark is not an error
    assert [line.input_ids for line in read_input(str(path), 128)] == [[1, 2]]


# --- 10: launcher.ray_address: its form, then whether anything answers -----------------------


@pytest.mark.parametrize("address, rule", [
    ("head-node", "must be 'auto', 'local', 'HOST:PORT'"),
    ("http://head:8265", "is an HTTP address (the dashboard's or the job API's?)"),
    ("head:70000", "has port 70000, outside 1..65535"),
    ("grpc://head:10001", "has an unknown scheme"),
])
def test_a_malformed_ray_address_is_refused_naming_the_field(address, rule):
    msg = _message(load_config, DEMO, ["launcher.kind=ray", f"launcher.ray_address={address}"])
    assert msg.startswith(f"launcher.ray_address='{address}' is not valid; {rule}"), msg


@pytest.mark.parametrize("address", ["auto", "local", "10.0.0.1:6379", "ray://head.example:10001", "[::1]:6379"])
def test_the_forms_ray_takes_are_accepted(address):
    cfg = load_config(DEMO, ["launcher.kind=ray", f"launcher.ray_address='{address}'"])  # quoted: YAML reads [..] a list
    assert cfg.launcher.ray_address == address


def test_an_address_ray_cannot_join_is_one_error_naming_the_field(tmp_path, capsys, monkeypatch):
    """Something accepts TCP there, so the probe passes, but it is no Ray head (a proxy, another
    service): Ray's bare ConnectionError after its retries becomes one message naming the field
    and the valid forms, exit 2 (train), and names the spec's field in a study's Ray launcher."""
    import socket

    from entr_megatron.study.runner import _ray_submitter
    from entr_megatron.utils.ray_connect import RayConnectError

    joined = []

    def init(address=None, **kwargs):
        joined.append(address)
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False, init=init))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"),
                         "launcher.kind=ray", f"launcher.ray_address={address}")
    assert code == 2 and joined == [address], (code, err)
    assert (f"launcher.ray_address='{address}': Ray could not join a cluster there (Failed to connect to Ray "
            f"cluster at {address}). Is a Ray head running (ray start --head)") in err, err
    assert "Traceback" not in err
    msg = _message(_ray_submitter, None, "10.0.0.1:6379", error=RayConnectError)
    assert msg.startswith("base.launcher.ray_address='10.0.0.1:6379': Ray could not join a cluster there"), msg


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_nothing_answers_is_refused_in_seconds(tmp_path, capsys, monkeypatch):
    import socket
    import time

    from entr_megatron.config.launcher import check_ray_reachable

    port = _closed_port()
    started = time.monotonic()
    code, err = _cli(capsys, "train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"), "launcher.kind=ray",
                     f"launcher.ray_address=ray://127.0.0.1:{port}")
    assert time.monotonic() - started < 10  # Ray's own retries: about 30 s
    assert code == 2 and (f"launcher.ray_address='ray://127.0.0.1:{port}' is not valid; nothing accepts a connection "
                          f"at 127.0.0.1:{port} (Connection refused): is the Ray head running") in err, err
    assert not (tmp_path / "run").exists()
    with socket.socket() as server:  # a listening head passes
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # 'auto' probes what Ray would read
    assert _message(check_ray_reachable, "auto").startswith(
        f"launcher.ray_address='auto ($RAY_ADDRESS=127.0.0.1:{port})' is not valid; nothing accepts a connection")

    def silent(address, timeout):
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    assert "(no answer within 2 s)" in _message(check_ray_reachable, "10.0.0.1:6379")

"""RunConfig, the YAML loader and the example configs: validation happens before any process starts."""

import dataclasses
import pathlib

import pytest

from entr_megatron.config import (
    AlgorithmConfig,
    ControllerConfig,
    LauncherConfig,
    ParallelConfig,
    RunConfig,
    config_from_dict,
    dump_config,
    load_config,
    parse_value,
)

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
EXPECTED_EXAMPLES = {"cpu_demo.yaml", "qwen3_8b_dense.yaml", "qwen3_30b_a3b_moe.yaml"}


def test_defaults_are_valid():
    cfg = RunConfig()
    assert cfg == load_config(None)
    assert cfg.global_batch_size == cfg.rollout.prompts_per_step * cfg.rollout.sampling.n
    assert cfg.data_parallel_size == 1


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from entr_megatron.config import controller, launcher, model, rollout, run, task

    modules = (model, rollout, controller, task, launcher, run)  # the sections of a run, one module each
    tree = ast.Module(body=[n for m in modules for n in ast.parse(inspect.getsource(m)).body], type_ignores=[])
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                assert doc, f"{cls.name}.{node.target.id} has no docstring"


def test_examples_exist():
    assert EXPECTED_EXAMPLES <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_round_trips(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert config_from_dict(__import__("yaml").safe_load(dump_config(cfg))) == cfg


def test_cpu_demo_is_the_promised_run():
    cfg = load_config(pathlib.Path(EXAMPLES[0]).parent / "cpu_demo.yaml")
    assert cfg.controller.mode == "fully_async" and cfg.controller.max_policy_lag >= 4
    assert cfg.rollout.engine == "embedded" and cfg.launcher.device == "cpu"
    assert cfg.algorithm.correction == "entr" and cfg.task.name == "arithmetic" and cfg.sft is not None


def test_cluster_examples_use_sglang_and_ray():
    d = EXAMPLES[0].parent
    dense, moe = load_config(d / "qwen3_8b_dense.yaml"), load_config(d / "qwen3_30b_a3b_moe.yaml")
    for cfg in (dense, moe):
        assert cfg.rollout.engine == "sglang" and cfg.launcher.kind == "ray" and cfg.model.dtype == "bfloat16"
    assert moe.parallel.ep > 1 and moe.data_parallel_size * moe.parallel.tp == moe.launcher.world_size


def test_nested_overrides(tmp_path):
    cfg = load_config(
        None,
        [
            "controller.mode=sync",
            "algorithm.tau=0.3",
            "algorithm.icepop_band=[0.5, 3]",
            "rollout.sampling.temperature=0.8",
            "learner.optim.lr=1e-6",
            "learner.optim.use_distributed_optimizer=true",
            "sft.steps=7",
            "controller.max_policy_lag=64",
            "logging.run_dir=/tmp/x",
        ],
    )
    assert cfg.controller.mode == "sync" and cfg.controller.max_policy_lag == 64
    assert cfg.algorithm.tau == 0.3 and cfg.algorithm.icepop_band == (0.5, 3.0)
    assert cfg.rollout.sampling.temperature == 0.8
    assert cfg.learner.optim.lr == 1e-6 and isinstance(cfg.learner.optim.lr, float)
    assert cfg.learner.optim.use_distributed_optimizer is True
    assert cfg.sft is not None and cfg.sft.steps == 7
    assert load_config(None, ["sft=null"]).sft is None


def test_overrides_apply_on_top_of_the_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("controller:\n  mode: sync\n  train_steps: 3\nalgorithm:\n  tau: 0.2\n")
    cfg = load_config(f, ["controller.train_steps=5"])
    assert (cfg.controller.mode, cfg.controller.train_steps, cfg.algorithm.tau) == ("sync", 5, 0.2)


def test_parse_value_uses_yaml_scalars():
    assert parse_value("true") is True and parse_value("null") is None
    assert parse_value("1e-6") == 1e-6 and parse_value("3") == 3 and parse_value("[1, 2]") == [1, 2]
    assert parse_value("fully_async") == "fully_async"


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("rollout.sampling.temprature=0.8", "temprature", "temperature"),
        ("algorithm.tua=0.3", "tua", "tau"),
        ("learner.optim.learning_rate=1", "learning_rate", None),
        ("controler.mode=sync", "controler", "controller"),
    ],
)
def test_unknown_override_key_names_the_key_and_suggests(override, key, suggestion):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert repr(key) in msg and "Valid keys:" in msg
    if suggestion:
        assert f"did you mean {suggestion!r}" in msg


def test_unknown_file_key_names_the_key_and_suggests(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  sampling:\n    max_new_token: 16\n")
    expected = r"'max_new_token' at 'rollout.sampling'.*did you mean 'max_new_tokens'.*Valid keys"
    with pytest.raises(ValueError, match=expected):
        load_config(f)


@pytest.mark.parametrize(
    "override, field, allowed",
    [
        ("controller.mode=async", "controller.mode='async'", "sync, one_step_off, fully_async"),
        ("controller.stale_policy=keep", "controller.stale_policy", "drop, regenerate"),
        ("rollout.engine=vllm", "rollout.engine='vllm'", "embedded, sglang"),
        ("rollout.weight_snapshot=steal", "rollout.weight_snapshot='steal'", "borrow, copy"),
        ("rollout.placement=shared", "rollout.placement='shared'", "separate, colocated"),
        ("rollout.embedded.device=gpu", "rollout.embedded.device='gpu'", "cpu, cuda"),
        ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p=1.5", "(0, 1]"),
        ("rollout.sampling.n=1", "rollout.sampling.n=1", "in [2, 1024]"),
        ("rollout.sampling.n=5000", "rollout.sampling.n=5000", "in [2, 1024]"),
        ("rollout.prompts_per_step=100000000", "rollout.prompts_per_step=100000000", "in [1, 65536]"),
        ("rollout.sampling.max_new_tokens=1000000000", "rollout.sampling.max_new_tokens", "in [1, 1048576]"),
        ("rollout.num_engines=100000", "rollout.num_engines=100000", "in [1, 4096]"),
        ("task.eval_size=1000000000", "task.eval_size=1000000000", "in [0, 100000]"),
        ("sft.batch_size=1000000000", "sft.batch_size=1000000000", "in [1, 65536]"),
        ("model.max_seq_len=1000000000", "model.max_seq_len=1000000000", "in [2, 1048576]"),
        ("controller.max_policy_lag=-1", "controller.max_policy_lag=-1", "integer in [0, 1024]"),
        ("algorithm.correction=entrr", "algorithm.correction='entrr'", "entr_calibrated"),
        ("algorithm.tau=0", "algorithm.tau=0", "(0.0, inf]"),
        ("learner.optim.lr_decay_style=step", "learner.optim.lr_decay_style='step'", "cosine"),
        ("learner.max_tokens_per_microbatch=0", "learner.max_tokens_per_microbatch=0", ">= 1"),
        ("learner.fused_output_backend=cuda", "learner.fused_output_backend='cuda'", "auto, torch, triton"),
        ("task.name=chess", "task.name='chess'", "arithmetic, math, calculator, search"),
        ("task.search.hops=4", "task.search.hops=4", "[2, 3]"),
        ("rollout.agent.tool_timeout_s=.inf", "rollout.agent.tool_timeout_s", "finite"),
        ("launcher.kind=slurm", "launcher.kind='slurm'", "local, ray"),
        ("logging.tensorboard=yes please", "logging.tensorboard", "true or false"),
        ("parallel.tp=0", "parallel.tp=0", ">= 1"),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(override, field, allowed):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert field in msg and allowed in msg, msg


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["controller.mode=fully_async", "controller.max_policy_lag=0"], "controller.max_policy_lag"),
        (["controller.mode=one_step_off", "controller.max_policy_lag=0"], "controller.max_policy_lag"),
        (["parallel.tp=2"], "parallel.tp"),  # 2 does not divide a 1-rank learner
        (["launcher.nproc_per_node=4", "parallel.tp=2", "parallel.dp=4"], "parallel.dp"),
        (["launcher.nproc_per_node=4", "parallel.ep=8"], "parallel.ep"),
        (["launcher.nproc_per_node=4", "parallel.tp=2", "parallel.ep=2"], "parallel.sequence_parallel"),
        (["parallel.vpp=2"], "parallel.vpp"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
        (["rollout.engine=sglang", "rollout.sglang.tp_size=2"], "rollout.sglang.tp_size"),  # a CPU server is one process
        (["rollout.dtype=auto"], "rollout.dtype"),  # embedded has no 'auto'
        # colocated SGLang servers read rank 0's shared memory: on its host only
        (["rollout.engine=sglang", "rollout.dtype=auto", "rollout.placement=colocated", "launcher.kind=ray"],
         "rollout.placement"),
        (["rollout.engine=sglang", "rollout.dtype=auto", "rollout.placement=colocated",
          "rollout.sglang.urls=[http://10.0.0.5:30000]"], "rollout.placement"),
        (["rollout.sampling.max_new_tokens=2000"], "model.max_seq_len"),
        (["model.path=/m", "model.architecture={model_type: llama}"], "model.architecture"),
        (["task.name=math"], "task.math.train_files"),
        (["task.math.train_files=[a.csv]"], "task.math.train_files"),
        (["launcher.ray_address=auto"], "launcher.ray_address"),
        (["model.path=null", "model.architecture=null"], "model.path"),
        # 8 prompts x 8 samples = 64 sequences: at most 64 mini-batches of one sequence per DP rank
        (["learner.mini_batches=65"], "learner.mini_batches"),
        (["algorithm.correction=tis", "algorithm.correction_mode=mask_only"], "correction_mode"),
        (["algorithm.loss_norm_tokens=0"], "loss_norm_tokens"),
    ],
)
def test_cross_field_rules(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_sglang_servers_on_the_learner_s_host_may_be_colocated():
    sglang = ["rollout.engine=sglang", "rollout.dtype=auto", "rollout.placement=colocated"]
    assert load_config(None, sglang).rollout.placement == "colocated"  # servers `train` launches here
    for url in ("http://127.0.0.1:30000", "http://localhost:30000", "http://[::1]:30000"):
        assert load_config(None, sglang + [f"rollout.sglang.urls=['{url}']"]).rollout.sglang.urls == (url,)
    with pytest.raises(ValueError, match=r"rollout\.placement.*'http://sglang-0:30000'.*use 'separate'"):
        load_config(None, sglang + ["rollout.sglang.urls=[http://sglang-0:30000]"])


def test_an_engine_on_the_gpu_is_colocated_with_a_local_cuda_learner():
    gpu = ["launcher.device=cuda", "launcher.gpus_per_node=2", "rollout.embedded.device=cuda"]
    for overrides, field, want in [
        (["rollout.embedded.device=cuda"], "launcher.device='cpu'", "'cuda'"),
        (gpu, "rollout.placement='separate'", "'colocated'"),
        (gpu + ["rollout.placement=colocated", "launcher.kind=ray"], "launcher.kind='ray'", "'local'"),
    ]:
        with pytest.raises(ValueError) as info:
            load_config(None, overrides)
        msg = str(info.value)
        assert field in msg and f"must be {want}" in msg and "rollout.embedded.device='cuda'" in msg, msg
    cfg = load_config(None, gpu + ["rollout.placement=colocated", "rollout.num_engines=3"])
    from entr_megatron.controller.job.wiring import _embedded_config, engine_device

    assert [engine_device(cfg, i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]  # i mod gpus_per_node
    engine = _embedded_config(cfg, "/m", 1)
    assert engine.device == "cuda:1" and engine.free_cache_engine
    cpu = load_config(None, ["rollout.embedded.free_cache_engine=false"])
    assert engine_device(cpu, 1) == "cpu" and not _embedded_config(cpu, "/m", 1).free_cache_engine


def test_sglang_gpu_budget_is_checked():
    base = [
        "rollout.engine=sglang", "rollout.dtype=bfloat16", "launcher.device=cuda", "launcher.gpus_per_node=8",
        "launcher.nproc_per_node=8",
    ]
    with pytest.raises(ValueError, match=r"rollout\.num_engines=2 .*need 10 GPUs.* = 8"):
        load_config(None, base + ["rollout.num_engines=2"])
    cfg = load_config(None, base + ["rollout.num_engines=2", "launcher.engine_nodes=1"])
    assert cfg.rollout.gpus_needed == 2


def test_parallel_dp_derived_and_checked():
    cfg = RunConfig(launcher=LauncherConfig(nproc_per_node=8), parallel=ParallelConfig(tp=2, pp=2))
    assert cfg.data_parallel_size == 2
    RunConfig(launcher=LauncherConfig(nproc_per_node=8), parallel=ParallelConfig(tp=2, pp=2, dp=2))


def test_lag_up_to_64_is_allowed_and_sync_may_use_zero():
    assert ControllerConfig(max_policy_lag=64).max_policy_lag == 64
    assert ControllerConfig(mode="sync", max_policy_lag=0).max_policy_lag == 0


def test_sections_are_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.controller.mode = "sync"


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("controller:\n  mode: sync\n  train_steps: [1, 2\nalgorithm:\n  tau: 0.3\n")
    with pytest.raises(ValueError, match=r"broken\.yaml:\d+:\d+: YAML syntax error"):
        load_config(f)


def test_duplicate_keys_and_non_mapping_files_are_refused(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("controller:\n  mode: sync\n  mode: fully_async\n")
    with pytest.raises(ValueError, match=r"dup\.yaml:3:.*duplicate key 'mode'"):
        load_config(f)
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_config(f)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(ValueError, match="key.path=value"):
        load_config(None, ["controller.mode"])
    with pytest.raises(ValueError, match="controller.mode is a value, not a section"):
        load_config(None, ["controller.mode.x=1"])


def test_value_errors_name_the_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("algorithm:\n  tau: -1\n")
    with pytest.raises(ValueError, match=r"algorithm\.tau=-1.*run\.yaml"):
        load_config(f)


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(
        None,
        ["sft.lr=1e-4", "algorithm.eps_clip_high=0.3", "rollout.sglang.extra_args=['1e-6', '--x']",
         "model.tokenizer='1e-6'", "controller.mode=one_step_off", "algorithm.mis_seq_band=[0.25, 4]"],
    )
    f = tmp_path / "dumped.yaml"
    f.write_text(dump_config(cfg))
    again = load_config(f)
    assert again == cfg
    assert again.model.tokenizer == "1e-6" and again.rollout.sglang.extra_args == ("1e-6", "--x")
    assert dump_config(again) == dump_config(cfg)


def test_model_path_or_architecture():
    assert load_config(None, ["model.path=/models/qwen3"]).model.architecture is None
    cfg = load_config(None, ["model.architecture.num_hidden_layers=2"])
    assert cfg.model.architecture["num_hidden_layers"] == 2 and cfg.model.architecture["model_type"] == "qwen3"


def test_python_construction_uses_the_reused_sections():
    cfg = RunConfig(algorithm=AlgorithmConfig(correction="icepop"))
    assert cfg.algorithm.correction == "icepop"
    assert load_config(None, ["algorithm.correction=icepop"]) == cfg


def test_dr_grpo_constant_is_the_generation_budget_unless_set():
    cfg = load_config(None, ["rollout.sampling.max_new_tokens=24"])
    assert cfg.algorithm.loss_norm_tokens == 24
    assert load_config(None, ["algorithm.loss_norm_tokens=100"]).algorithm.loss_norm_tokens == 100
    assert RunConfig().algorithm.loss_norm_tokens == RunConfig().rollout.sampling.max_new_tokens


def test_mini_batches_and_epochs():
    cfg = load_config(None, ["learner.mini_batches=4", "learner.epochs=2"])
    assert cfg.learner.steps_per_batch == 8
    with pytest.raises(ValueError, match=r"learner\.epochs=0"):
        load_config(None, ["learner.epochs=0"])


def test_global_batch_size_is_derived_not_a_second_field():
    # It restated rollout.prompts_per_step * rollout.sampling.n; a config that still sets it is told so.
    cfg = load_config(None, ["rollout.prompts_per_step=3", "rollout.sampling.n=5"])
    assert cfg.global_batch_size == 15
    with pytest.raises(ValueError, match=r"unknown key 'global_batch_size' at 'controller'"):
        load_config(None, ["controller.global_batch_size=15"])


def test_learner_temperature_is_the_sampling_temperature_not_a_second_field():
    # The learner takes log-probs at rollout.sampling.temperature (LearnerWorker passes it).
    with pytest.raises(ValueError, match=r"unknown key 'temperature' at 'learner'"):
        load_config(None, ["learner.temperature=0.5"])


def test_learner_precision_is_the_models_dtype_not_a_second_field():
    # It restated model.dtype in Megatron's names; a config that still sets it is told so.
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"unknown key 'precision' at 'learner'"):
        load_config(None, ["learner.precision=bf16"])

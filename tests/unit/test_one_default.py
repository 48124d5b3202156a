"""One default per fact: a default tau, a bucket size, a timeout is defined once and every place
that offers it agrees (docs/CONTRIBUTING.md); a check a job makes runs once per job."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import pathlib

import pytest

from entr_megatron.config import AlgorithmConfig
from entr_megatron.config.rollout import EmbeddedConfig, RolloutConfig
from entr_megatron.config.validate import FieldError

PKG = pathlib.Path(__file__).resolve().parents[2] / "entr_megatron"
DEMO = PKG.parent / "examples" / "cpu_demo.yaml"


@functools.cache
def _trees() -> tuple[tuple[pathlib.Path, ast.Module], ...]:
    """(path below the package, syntax tree) of every module of the package (parsed once)."""
    return tuple((p.relative_to(PKG), ast.parse(p.read_text(), filename=str(p))) for p in sorted(PKG.rglob("*.py")))


def _cli_defaults(dest: str) -> dict[str, object]:
    """{"<command> --flag": default} of every option of the `entr-megatron` parser storing to `dest`."""
    from entr_megatron.cli.main import build_parser

    found = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
            elif action.dest == dest:
                found[f"{prefix} {action.option_strings[0]}"] = action.default

    walk(build_parser(), "")
    return found


def test_every_tau_default_is_the_configs():
    assert AlgorithmConfig().tau == 1.0  # the calibrated value (docs/studies/tau)
    flags = _cli_defaults("tau")
    assert set(flags) == {"score --tau", "demo --tau"}, flags  # a new flag is checked here too
    assert flags == {name: AlgorithmConfig().tau for name in flags}
    from entr_megatron.algorithm import ENTR_DEFAULT_EPS, ENTR_DEFAULT_TAU

    assert (ENTR_DEFAULT_TAU, ENTR_DEFAULT_EPS) == (AlgorithmConfig().tau, AlgorithmConfig().entr_eps) == (1.0, 0.01)
    # No function takes a tau (or an ENTR eps) with a number of its own as its default.
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args[len(node.args.args) - len(node.args.defaults):] + node.args.kwonlyargs
                defaults = node.args.defaults + node.args.kw_defaults
                for arg, default in zip(args, defaults):
                    if arg.arg in ("tau", "entr_eps") and isinstance(default, ast.Constant):
                        pytest.fail(f"{rel}:{node.lineno} {node.name}({arg.arg}={default.value!r}): import the config's default")


def test_the_weight_bucket_default_is_defined_once():
    from entr_megatron.rollout.sglang import SGLangEngineConfig
    from entr_megatron.weight_sync.sync import WeightSyncConfig

    mib = 512 << 20
    sglang = RolloutConfig(engine="sglang", dtype="auto")
    assert RolloutConfig().weight_bucket_bytes == sglang.weight_bucket_bytes == mib
    assert RolloutConfig(weight_bucket_mib=3).weight_bucket_bytes == 3 << 20
    assert WeightSyncConfig().bucket_bytes == mib
    assert SGLangEngineConfig(urls=("http://127.0.0.1:1",)).weight_bucket_bytes == mib
    assert SGLangEngineConfig.from_config(sglang, ["http://127.0.0.1:1"]).weight_bucket_bytes == mib
    # No `512 << 20` (or `... or 512`) literal of its own anywhere in the package.
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift):
                assert ast.unparse(node) != "512 << 20", f"{rel}:{node.lineno}: use DEFAULT_WEIGHT_BUCKET_MIB"
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
                assert not any(isinstance(v, ast.Constant) and v.value == 512 for v in node.values), \
                    f"{rel}:{node.lineno}: use RolloutConfig.weight_bucket_bytes"


@pytest.mark.parametrize("name", ["ABANDON_TIMEOUT_S", "ENTR_DEFAULT_TAU", "DEFAULT_WEIGHT_BUCKET_MIB",
                                  "PROGRESS_EVERY_S", "SINGLE_FILE", "INDEX_FILE", "HF_CONFIG_FILE"])
def test_a_named_default_is_assigned_in_one_module(name):
    where = [str(rel) for rel, tree in _trees() for node in tree.body
             if isinstance(node, (ast.Assign, ast.AnnAssign))
             and name in [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                          if isinstance(t, ast.Name)]]
    assert len(where) == 1, where


def test_the_abandon_timeout_is_one_value():
    from entr_megatron.controller.job import wiring
    from entr_megatron.controller.ranks import remote
    from entr_megatron.controller.rl import interfaces, loop

    assert interfaces.ABANDON_TIMEOUT_S == 30.0
    assert loop.ABANDON_TIMEOUT_S is remote.ABANDON_TIMEOUT_S is wiring.ABANDON_TIMEOUT_S is interfaces.ABANDON_TIMEOUT_S


def test_records_routes_is_the_run_configs():
    from entr_megatron.config.loader import load_config

    assert not load_config(None).records_routes
    assert load_config(None, ["rollout.record_routes=true"]).records_routes
    assert load_config(None, ["algorithm.routing_replay=r3"]).records_routes  # R3 replays them
    assert not load_config(None, ["algorithm.routing_replay=r2"]).records_routes  # R2 replays the learner's own
    defined = [str(rel) for rel, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef) and node.name == "records_routes"]
    assert defined == ["config/run.py"], defined


def test_the_embedded_engine_takes_the_sections_defaults_and_validator():
    from entr_megatron.rollout.embedded_protocol import EmbeddedEngineConfig

    section = {f.name: f.default for f in dataclasses.fields(EmbeddedConfig)}
    engine = {f.name: f.default for f in dataclasses.fields(EmbeddedEngineConfig)}
    shared = section.keys() & engine.keys()
    assert shared == {"max_batch_size", "max_prefill_tokens", "num_threads", "device", "free_cache_engine"}
    assert {k: engine[k] for k in shared} == {k: section[k] for k in shared} == {
        "max_batch_size": 32, "max_prefill_tokens": 8192, "num_threads": None, "device": "cpu",
        "free_cache_engine": True}
    # One validator: the same rule, each naming its own field.
    for kwargs, rule in [({"max_batch_size": 0}, "must be an integer >= 1"),
                         ({"max_prefill_tokens": -3}, "must be an integer >= 1"),
                         ({"num_threads": 0}, "must be null or an integer >= 1")]:
        [(name, value)] = kwargs.items()
        with pytest.raises(FieldError) as e:
            EmbeddedEngineConfig(model_dir="m", **kwargs)
        assert str(e.value) == f"EmbeddedEngineConfig.{name}={value!r} is not valid; {rule}"
        with pytest.raises(FieldError) as e:
            EmbeddedConfig(**kwargs)
        assert str(e.value) == f"rollout.embedded.{name}={value!r} is not valid; {rule}"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv", [["train", "--max-steps", "1"], ["sft"]])
def test_train_checks_its_inputs_once(monkeypatch, tmp_path, argv):
    from entr_megatron.cli.main import main
    from entr_megatron.controller.job import run as job

    calls = []
    monkeypatch.setattr(job, "check_inputs", lambda cfg, command="train": calls.append(command))

    def stop(cfg):
        raise _Stop  # the job got past its checks: nothing more is needed here

    monkeypatch.setattr(job, "tokenizer_for", stop)
    with pytest.raises(_Stop):
        main([argv[0], "--config", str(DEMO), "--run-dir", str(tmp_path / "run"), *argv[1:]])
    assert calls == [argv[0]]


def test_the_planner_takes_the_run_configs_defaults_modes_lag_rule_and_inflight_target():
    """study/workload.py and study/simulation.py restate no fact of the run config: the defaults of
    prompts_per_step, n and max_policy_lag, the modes, which modes need a lag >= 1, and the
    fully_async in-flight target all come from config/ (one source each)."""
    from entr_megatron.config.controller import (
        CONTROLLER_MODES, LAGGED_MODES, ControllerConfig, fully_async_inflight_target,
    )
    from entr_megatron.config.rollout import SamplingConfig
    from entr_megatron.study.workload import MODES, Workload

    w, rollout = Workload(), RolloutConfig()
    assert (w.prompts_per_step, w.n, w.max_policy_lag) == (
        rollout.prompts_per_step, SamplingConfig().n, ControllerConfig().max_policy_lag)
    assert MODES is CONTROLLER_MODES
    for mode in CONTROLLER_MODES:  # the planner refuses a lag of 0 exactly where train does
        train_refuses = _refuses(lambda: ControllerConfig(mode=mode, max_policy_lag=0))
        assert train_refuses == _refuses(lambda: Workload(max_policy_lag=0).check_mode(mode)) == (mode in LAGGED_MODES)
    # the target by hand: 2 x P by default, capped by what the bound lets the learner consume
    assert fully_async_inflight_target(8, 4, None, 0) == 16
    assert fully_async_inflight_target(8, 1, None, 4) == 12 and fully_async_inflight_target(8, 0, 64, 8) == 0
    # nobody else writes the formula: its `max_inflight_groups or ...` default lives in one function
    writers = [f"{rel}:{node.lineno}" for rel, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.BoolOp) and "max_inflight_groups" in ast.unparse(node)]
    assert writers == [w for w in writers if w.startswith("config/controller.py")] and len(writers) == 1, writers


def _refuses(build) -> bool:
    try:
        build()
    except ValueError:
        return True
    return False

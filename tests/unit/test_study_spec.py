"""Study specs: the cells a grid expands to, every error naming the spec field before anything
runs, and the runner refusing a cell whose config changed since it ran."""

from __future__ import annotations

import json

import pytest
import yaml

from entr_megatron.study.runner import _place
from entr_megatron.study.spec import SpecError, load_spec

BASE = {"controller": {"mode": "fixed_lag", "train_steps": 3}, "rollout": {"sampling": {"max_new_tokens": 8}},
        "sft": {"steps": 5}}


def write(tmp_path, spec: dict, base: dict = BASE):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", **spec}))
    return path


def test_grid_product_union_and_seeds(tmp_path):
    spec = load_spec(write(tmp_path, {
        "name": "s", "overrides": {"rollout.dtype": "bfloat16"},
        "grid": [{"algorithm.correction": ["none", "entr"], "controller.inter_lag": [0, 4]},
                 {"algorithm.correction": ["none"], "controller.inter_lag": [4], "controller.intra_lag": [2]}],
        "seeds": [0, 1]}))
    cells = spec.cells()
    assert len(cells) == 2 * 2 * 2 + 2
    assert spec.axes == ["algorithm.correction", "controller.inter_lag", "controller.intra_lag", "controller.seed"]
    ids = [c.id for c in cells]
    assert "correction=entr,inter_lag=4,seed=1" in ids and "correction=none,inter_lag=4,intra_lag=2,seed=0" in ids
    cell = next(c for c in cells if c.id == "correction=entr,inter_lag=4,seed=1")
    assert cell.config.algorithm.correction == "entr" and cell.config.controller.inter_lag == 4
    assert cell.config.controller.seed == 1 and cell.config.rollout.dtype == "bfloat16"
    assert len({c.config_hash() for c in cells}) == len(cells)
    assert cell.config_hash() == load_spec(spec.path).cells()[ids.index(cell.id)].config_hash()


def test_only_selects_cells_by_axis_values(tmp_path):
    spec = load_spec(write(tmp_path, {"grid": {"algorithm.correction": ["none", "entr"], "controller.inter_lag": [0, 4, 16]},
                                      "seeds": [0, 1]}))
    cells = spec.cells()
    picked = spec.select(cells, ["seed=1", "controller.inter_lag=0,16"])
    assert [c.id for c in picked] == ["correction=none,inter_lag=0,seed=1", "correction=none,inter_lag=16,seed=1",
                                      "correction=entr,inter_lag=0,seed=1", "correction=entr,inter_lag=16,seed=1"]
    assert spec.select(cells, []) == cells
    with pytest.raises(SpecError, match=r"inter_lag has no value \['8'\]"):
        spec.select(cells, ["inter_lag=8"])
    with pytest.raises(SpecError, match="AXIS one of"):
        spec.select(cells, ["tau=1"])
    with pytest.raises(SpecError, match="AXIS one of"):
        spec.select(cells, ["seed"])


def test_warmup_model_replaces_the_cells_own_sft(tmp_path):
    spec = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5, 1.0]}, "warmup": {"overrides": {"sft.steps": 7}}}))
    assert spec.warmup_config()["sft"]["steps"] == 7
    [a, _] = spec.cells(warmup_model=tmp_path / "warm")
    assert a.config.sft is None and a.config.model.path == str(tmp_path / "warm")


def test_per_seed_warmups_seed_their_sft_and_each_seed_starts_from_its_own(tmp_path):
    spec = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5, 1.0]}, "seeds": [3, 5],
                                      "warmup": {"per_seed": True, "overrides": {"sft.steps": 7}}}))
    assert spec.per_seed_warmup
    assert [spec.warmup_config(s)["controller"]["seed"] for s in (3, 5)] == [3, 5]
    assert spec.warmup_config()["controller"]["seed"] == 3 and spec.warmup_config(5)["sft"]["steps"] == 7
    cells = spec.cells(warmup_model={3: tmp_path / "w3", 5: tmp_path / "w5"})
    assert {(c.config.controller.seed, c.config.model.path) for c in cells} == {
        (3, str(tmp_path / "w3")), (5, str(tmp_path / "w5"))}
    assert all(c.config.sft is None for c in cells)
    with pytest.raises(SpecError, match="warmup.per_seed"):
        load_spec(write(tmp_path, {"warmup": {"per_seed": "yes"}}))
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "config.json").write_text("{}")
    with pytest.raises(SpecError, match="warmup.model"):
        load_spec(write(tmp_path, {"warmup": {"model": "done", "per_seed": True}}))


@pytest.mark.parametrize("spec, field", [
    ({"grid": {"algorithm.corection": ["entr"]}}, "grid.algorithm.corection"),
    ({"grid": {"algorithm.correction": ["entr", "nonsense"]}}, "algorithm.correction"),
    ({"grid": {"algorithm.tau": []}}, "grid.algorithm.tau"),
    ({"grid": {"algorithm.tau": [1, 1]}}, "grid.algorithm.tau"),
    ({"grid": {"controller.seed": [1]}}, "grid.controller.seed"),
    ({"overrides": {"controller.inter_lag": -1}}, "controller.inter_lag"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"seeds": "0"}, "seeds"),
    ({"report": {"method": "algorithm.tau"}}, "report.method"),
    ({"report": {"colour": "red"}}, "report"),
    ({"resources": {"num_cpus": -1}}, "resources.num_cpus"),
    ({"grdi": {}}, "unknown key"),
    ({"name": "a b"}, "name"),
    ({"base": "missing.yaml"}, "base"),
])
def test_spec_errors_name_the_field(tmp_path, spec, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        load_spec(write(tmp_path, spec))


def test_warmup_needs_an_sft_section(tmp_path):
    with pytest.raises(SpecError, match="warmup"):
        load_spec(write(tmp_path, {"warmup": {}}, base={"controller": {"train_steps": 2}}))


def test_a_cell_whose_config_changed_is_refused(tmp_path):
    out = tmp_path / "out"
    [cell] = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5]}})).cells()
    cell_dir, done = _place(cell, out)
    assert not done and json.loads((cell_dir / "cell.json").read_text())["config_hash"] == cell.config_hash()
    status = json.loads((cell_dir / "status.json").read_text())
    (cell_dir / "status.json").write_text(json.dumps({**status, "state": "done"}))
    assert _place(cell, out) == (cell_dir, True)
    [changed] = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5]}, "overrides": {"algorithm.entr_eps": 0.02}})).cells()
    assert changed.id == cell.id
    default_eps = cell.config.algorithm.entr_eps
    with pytest.raises(SpecError, match=rf"another config \(algorithm.entr_eps: {default_eps!r} -> 0.02\)"):
        _place(changed, out)


def test_a_cell_recorded_before_config_fields_were_added_is_kept(tmp_path):
    out = tmp_path / "out"
    [cell] = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5]}})).cells()
    cell_dir, _ = _place(cell, out)
    (cell_dir / "status.json").write_text(json.dumps({"state": "done"}))
    record = json.loads((cell_dir / "cell.json").read_text())
    # recorded when the config had no field rollout.sglang.host: a new field at its default does not count
    fields = {k: v for k, v in record["config"].items() if k != "rollout.sglang.host"}
    (cell_dir / "cell.json").write_text(json.dumps({**record, "config_hash": "older", "config": fields}))
    upgraded = []
    assert _place(cell, out, upgraded) == (cell_dir, True) and upgraded == [cell.id]
    assert json.loads((cell_dir / "cell.json").read_text())["config_hash"] == cell.config_hash()
    # a runner that kept only the hash: judged by the cell's raw config
    (cell_dir / "cell.json").write_text(json.dumps({"id": cell.id, "axes": cell.axes, "config_hash": "older"}))
    assert _place(cell, out) == (cell_dir, True)
    (cell_dir / "cell.json").write_text(json.dumps({"id": cell.id, "axes": cell.axes, "config_hash": "older"}))
    [changed] = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5]}, "overrides": {"algorithm.entr_eps": 0.02}})).cells()
    with pytest.raises(SpecError, match="another config .the spec or its base changed"):
        _place(changed, out)


def test_warmup_model_reuses_a_finished_warm_up(tmp_path):
    model = tmp_path / "done" / "sft" / "model"
    with pytest.raises(SpecError, match="warmup.model"):
        load_spec(write(tmp_path, {"warmup": {"model": "done/sft/model"}}))
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    spec = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5]}, "warmup": {"model": "done/sft/model"}}))
    assert spec.warmup_config() is None and spec.warmup["model"] == model.resolve()


def test_warmup_model_with_seed_gives_each_seed_its_own_finished_warm_up(tmp_path):
    from entr_megatron.study.runner import _prepare

    for seed in (3, 5):
        (tmp_path / f"w{seed}" / "sft" / "model").mkdir(parents=True)
        (tmp_path / f"w{seed}" / "sft" / "model" / "config.json").write_text("{}")
    raw = {"grid": {"algorithm.tau": [0.5]}, "seeds": [3, 5, 7], "warmup": {"model": "w{seed}/sft/model"}}
    with pytest.raises(SpecError, match=r"warmup.model: .*w7/sft/model'\] have no config.json"):
        _prepare(load_spec(write(tmp_path, raw)), tmp_path / "study")      # checked when it runs
    spec = load_spec(write(tmp_path, {**raw, "seeds": [3, 5]}))
    models = _prepare(spec, tmp_path / "study")
    assert models == {3: (tmp_path / "w3/sft/model").resolve(), 5: (tmp_path / "w5/sft/model").resolve()}
    paths = {c.axes["controller.seed"]: c.config.model.path for c in spec.cells(warmup_model=models)}
    assert paths == {3: str(models[3]), 5: str(models[5])}


def test_only_checks_the_warm_ups_of_the_seeds_it_runs(tmp_path, monkeypatch):
    """`--only seed=3` runs seed 3's cells while seed 7's warm-up is still being built; without the
    filter, or with seed 7 in it, the missing warm-up is refused before any cell runs."""
    from entr_megatron.study import runner

    (tmp_path / "w3" / "sft" / "model").mkdir(parents=True)
    (tmp_path / "w3" / "sft" / "model" / "config.json").write_text("{}")
    spec = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5]}, "seeds": [3, 7],
                                      "warmup": {"model": "w{seed}/sft/model"}}))
    ran = []
    monkeypatch.setattr(runner, "_cell_attempt", lambda d: ran.append(d) or {"returncode": 0, "wall_s": 0.1})
    result = runner.run_study(spec, tmp_path / "out", only=["seed=3"])
    assert result["done"] == ["tau=0.5,seed=3"] and len(ran) == 1
    for only in (None, ["seed=3,7"]):
        with pytest.raises(SpecError, match=r"w7/sft/model'\] have no config.json"):
            runner.run_study(spec, tmp_path / "out", only=only)
    assert len(ran) == 1


def test_sigterm_starts_no_more_cells_and_a_failure_does_not_stop_the_others(tmp_path, monkeypatch):
    """The runner without processes: each cell attempt is replaced by a function; the first fails,
    the second gets the study a SIGTERM (a preemption) while it runs; no later cell starts."""
    import os
    import signal

    from entr_megatron.study import runner

    spec = load_spec(write(tmp_path, {"grid": {"algorithm.tau": [0.5, 1.0, 2.0, 4.0]}}))
    calls = []

    def attempt(cell_dir):
        calls.append(cell_dir)
        if len(calls) == 1:
            return {"returncode": 2, "wall_s": 0.1, "error": "exit 2: boom"}
        os.kill(os.getpid(), signal.SIGTERM)
        return {"returncode": 0, "wall_s": 0.2, "result": {"stopped": False}}

    monkeypatch.setattr(runner, "_cell_attempt", attempt)
    result = runner.run_study(spec, tmp_path / "out", jobs=1)
    assert len(calls) == 2 and result["interrupted"] and result["signal"] == signal.SIGTERM
    states = {json.loads((d / "status.json").read_text())["state"] for d in (tmp_path / "out" / "cells").iterdir()}
    assert len(result["failed"]) == 1 and len(result["done"]) == 1 and states == {"failed", "done", "pending"}
    assert signal.getsignal(signal.SIGTERM) is not runner.StopRequest._handle  # handlers restored
    rerun_calls = []
    monkeypatch.setattr(runner, "_cell_attempt", lambda d: rerun_calls.append(d) or {"returncode": 0, "wall_s": 0.1})
    again = runner.run_study(spec, tmp_path / "out", jobs=2)
    assert len(again["skipped"]) == 1 and len(rerun_calls) == 3 and not again["interrupted"]  # the failed one retried


def test_the_shipped_moe_replay_study_grids_over_routing_replay():
    """examples/studies/moe_replay.yaml: routing replay is a grid axis like any field; every
    cell is a valid MoE run (EP=2), R3 cells record and replay routes and measure without."""
    from pathlib import Path

    spec = load_spec(Path(__file__).parents[2] / "examples" / "studies" / "moe_replay.yaml")
    cells = {c.id: c.config for c in spec.cells()}
    assert sorted(cells) == ["routing_replay=off,inter_lag=0,seed=0", "routing_replay=off,inter_lag=4,seed=0",
                             "routing_replay=r3,inter_lag=0,seed=0", "routing_replay=r3,inter_lag=4,seed=0"]
    for cell_id, cfg in cells.items():
        assert cfg.parallel.ep == 2 and cfg.model.architecture["model_type"] == "qwen3_moe"
        assert cfg.algorithm.routing_replay == ("r3" if "r3" in cell_id else "off")
        assert cfg.algorithm.measure_unreplayed and cfg.controller.mode == "fixed_lag"
        assert cfg.controller.inter_lag == (4 if "inter_lag=4" in cell_id else 0)


def test_cells_run_with_openmp_threads_that_sleep_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    """run_command gives each cell OMP_WAIT_POLICY=PASSIVE where unset, and keeps a value the user set."""
    import subprocess

    from entr_megatron.study import runner

    seen = []

    class Proc:
        stdout = iter(["{}\n"])

        def __init__(self, args, env=None, **kw):
            seen.append(env)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("ENTR_TEST_MARKER", "1")
    assert runner.run_command(["train"], str(tmp_path / "a.log")) == (0, "{}")
    assert seen[-1]["OMP_WAIT_POLICY"] == "PASSIVE" and seen[-1]["ENTR_TEST_MARKER"] == "1"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    runner.run_command(["train"], str(tmp_path / "b.log"))
    assert seen[-1]["OMP_WAIT_POLICY"] == "ACTIVE"


def test_methods_are_named_bundles_of_overrides_gridded_as_the_method_axis(tmp_path):
    methods = {"dppo": {"algorithm.correction": "none", "algorithm.policy_loss": "dppo_tv"},
               "naive_entr": {"algorithm.correction": "naive", "algorithm.add_entr_mask": True},
               "entr": {"algorithm.correction": "entr"}}
    spec = load_spec(write(tmp_path, {"methods": methods, "grid": {"method": ["dppo", "naive_entr", "entr"],
                                                                   "controller.inter_lag": [0, 4]},
                                      "report": {"method": "method", "lag": "controller.inter_lag"}}))
    cells = {c.id: c for c in spec.cells()}
    assert len(cells) == 6 and "inter_lag=4,method=naive_entr,seed=0" in cells
    naive = cells["inter_lag=4,method=naive_entr,seed=0"].config.algorithm
    assert naive.correction == "naive" and naive.add_entr_mask and naive.policy_loss == "ppo_clip"
    dppo = cells["inter_lag=0,method=dppo,seed=0"].config.algorithm
    assert dppo.correction == "none" and dppo.policy_loss == "dppo_tv"
    with pytest.raises(SpecError, match=r"grid.method: \['kpop'\] not among"):
        load_spec(write(tmp_path, {"methods": methods, "grid": {"method": ["kpop"]}}))
    with pytest.raises(SpecError, match="method=dppo.*algorithm.policy_loss='dppo' is not valid"):
        load_spec(write(tmp_path, {"methods": {"dppo": {"algorithm.policy_loss": "dppo"}},
                                   "grid": {"method": ["dppo"]}}))

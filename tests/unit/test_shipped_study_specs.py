"""Every study spec shipped under examples/studies/ (subfolders included) loads, validates every cell, and
expands to the number of cells its header states (`# cells: N`, counted by hand); the countdown fair test's
specs (examples/studies/countdown/, issue 30) also have the cells and settings the issue asks for."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from entr_megatron.study.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "examples" / "studies"
COUNTDOWN = STUDIES / "countdown"


def _is_spec(path: Path) -> bool:
    """A study spec names a `base` run config; the other YAML files there are run configs or planner inputs."""
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "base" in data


SPECS = sorted(p for p in STUDIES.rglob("*.yaml") if _is_spec(p))


def _stated_cells(path: Path) -> int:
    found = re.findall(r"^# cells: (\d+)\b", path.read_text(), flags=re.MULTILINE)
    assert len(found) == 1, f"{path}: the header must state its size once, as '# cells: N (...)'"
    return int(found[0])


def test_every_spec_folder_is_searched():
    names = {str(p.relative_to(STUDIES)) for p in SPECS}
    assert {"staleness.yaml", "countdown/main.yaml", "countdown/pilot.yaml", "countdown/intra_lag.yaml",
            "countdown/ablations.yaml", "countdown/tau.yaml", "countdown/clip_binds.yaml",
            "countdown/key_seeds.yaml", "countdown/modes.yaml"} <= names
    assert "countdown/base.yaml" not in names and "cluster_qwen3_30b_a3b.yaml" not in names


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(STUDIES)))
def test_spec_expands_to_the_cells_it_states(path):
    spec = load_spec(path)  # validates every cell's config and the warm-up's
    ids = [cell_id for cell_id, _ in spec.cell_axes()]
    assert len(ids) == len(set(ids))
    assert len(ids) == _stated_cells(path)


# --- the countdown fair test ------------------------------------------------------------------------------

METHODS = {  # method -> (correction, policy_loss, entropy_source, add_entr_mask), from issue 30 by hand
    "none": ("none", "ppo_clip", "learner", False),
    "entr": ("entr", "ppo_clip", "learner", False),
    "entr_rollout": ("entr", "ppo_clip", "rollout", False),
    "icepop": ("icepop", "ppo_clip", "learner", False),
    "kpop": ("kpop", "ppo_clip", "learner", False),
    "dppo": ("none", "dppo_tv", "learner", False),
    "opsm": ("opsm", "ppo_clip", "learner", False),
    "naive": ("naive", "ppo_clip", "learner", False),
    "matched_band": ("matched_band", "ppo_clip", "learner", False),
    "matched_random": ("matched_random", "ppo_clip", "learner", False),
    "naive_entr": ("naive", "ppo_clip", "learner", True),
    "reinforce": ("none", "reinforce", "learner", False),
    "reinforce_entr": ("none", "reinforce", "learner", True),
}


def _cells(name: str):
    return load_spec(COUNTDOWN / f"{name}.yaml").cells()


def _method(cell) -> tuple:
    a = cell.config.algorithm
    return a.correction, a.policy_loss, a.entropy_source, a.add_entr_mask


@pytest.mark.parametrize("name", ["pilot", "main", "intra_lag", "ablations", "tau", "clip_binds", "key_seeds"])
def test_countdown_cells_share_the_fair_test_base(name):
    spec = load_spec(COUNTDOWN / f"{name}.yaml")
    for cell in spec.cells():
        c = cell.config
        assert (c.controller.mode, c.task.name) == ("fixed_lag", "countdown")
        assert (c.rollout.engine, c.rollout.dtype, c.rollout.quantize, c.rollout.quantize_activations) == (
            "embedded", "bfloat16", "fp8", True)
        assert c.model.dtype == "float32"
        minis = 8 if name == "clip_binds" else 2  # clip_binds changes only this
        assert c.learner.mini_batches == minis and c.learner.steps_per_batch == minis
        assert c.learner.optim.lr == 3.0e-5
        assert c.task.eval_size == 200
        assert c.sft is not None and c.sft.target_accuracy is None
        if "method" in cell.axes:
            assert _method(cell) == METHODS[cell.axes["method"]], cell.id
    warmup = spec.warmup_config()
    assert warmup is not None and warmup["sft"]["steps"] == 300 and "target_accuracy" not in warmup["sft"]


def test_countdown_main_is_every_method_at_every_lag_and_seed():
    cells = _cells("main")
    methods = ["none", "entr", "entr_rollout", "icepop", "kpop", "dppo", "opsm", "naive"]
    got = sorted((c.axes["method"], c.config.controller.inter_lag, c.config.controller.seed) for c in cells)
    assert got == sorted(itertools.product(methods, [0, 4, 12, 32], [0, 1, 2]))
    assert {c.config.controller.train_steps for c in cells} == {150}
    assert {c.config.controller.intra_lag for c in cells} == {0}


def test_countdown_intra_lag_holds_the_mean_lag_and_switches_inside_the_responses():
    cells = _cells("intra_lag")
    got = sorted((c.axes["method"], c.config.controller.intra_lag, c.config.controller.seed) for c in cells)
    assert got == sorted(itertools.product(["none", "naive", "icepop", "entr", "entr_rollout"], [0, 2, 5, 9],
                                           [0, 1, 2]))
    for c in cells:
        ctl = c.config.controller
        assert (ctl.inter_lag, ctl.intra_lag_hold_mean, ctl.intra_lag_stride) == (12, True, 4)
        # the last switch (after J x stride tokens) falls inside the ~42-token responses (docs/tasks.md)
        assert ctl.intra_lag * ctl.intra_lag_stride < 40


def test_countdown_ablations_and_tau():
    ablations = _cells("ablations")
    assert sorted(c.axes["method"] for c in ablations if c.config.controller.seed == 0) == sorted(
        ["entr", "none", "matched_band", "matched_random", "naive", "naive_entr", "reinforce", "reinforce_entr"])
    assert {c.config.controller.inter_lag for c in ablations} == {32} and len(ablations) == 24  # where naive collapses
    tau = _cells("tau")
    got = sorted((c.config.algorithm.tau, c.config.algorithm.entropy_source, c.config.controller.seed) for c in tau)
    assert got == sorted(itertools.product([0.25, 0.5, 1.0, 2.0, 4.0], ["learner", "rollout"], [0, 1, 2]))
    assert {c.config.algorithm.correction for c in tau} == {"entr"}


def test_countdown_key_seeds_are_seeds_3_and_4_of_the_key_contrasts():
    """Five seeds on the key contrasts with seeds 0-2 of main and ablations: the same methods (the
    base test checks each method's settings), the same lags."""
    got = sorted((c.axes["method"], c.config.controller.inter_lag, c.config.controller.seed) for c in _cells("key_seeds"))
    want = [*itertools.product(["entr", "none", "dppo", "matched_band", "naive_entr"], [32], [3, 4]),
            *itertools.product(["entr", "none"], [0], [3, 4])]
    assert got == sorted(want)


def test_countdown_modes_are_the_three_controller_modes_on_the_fair_test_job():
    cells = _cells("modes")
    assert sorted((c.config.controller.mode, c.config.controller.seed) for c in cells) == sorted(
        itertools.product(["sync", "one_step_off", "fully_async"], [0, 1, 2]))
    for c in cells:  # the fair test's job, only the mode and the threads changed
        assert (c.config.task.name, c.config.rollout.quantize, c.config.learner.mini_batches) == ("countdown", "fp8", 2)
        assert (c.config.algorithm.correction, c.config.algorithm.tau, c.config.controller.max_policy_lag) == (
            "entr", 1.0, 4)
        assert c.config.rollout.embedded.num_threads is None and c.config.launcher.cpu_threads_per_rank is None


def test_countdown_clip_binds_splits_each_batch_into_eight_mini_batches():
    cells = _cells("clip_binds")
    assert sorted((c.axes["method"], c.config.controller.seed) for c in cells) == sorted(
        itertools.product(["none", "entr", "icepop", "naive"], [0, 1]))
    assert {(c.config.learner.mini_batches, c.config.controller.inter_lag) for c in cells} == {(8, 32)}
    # each mini-batch is one whole group: prompts x samples split evenly
    assert {c.config.rollout.prompts_per_step * c.config.rollout.sampling.n // c.config.learner.mini_batches
            for c in cells} == {c.config.rollout.sampling.n for c in cells}


def test_countdown_pilot_is_short():
    cells = _cells("pilot")
    assert len(cells) == 6 and {c.config.controller.train_steps for c in cells} == {40}
    assert {c.config.controller.inter_lag for c in cells} == {0, 32}

"""Protocols declare what their callers use (issue 48): on the RL step's path nothing probes an object
for a member its type does not declare (`hasattr`, `getattr` with a literal name) or forwards unknown
members (`__getattr__`); the engines the controller drives are `EngineGroup`s, which declare `is_live`."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "entr_megatron"
RL_STEP_PATH = sorted((PKG / "controller" / "rl").glob("*.py")) + [
    PKG / "rollout" / "episodes.py", PKG / "rollout" / "engine.py", PKG / "controller" / "job" / "sglang_setup.py",
    PKG / "controller" / "job" / "wiring.py",
    PKG / "controller" / "ranks" / "remote.py", PKG / "controller" / "ranks" / "learner_worker.py",
    PKG / "learner" / "trainer.py", PKG / "learner" / "train_step.py", PKG / "learner" / "loss.py",
]


def probes(source: str) -> list[str]:
    """`hasattr(...)`, `getattr(x, "name"...)` and `def __getattr__` in `source`, as 'line: text'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            found.append(f"{node.lineno}: def __getattr__")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            literal = len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            if node.func.id == "hasattr" or (node.func.id == "getattr" and literal):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_finder_finds_each_kind():
    src = ("class A:\n    def __getattr__(self, n):\n        return 1\n"
           "hasattr(a, 'x')\ngetattr(a, 'y', None)\ngetattr(a, name)\n")
    assert [p.split(":")[0] for p in probes(src)] == ["2", "4", "5"]


@pytest.mark.parametrize("path", RL_STEP_PATH, ids=lambda p: str(p.relative_to(PKG)))
def test_no_member_probes_on_the_rl_steps_path(path):
    assert path.exists(), path
    assert probes(path.read_text()) == [], f"{path.relative_to(PKG)} probes for undeclared members"


def test_the_controllers_engines_are_engine_groups():
    from entr_megatron.controller.job.sglang_setup import PushedVersionView
    from entr_megatron.controller.rl.engines import EngineSet
    from entr_megatron.rollout.engine import EngineGroup, RolloutEngine
    from entr_megatron.rollout.episodes import EpisodeEngine

    declared = {m for m in vars(EngineGroup) | vars(RolloutEngine) if not m.startswith("_")}
    assert {"submit", "poll", "weight_version", "is_live"} <= declared
    for cls in (EngineSet, PushedVersionView, EpisodeEngine):
        missing = {m for m in declared if not callable(getattr(cls, m, None)) and not isinstance(getattr(cls, m, None), property)}
        assert not missing, (cls.__name__, missing)
    assert "is_live" in EngineGroup.__dict__ and "is_live" not in RolloutEngine.__dict__

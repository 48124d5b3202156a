"""A run's first screen: Megatron's known fallback warnings collapsed into one line, and the
progress counting to the steps this start will run."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import types
import warnings

import pytest

from entr_megatron.utils import megatron_warnings
from entr_megatron.utils.megatron_warnings import fallback_summary, quiet_megatron_fallbacks

MEGATRON = pathlib.Path(importlib.util.find_spec("megatron.core").origin).parent


def _megatron_fallback_messages() -> dict[str, str]:
    """{"file:line": message} of every `warnings.warn("...")` in megatron-core's source that
    says a fast path is not installed or that its own cuda_graph_scope default is deprecated:
    the messages as megatron writes them, read from its files (not from our patterns)."""
    found = {}
    for path in MEGATRON.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "not installed" not in text and "full scope is deprecated" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings" and node.args):
                arg = node.args[0]
                if isinstance(arg, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in arg.values):
                    arg = ast.Constant("".join(v.value for v in arg.values))  # an f-string with no placeholder
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                        "Transformer Engine and Apex are not installed" in arg.value
                        or "Apex is not installed. Falling back to Torch Norm" in arg.value
                        or "full scope is deprecated" in arg.value):
                    found[f"{path.relative_to(MEGATRON)}:{node.lineno}"] = arg.value
    return found


def _shown(messages) -> list[str]:
    """The messages that would reach the screen under the current filters."""
    with warnings.catch_warnings(record=True) as caught:
        quiet_megatron_fallbacks()
        for m in messages:
            warnings.warn(m, UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_megatrons_known_warnings_are_silenced_and_others_are_not():
    messages = _megatron_fallback_messages()
    # The sites a CPU `train` process hits (megatron-core 0.16.1): 4 + 2 + 1 lines per process.
    for site in ("optimizer/__init__.py", "optimizer/optimizer.py", "optimizer/clip_grads.py",
                 "distributed/fsdp/src/megatron_fsdp/mixed_precision.py", "models/backends.py",
                 "models/gpt/gpt_layer_specs.py", "transformer/transformer_config.py"):
        assert any(k.startswith(site + ":") for k in messages), (site, sorted(messages))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what the screen showed before: every one of them
        for m in messages.values():
            warnings.warn(m, UserWarning, stacklevel=1)
        assert len(caught) == len(messages)
        warnings.simplefilter("always")
        assert _shown(messages.values()) == []
        other = ["Apex is broken", "Transformer Engine 2.1 is too old", "full scope is fine"]
        assert _shown(other) == other


def test_every_rank_silences_them_where_it_starts(monkeypatch):
    from entr_megatron.utils.spawn import enter_rank

    message = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        enter_rank({})
        warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]


@pytest.mark.parametrize("missing, on_gpu, line", [
    ({"transformer_engine", "apex"}, False,
     "Transformer Engine and Apex are not installed: Megatron uses its local PyTorch layers, norms and optimizer "
     "(expected on CPU, where neither runs: no cost)"),
    ({"apex"}, True,
     "Apex is not installed: Megatron uses its local PyTorch layers, norms and optimizer (on GPU this costs speed: "
     "no fused TE layers, attention or FP8, torch norms, multi-tensor optimizer steps in Python (the NGC image in "
     "docker/ has both))"),
    (set(), True, None),
])
def test_the_one_line_says_what_is_missing_and_what_it_costs(monkeypatch, missing, on_gpu, line):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(megatron_warnings.importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else (object() if name in megatron_warnings.FAST_PATHS
                                                                       else find_spec(name, *a)))
    assert fallback_summary(on_gpu) == line


def test_progress_counts_to_the_steps_of_this_start(tmp_path, capsys):
    """`train --max-steps 30` from step 0 of a 250-step run: "step 20/30", not "step 20/250"."""
    from contextlib import ExitStack

    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.job.run_hooks import step_recorder

    cfg = load_config(None, ["controller.train_steps=250", "logging.log_interval=10", "logging.tensorboard=false"])
    pusher = types.SimpleNamespace(last_push_report={})
    with ExitStack() as stack:
        on_step = step_recorder(cfg, tmp_path, stack, pusher, done=0, until=30)
        for step in range(30):
            on_step({"step": step})
    lines = [line.split(" | ")[0] for line in capsys.readouterr().err.splitlines()]
    assert lines == [f"rl {cfg.controller.mode} step {n}/30" for n in (10, 20, 30)]

"""Test-only fault injection (utils/faults.py): a process stops itself at a named point, once."""

import os
import signal
import subprocess
import sys

import pytest

from entr_megatron.utils.faults import FAULT_DIR_ENV, FAULT_ENV, maybe_fault

SCRIPT = """
import sys
from entr_megatron.utils.faults import maybe_fault
for version in range(5):
    maybe_fault("engine", version, "train")      # another point: never fires
    maybe_fault("engine", version, "generate")
    print(version, flush=True)
"""


def _run(tmp_path, spec):
    env = {**os.environ, FAULT_ENV: spec, FAULT_DIR_ENV: str(tmp_path)}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def test_a_fault_kills_its_process_at_the_version_once(tmp_path):
    first = _run(tmp_path, "rank0@0:generate;engine@2:generate")
    assert first.returncode == -signal.SIGKILL and first.stdout.split() == ["0", "1"]
    again = _run(tmp_path, "rank0@0:generate;engine@2:generate")  # the replacement: the marker is there
    assert again.returncode == 0 and again.stdout.split() == ["0", "1", "2", "3", "4"]


def test_no_variable_no_fault_and_a_bad_spec_names_the_item(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    maybe_fault("engine", 10, "generate")  # nothing happens
    monkeypatch.setenv(FAULT_ENV, "engine@x:generate")
    monkeypatch.setenv(FAULT_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="'engine@x:generate'"):
        maybe_fault("engine", 10, "generate")
    monkeypatch.delenv(FAULT_DIR_ENV)
    with pytest.raises(ValueError, match=FAULT_DIR_ENV):
        maybe_fault("engine", 10, "generate")


def test_an_indexed_name_is_one_process_and_the_bare_kind_names_all(tmp_path):
    """`engine1` fires in engine 1 only; `engine` in any engine, with or without its index."""
    script = """
import sys
from entr_megatron.utils.faults import maybe_fault
maybe_fault("engine0", 3, "receive")
print("engine0 lives", flush=True)
maybe_fault(sys.argv[1], 3, "receive")
print("after", flush=True)
"""
    for spec, who, dies in [("engine1@3:receive", "engine1", True), ("engine1@3:receive", "engine2", False),
                            ("engine@3:receive", "engine2", False), ("engine@4:receive", "engine1", False),
                            ("engines@3:receive", "engine1", False)]:
        marker = tmp_path / f"{spec}-{who}"
        marker.mkdir()
        env = {**os.environ, FAULT_ENV: spec, FAULT_DIR_ENV: str(marker)}
        out = subprocess.run([sys.executable, "-c", script, who], env=env, capture_output=True, text=True, timeout=60)
        if spec == "engine@3:receive":  # the bare kind fired in engine0 already
            assert out.returncode == -signal.SIGKILL and out.stdout.split("\n")[0] == "", (spec, who, out)
            continue
        assert (out.returncode == -signal.SIGKILL) == dies and ("after" in out.stdout) != dies, (spec, who, out)

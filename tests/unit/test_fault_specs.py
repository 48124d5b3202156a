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

"""What can make an SGLang server fail to start, checked in seconds before it is started.

A server that cannot start otherwise says so only after importing sglang (60-100 s on 2 CPU
cores) or not at all (a port another process holds: SGLang's uvicorn fails late, or a server of
someone else answers our health checks). `check_server` raises `ServerStartError`, one line naming
the interpreter, port or model directory and what is valid, before any process starts:

| check | fails when |
|---|---|
| interpreter | the path does not exist or is not executable, or it has no `sglang` (asked with `importlib.util.find_spec`, which imports nothing) |
| port | something already listens on host:port (a bind with SO_REUSEADDR, as uvicorn's, fails) |
| model directory | no readable config.json with a "model_type" or "architectures" in it |

The interpreter and model checks apply to real servers only (`real`); a stand-in command (tests'
mock servers) gets the port check. Nothing here imports sglang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from entr_megatron.rollout.engine import EngineError

__all__ = ["FIND_SGLANG", "ServerStartError", "check_interpreter", "check_model_dir", "check_port", "check_server"]

FIND_SGLANG = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
"""Run by the server's interpreter: exit 0 when sglang is installed there (nothing is imported)."""
INTERPRETER_TIMEOUT_S = 60.0
"""The interpreter check's bound (a cold start of a fresh venv on a loaded machine takes seconds)."""


class ServerStartError(EngineError):
    """An SGLang server cannot start; the message (one line) names what and what is valid."""


def check_interpreter(python: str) -> None:
    """`python` exists, runs, and has sglang installed."""
    path = Path(python)
    if not path.exists():
        raise ServerStartError(f"rollout.sglang.python={python!r}: no such file; give the interpreter of a venv with "
                               "sglang installed (scripts/setup_sglang_cpu.sh makes .venv-sglang/bin/python)")
    if not os.access(path, os.X_OK) or path.is_dir():
        raise ServerStartError(f"rollout.sglang.python={python!r}: not an executable file; give a Python interpreter")
    try:
        done = subprocess.run([str(path), "-c", FIND_SGLANG], capture_output=True, text=True,
                              timeout=INTERPRETER_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ServerStartError(f"rollout.sglang.python={python!r} does not run: {e}") from None
    if done.returncode == 3:
        raise ServerStartError(f"rollout.sglang.python={python!r} has no sglang installed; run "
                               "scripts/setup_sglang_cpu.sh (CPU) or pip install sglang in that venv")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServerStartError(f"rollout.sglang.python={python!r} failed to run (exit {done.returncode}): {tail}")


def check_port(host: str, port: int) -> None:
    """Nothing listens on host:port (where the server would bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServerStartError(f"SGLang server port {host}:{port} is taken ({e.strerror}); choose another "
                                   "rollout.sglang.base_port (server i listens on base_port + i) or stop what "
                                   "listens there") from None


def check_model_dir(model_path: str) -> None:
    """`model_path` is a directory holding an HF config.json (a model id is not: nothing is downloaded)."""
    config = Path(model_path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except OSError as e:
        raise ServerStartError(f"SGLang model directory {model_path!r} has no readable config.json ({e.strerror}); "
                               "give an HF model directory (model.path, or the model built from model.architecture)") from None
    except ValueError as e:
        raise ServerStartError(f"SGLang model directory {model_path!r}: config.json is not JSON ({e})") from None
    if not isinstance(data, dict) or not (data.get("model_type") or data.get("architectures")):
        raise ServerStartError(f"SGLang model directory {model_path!r}: config.json has neither model_type nor "
                               "architectures; it is not an HF model config")


def check_server(real: bool, python: str, host: str, port: int, model_path: str) -> None:
    """Every check of the module docstring that applies: port always, interpreter and model for `real` servers."""
    check_port(host, port)
    if real:
        check_model_dir(model_path)
        check_interpreter(python)

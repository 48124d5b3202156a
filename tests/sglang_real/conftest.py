"""Tests against real SGLang 0.5.23 servers on this CPU (marker `sglang_real`; docs/SGLANG_ON_CPU.md).

The session builds .venv-sglang when it is missing or stale (scripts/setup_sglang_cpu.sh, 3-7
minutes and 7 GB the first time, seconds after) and fails, naming the script's error, when it
cannot; ENTR_SKIP_SGLANG_REAL=1 skips these tests instead (a machine without the registry). A
server takes 60-100 s to start on 2 cores, so the modules share one (`server`, started once per
session from a model with the CPU demo's architecture and random weights, nothing downloaded);
the train tests launch their own, as `train` does.

ENTR_SGLANG_RECORD=1 rewrites the recorded answers (tests/unit/sglang_answers_0.5.23.json) from the
live server; otherwise every exchange recorded there is checked against the live one
(`Recorder`), and the mock's tests replay them (tests/unit/test_sglang_mock_replay.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from sglang_answers import ANSWERS_PATH, compare_exchange  # noqa: E402

sys.path.insert(0, str(HERE))
from real_server import ARCH  # noqa: E402

SKIP_ENV, RECORD_ENV = "ENTR_SKIP_SGLANG_REAL", "ENTR_SGLANG_RECORD"


def pytest_configure(config):
    config.addinivalue_line("markers", "sglang_real: against a real SGLang server on CPU (tests/sglang_real)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.sglang_real)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """.venv-sglang's interpreter, the venv built or refreshed first."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the real-SGLang tests are skipped")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_sglang_cpu.sh")], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        pytest.fail(f"scripts/setup_sglang_cpu.sh failed (exit {done.returncode}); set {SKIP_ENV}=1 to skip these "
                    f"tests on a machine that cannot build .venv-sglang:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return str(ROOT / ".venv-sglang" / "bin" / "python")


def build_model(path: Path, seed: int = 0) -> Path:
    """An HF model directory with ARCH, random weights (seeded) and the character tokenizer."""
    import transformers

    from entr_megatron.tasks import build_char_tokenizer

    tok = build_char_tokenizer()
    arch = dict(ARCH)
    config = transformers.AutoConfig.for_model(arch.pop("model_type"), **arch, vocab_size=len(tok),
                                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("sglang_model"))


@pytest.fixture(scope="session")
def server(sglang_python, model_dir, tmp_path_factory):
    """One real server for the session: float32, 127.0.0.1, launched as `train` launches on CPU."""
    from entr_megatron.rollout.sglang import SGLangServerConfig, launch_servers
    from entr_megatron.utils.spawn import free_port

    config = SGLangServerConfig(str(model_dir), port=free_port(), dtype="float32", device="cpu", python=sglang_python,
                                max_total_tokens=4096, env={"OMP_NUM_THREADS": "2", "GLOO_SOCKET_IFNAME": "lo"})
    [process] = launch_servers([config], tmp_path_factory.mktemp("sglang_logs"), startup_timeout_s=900,
                               progress=lambda line: print(line, file=sys.stderr, flush=True))
    process.config = config
    yield process
    process.terminate()


class Recorder:
    """Exchanges with the live server by name: written to ANSWERS_PATH with ENTR_SGLANG_RECORD=1,
    else each is compared with the one recorded (its status, the shape of its answer, its fixed texts)."""

    def __init__(self):
        self.record = os.environ.get(RECORD_ENV) == "1"
        self.stored = {} if self.record or not ANSWERS_PATH.exists() else json.loads(ANSWERS_PATH.read_text())
        self.seen: dict[str, dict] = {}

    def __call__(self, name: str, method: str, path: str, request, status: int, answer) -> None:
        exchange = {"method": method, "path": path, "request": request, "status": status, "answer": answer}
        self.seen[name] = exchange
        if not self.record:
            assert name in self.stored, f"{name} is not recorded in {ANSWERS_PATH}: run with {RECORD_ENV}=1"
            problems = compare_exchange(self.stored[name], exchange)
            assert not problems, f"the live server's {name} differs from the recording: {problems}"

    def close(self) -> None:
        if self.record and self.seen:
            merged = {**(json.loads(ANSWERS_PATH.read_text()) if ANSWERS_PATH.exists() else {}), **self.seen}
            ANSWERS_PATH.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


@pytest.fixture(scope="session")
def recorder():
    r = Recorder()
    yield r
    r.close()

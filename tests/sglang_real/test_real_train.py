"""`entr-megatron train` with real SGLang servers on CPU: launched by the run (fully_async, its server
killed mid-run and replaced), or given by URL (sync, the session's server: the final weights it
serves are the learner's); and servers that cannot start fail in seconds with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig, SGLangServerConfig, launch_servers
from entr_megatron.rollout.sglang.preflight import ServerStartError
from entr_megatron.utils.run_log import read_metrics
from entr_megatron.utils.spawn import free_port

from real_server import ARCH, FLOAT32_ATOL, PROMPT, Reference, max_diff


def write_run(tmp: Path, name: str, mode: str, sglang: dict, steps: int, **rollout) -> tuple[Path, Path]:
    run_dir = tmp / name
    cfg = {
        "model": {"architecture": ARCH, "max_prompt_len": 16, "max_seq_len": 32},
        "algorithm": {"correction": "entr", "tau": 1.0},
        "learner": {"optim": {"lr": 1.0e-3}},
        "rollout": {"engine": "sglang", "num_engines": 1, "dtype": "float32", "prompts_per_step": 4,
                    "weight_bucket_mib": 1, "sampling": {"max_new_tokens": 6, "n": 4}, "sglang": sglang, **rollout},
        "controller": {"mode": mode, "train_steps": steps, "max_policy_lag": 2, "checkpoint_interval": 0},
        "task": {"name": "arithmetic", "eval_size": 8, "arithmetic": {"digits": 1, "operations": ["+"]}},
        "launcher": {"device": "cpu"},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "log_interval": 1, "tensorboard": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def train(config: Path, timeout: float = 1200) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    return proc


def server_leader(port: int) -> int | None:
    """The pid of the process that leads the SGLang server on `port` (launched in its own session)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"sglang.launch_server" in argv and str(port).encode() in argv and os.getpgid(int(entry.name)) == int(entry.name):
                return int(entry.name)
        except OSError:  # gone while the scan read it (ProcessLookupError from getpgid)
            continue
    return None


def kill_at_step(run_dir: Path, port: int, step: int, killed: dict) -> None:
    """SIGKILL the server's whole process group once metrics.jsonl has `step` (a thread)."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            rows = read_metrics(run_dir / "metrics.jsonl")
        except (OSError, ValueError):  # not there yet, or a line being written
            rows = []
        if any(r["step"] >= step for r in rows):
            pid = server_leader(port)
            if pid is not None:
                os.killpg(pid, signal.SIGKILL)
                killed.update(pid=pid, at=max(r["step"] for r in rows))
            return
        time.sleep(0.2)


def test_fully_async_with_a_launched_server_that_is_killed_and_replaced(tmp_path, sglang_python):
    port = free_port()
    config, run_dir = write_run(tmp_path, "async", "fully_async", {"python": sglang_python, "base_port": port,
                                "max_total_tokens": 4096, "startup_timeout_s": 600}, steps=8, kv_on_update="keep",
                                max_engine_restarts=1)
    killed: dict = {}
    watcher = threading.Thread(target=kill_at_step, args=(run_dir, port, 2, killed), daemon=True)
    watcher.start()
    proc = train(config)
    watcher.join(5)
    assert killed, "the server was never killed"
    assert "still starting after" in proc.stderr  # the progress line while it imports
    assert "relaunching it" in proc.stderr, proc.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(8)) and rows[-1]["engines/restarts"] == 1
    assert all(0 <= r["policy_lag/max"] <= 2 for r in rows)  # the lag bound, across the replacement
    log = (run_dir / "sglang" / f"sglang-{port}.log").read_text()
    assert log.count("POST /init_weights_update_group HTTP/1.1\" 200") == 2  # the group rebuilt with the new server
    assert log.count("--disable-radix-cache") == 2  # kv_on_update keep (sglang_servers.NO_PREFIX_CACHE)
    assert "POST /pause_generation" in log and "POST /continue_generation" in log


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_sync_against_a_server_given_by_url_ends_with_the_learners_weights(tmp_path, server, placement):
    """separate: the weights over a gloo group; colocated: through shared memory
    (/update_weights_from_tensor), the server on the learner's host."""
    config, run_dir = write_run(tmp_path, "sync", "sync", {"urls": [server.url]}, steps=3, placement=placement)
    before = server.log_path.read_text(errors="replace")
    train(config)
    routes = server.log_path.read_text(errors="replace")[len(before):]
    tensor_calls = routes.count('POST /update_weights_from_tensor HTTP/1.1" 200')
    if placement == "colocated":  # 3.2 MB of float32 weights in 1 MiB buckets: 4 calls a version, 4 versions
        assert tensor_calls >= 12 and "/init_weights_update_group" not in routes, routes[-3000:]
    else:
        assert tensor_calls == 0 and 'POST /init_weights_update_group HTTP/1.1" 200' in routes
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [0, 1, 2] and all(r["policy_lag/max"] == 0 for r in rows)
    assert [r["weight_sync/version"] for r in rows] == [1, 2, 3]
    final = Reference(run_dir / "final_model")  # what the learner exported at the end
    weights = final.base
    with SGLangEngine(SGLangEngineConfig(urls=(server.url,))) as engine:
        assert engine.weight_version == 3
        (s,) = generate(engine, [GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                              ignore_eos=True))], timeout_s=60)
    assert s.output_ids == final.greedy(weights, PROMPT, 12) and s.versions == [3] * 12
    assert max_diff(s.logprobs, final.logprobs(weights, PROMPT, s.output_ids)) < FLOAT32_ATOL


def one_line_in_seconds(config: SGLangServerConfig, tmp_path: Path, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=match) as e:
        launch_servers([config], tmp_path, startup_timeout_s=600)
    assert time.monotonic() - t0 < 20 and "\n" not in str(e.value), str(e.value)


def test_a_server_that_cannot_start_fails_in_seconds_with_one_line(tmp_path, server, model_dir, sglang_python):
    base = dict(dtype="float32", device="cpu", max_total_tokens=4096)
    one_line_in_seconds(SGLangServerConfig(str(model_dir), port=free_port(), python=str(tmp_path / "nowhere/bin/python"),
                                           **base), tmp_path, r"rollout\.sglang\.python=.*no such file")
    one_line_in_seconds(SGLangServerConfig(str(model_dir), port=free_port(), python=sys.executable, **base), tmp_path,
                        "has no sglang installed")
    port = int(server.url.rsplit(":", 1)[1])  # the session's server holds it
    one_line_in_seconds(SGLangServerConfig(str(model_dir), port=port, python=sglang_python, **base), tmp_path,
                        f"127.0.0.1:{port} is taken")
    (tmp_path / "empty").mkdir()
    one_line_in_seconds(SGLangServerConfig(str(tmp_path / "empty"), port=free_port(), python=sglang_python, **base),
                        tmp_path, "has no readable config.json")

"""SGLang servers kept in service (controller/job/sglang_servers.py), against the protocol mock run as
a server process (`sglang_mock.py` as a script: SGLang 0.5.23's HTTP API), killed with SIGKILL or
stopped with SIGSTOP like a real server:

- a server `train` launched is relaunched on its port (a new process), the weight group rebuilt
  over the servers in service (each relabelled -1 first) and the learner's version pushed; past
  rollout.max_engine_restarts the error names the server and the count (a relaunch that fails
  counts too);
- a server given by URL is set aside (its requests lost, the others keep generating), probed, and
  taken back with the learner's version once it answers again; with none left the run waits
  rollout.sglang.server_wait_s, then stops naming each server;
- relaunched learner ranks reach the servers in service, which are relabelled so that the
  checkpoint's (older) version is pushed first.

The learner side is a fake: its "push" relabels the servers of the last weight group (the real
handshake is tests/e2e/test_train_sglang.py's)."""

from __future__ import annotations

import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import pytest

import sglang_mock
from controller_fakes import DeliveredPush
from entr_megatron.config import ControllerConfig
from entr_megatron.config.loader import load_config
from entr_megatron.controller.job.sglang_servers import SGLangServers, ServerRecovery
from entr_megatron.controller.job.sglang_setup import PushedVersionView
from entr_megatron.controller.rl.engines import RestartsExhausted
from entr_megatron.controller.rl.loop import Controller
from entr_megatron.rollout.sglang import SGLangClient, SGLangServerConfig, launch_servers

MOCK = (sys.executable, str(pathlib.Path(sglang_mock.__file__)))
P, N = 2, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(*overrides):
    return load_config(None, ["rollout.engine=sglang", "rollout.sglang.request_timeout_s=1",
                              "rollout.sglang.http_retries=0", "rollout.sglang.retry_backoff_s=0.05",
                              "rollout.sglang.probe_interval_s=0.2", "rollout.poll_timeout_s=2",
                              f"rollout.prompts_per_step={P}", f"rollout.sampling.n={N}",
                              "rollout.sampling.max_new_tokens=4", *overrides])


class Group:
    """Learner rank 0's side, faked: the servers of the last weight group."""

    def __init__(self):
        self.connects = []

    def call(self, method, *args, **kwargs):
        assert method.__name__ == "connect_weight_sync"
        self.connects.append(kwargs["sglang"].urls)


class Pusher:
    """Relabels the servers of the last weight group as rank 0's SGLangTransport would (version on
    the last bucket), then tells the view."""

    def __init__(self, group, view=None):
        self.group, self.view, self.pushed = group, view, []

    def push(self, version):
        for url in self.group.connects[-1]:
            SGLangClient(url).update_weight_version(str(version), abort_all_requests=False)
        self.pushed.append(version)
        if self.view is not None:
            self.view.confirm_version(version)
        return DeliveredPush()


def version_of(url) -> str:
    return SGLangClient(url).weight_version()


def mock_process(port) -> subprocess.Popen:
    proc = subprocess.Popen([*MOCK, "--model-path", "m", "--port", str(port), "--weight-version", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not SGLangClient(f"http://127.0.0.1:{port}").is_healthy(timeout=1, retries=0):
        assert proc.poll() is None and time.monotonic() < deadline, "the mock server did not start"
        time.sleep(0.05)
    return proc


@pytest.fixture
def stack():
    with ExitStack() as s:
        yield s


def test_a_launched_server_that_dies_or_stops_is_relaunched_on_its_port(tmp_path, stack):
    cfg = run_config("rollout.max_engine_restarts=2", "rollout.sglang.startup_timeout_s=30", "rollout.num_engines=2",
                     "launcher.device=cuda", "launcher.gpus_per_node=4")  # what launching servers asks for
    configs = [SGLangServerConfig("m", port=free_port(), command_prefix=MOCK) for _ in range(2)]
    servers = SGLangServers(cfg, [c.url for c in configs], {}, configs, launch_servers(configs, tmp_path), tmp_path)
    stack.callback(servers.terminate)
    engines = servers.engine_set()
    group = Group()
    recovery = ServerRecovery(cfg, servers, engines, Pusher(group), "127.0.0.1", stack)
    assert recovery.failed() == []

    first = servers.processes[1].pid
    servers.processes[1].proc.send_signal(signal.SIGKILL)
    servers.processes[1].proc.wait(10)
    failed = recovery.failed()
    assert [i for i, _ in failed] == [1] and "the server process exited (exit code -9)" in failed[0][1]
    recovery.replace(failed, version=5)
    assert servers.processes[1].pid != first and servers.processes[1].alive() and recovery.restarts == 1
    assert group.connects == [tuple(servers.urls)]  # rebuilt over both: the survivor was relabelled -1, then 5
    assert [version_of(u) for u in servers.urls] == ["5", "5"]
    log = (tmp_path / f"sglang-{configs[1].port}.log").read_text().splitlines()
    assert sum(line.startswith("$ ") for line in log) == 2  # the relaunch appended to its log

    stopped = servers.processes[0]
    stopped.proc.send_signal(signal.SIGSTOP)  # alive, silent
    failed = recovery.failed()
    assert [i for i, _ in failed] == [0] and not stopped.alive()  # killed for not answering
    recovery.replace(failed, version=6)
    assert recovery.restarts == 2 and [version_of(u) for u in servers.urls] == ["6", "6"]

    servers.processes[0].proc.send_signal(signal.SIGKILL)
    servers.processes[0].proc.wait(10)
    with pytest.raises(RestartsExhausted) as e:
        recovery.replace(recovery.failed(), version=7)
    assert f"SGLang server {servers.urls[0]} failed, and 2 server(s) were already relaunched in this job " \
           "(rollout.max_engine_restarts=2)" in str(e.value) and "exit code -9" in str(e.value)


class Task:
    name = "fake"

    def prompts(self, split, n, seed):
        return [([1 + (seed * n + j) % 97, 2, 3], j) for j in range(n)]

    def reward(self, sample, reference):
        return float(sum(sample.response_ids) % 2)


class Learner:
    def __init__(self, on_train):
        self.batches, self.on_train = [], on_train

    def train(self, batch, version):
        self.batches.append(batch)
        self.on_train(len(self.batches))
        return {}


def test_a_server_given_by_url_is_set_aside_probed_and_taken_back(stack):
    ports = [free_port(), free_port()]
    procs = [mock_process(p) for p in ports]
    stack.callback(lambda: [p.kill() for p in procs])
    cfg = run_config(f"rollout.sglang.urls=[http://127.0.0.1:{ports[0]},http://127.0.0.1:{ports[1]}]",
                     "rollout.num_engines=2")
    servers = SGLangServers(cfg, list(cfg.rollout.sglang.urls), {}, [None, None], [None, None])
    engines = servers.engine_set()
    view = PushedVersionView(engines, servers)
    group = Group()
    group.connects.append(tuple(servers.urls))
    pusher = Pusher(group, view)
    recovery = ServerRecovery(cfg, servers, engines, pusher, "127.0.0.1", stack)
    pusher.recovery = recovery

    def fault(n):
        if n == 2:
            procs[1].kill()
            procs[1].wait(10)
        if n == 4:
            procs[1] = mock_process(ports[1])  # back on its port, with unknown weights
            deadline = time.monotonic() + 10
            while not recovery.returned():
                assert time.monotonic() < deadline, "the probe did not see it come back"
                time.sleep(0.05)

    learner = Learner(fault)
    ctl = Controller(view, learner, pusher, Task(), ControllerConfig(mode="sync"), cfg.rollout, "grpo",
                     recovery=recovery)
    history = ctl.run(7)
    assert [m["engines/out_of_service"] for m in history] == [0, 1, 1, 0, 0, 0, 0]
    assert [m["engines/restarts"] for m in history] == [0] * 7  # not ours: never restarted
    assert all(b.num_seqs == P * N for b in learner.batches)
    assert group.connects[1:] == [(servers.urls[0],), tuple(servers.urls)]  # without it, then with it again
    assert version_of(servers.urls[1]) == "7" and version_of(servers.urls[0]) == "7"
    assert engines.in_service() == [0, 1]


def test_with_no_server_left_the_run_waits_then_names_each_server(stack):
    port = free_port()
    proc = mock_process(port)
    stack.callback(proc.kill)
    url = f"http://127.0.0.1:{port}"
    cfg = run_config(f"rollout.sglang.urls=[{url}]", "rollout.sglang.server_wait_s=1.5")
    servers = SGLangServers(cfg, [url], {}, [None], [None])
    engines = servers.engine_set()
    group = Group()
    group.connects.append((url,))
    recovery = ServerRecovery(cfg, servers, engines, Pusher(group), "127.0.0.1", stack)
    proc.kill()
    proc.wait(10)
    failed = recovery.failed()
    t0 = time.monotonic()
    with pytest.raises(RestartsExhausted) as e:
        recovery.replace(failed, version=3)
    assert 1.5 <= time.monotonic() - t0 < 10
    assert "every SGLang server stopped answering, and none answered /health within 1.5 s " \
           "(rollout.sglang.server_wait_s)" in str(e.value) and url in str(e.value)

    # one that comes back within the wait is taken back, with the learner's version
    cfg = run_config(f"rollout.sglang.urls=[{url}]", "rollout.sglang.server_wait_s=30")
    recovery = ServerRecovery(cfg, servers, engines, Pusher(group), "127.0.0.1", stack)
    engines.replace(0, engines.engines[0])
    stack.callback(lambda: restarted and restarted[0].kill())
    restarted = []
    threading.Timer(1.0, lambda: restarted.append(mock_process(port))).start()
    recovery.replace(failed, version=3)
    assert engines.in_service() == [0] and version_of(url) == "3" and restarted


def test_relaunched_learner_ranks_reach_the_servers_in_service_and_push_first(stack):
    from entr_megatron.controller.job.sglang_servers import reconnect_sglang

    with sglang_mock.MockSGLangServer(weight_version="9") as a, sglang_mock.MockSGLangServer(weight_version="9") as b:
        cfg = run_config(f"rollout.sglang.urls=[{a.url},{b.url}]", "rollout.num_engines=2")
        servers = SGLangServers(cfg, [a.url, b.url], {}, [None, None], [None, None])
        engines = servers.engine_set()
        view = PushedVersionView(engines, servers)
        view.confirm_version(9)
        old = Pusher(Group())
        old.recovery = ServerRecovery(cfg, servers, engines, old, "127.0.0.1", stack)
        old.recovery.out[1] = None  # b is out of service
        group = Group()
        pusher = reconnect_sglang(cfg, group, "127.0.0.1", 4321, view, old)
        assert group.connects == [(a.url,)] and a.weight_version == "-1" and b.weight_version == "9"
        assert view.weight_version == -1  # the controller pushes the checkpoint's version first
        assert pusher.recovery is old.recovery and old.recovery.pusher is pusher
        assert pusher.on_delivered == view.confirm_version and pusher.push_timeout_s == cfg.rollout.push_timeout_s
        old.recovery.out.clear()


def test_a_relaunch_that_fails_spends_the_budget(tmp_path, stack):
    import dataclasses

    from entr_megatron.rollout.sglang import SGLangError

    cfg = run_config("rollout.max_engine_restarts=1", "rollout.sglang.startup_timeout_s=30", "launcher.device=cuda",
                     "launcher.gpus_per_node=2")
    config = SGLangServerConfig("m", port=free_port(), command_prefix=MOCK)
    servers = SGLangServers(cfg, [config.url], {}, [config], launch_servers([config], tmp_path), tmp_path)
    stack.callback(servers.terminate)
    recovery = ServerRecovery(cfg, servers, servers.engine_set(), Pusher(Group()), "127.0.0.1", stack)
    servers.launch[0] = dataclasses.replace(config, extra_args=("--mock-exit-code", "3"))  # it will not come up
    servers.processes[0].proc.kill()
    servers.processes[0].proc.wait(10)
    with pytest.raises(SGLangError, match="exited with code 3 before it was healthy"):
        recovery.replace(recovery.failed(), version=1)
    with pytest.raises(RestartsExhausted, match=r"1 server\(s\) were already relaunched"):
        recovery.replace(recovery.failed(), version=1)

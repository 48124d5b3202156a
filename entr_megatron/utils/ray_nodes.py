"""Several Ray nodes on one machine, each on its own loopback address, for tests and demos.

    nodes = [RayNode("head", "127.0.0.2", cpus=0), RayNode("a", "127.0.0.3", cpus=2, resources={"learner": 2}),
             RayNode("b", "127.0.0.4", cpus=2, resources={"engine": 2}), RayNode("c", "127.0.0.5", ...)]
    with LoopbackCluster(nodes) as cluster:       # `ray start --head` on the first, `ray start --address` on the rest
        cluster.address                           # "127.0.0.2:PORT": launcher.ray_address
        cluster.kill("c")                         # node c's raylet and every process of it, SIGKILL
        cluster.restart("c")                      # node c again, same address and resources

Each node is one `ray start --block` process in a session of its own, started with
`--node-ip-address` (what the node advertises; Ray's own daemons bind it, or every interface:
that is Ray's), its own `--temp-dir` (sockets, logs), its CPU count and custom resources, so Ray
places actors on it as on a machine of its own. Everything the node runs (raylet, agents, the
workers of its actors, what they spawn) is in that session: `kill` ends them all at once, as a
machine's power loss would. Only 127.0.0.0/8 addresses are taken (Linux routes all of them to
the loopback device; elsewhere only 127.0.0.1 exists: `loopback_aliases_work` says).

Ray's token authentication is on (a token of its own in the cluster's directory): Ray's own
daemons listen on every interface, and a node or driver without the token is refused. A driver
(`entr-megatron train`) joins with `driver_env` in its environment (RAY_AUTH_MODE,
RAY_AUTH_TOKEN_PATH). The nodes' `ray start` inherit `env` (e.g. PYTHONPATH for the actors' imports); `fast_failure`
lets the head declare a silent node dead within seconds instead of Ray's 30 s or more; Ray's
memory monitor is off (`SHARED_MACHINE_ENV`: each node would count the whole machine).
Nothing here imports Ray: it runs its `ray` command (the one beside this interpreter by default).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from entr_megatron.utils.spawn import free_port

__all__ = ["FAST_FAILURE_ENV", "SHARED_MACHINE_ENV", "LoopbackCluster", "RayNode", "loopback_aliases_work", "ray_command"]

SHARED_MACHINE_ENV = {"RAY_memory_monitor_refresh_ms": "0"}
"""Every node sees the whole machine's memory (and other jobs' processes): Ray's per-node memory
monitor would kill this cluster's workers for memory others use. The kernel's OOM killer stays."""
FAST_FAILURE_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
}
"""The head's GCS calls a node dead after five health checks in a row, 1 s apart, went
unanswered for 3 s each (about 5-15 s; Ray's own defaults take half a minute or more). Lenient
enough for a machine whose load average is ten times its cores."""

_STARTED = "Ray runtime started"
_WATCHDOG = """
import os, shutil, signal, sys, time
parent, root, own = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
while os.getppid() == parent:
    time.sleep(1)
try:
    sessions = [int(x) for x in open(os.path.join(root, "sessions")).read().split()]
except OSError:
    sessions = []
for sid in sessions:
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
if own:
    shutil.rmtree(root, ignore_errors=True)
"""
"""Run beside the cluster: when the process that started it dies without `stop` (SIGKILL, a
timeout), it kills every node (their sessions are listed in ROOT/sessions)."""
START_ATTEMPTS = 3
"""Tries per node (see `LoopbackCluster._start`)."""
RAY_WORKER_PORTS = (10002, 19999)
"""`ray start`'s default range of its workers' ports."""


@dataclass(frozen=True)
class RayNode:
    """One node of a `LoopbackCluster`."""

    name: str
    address: str
    """Its own loopback address (127.0.0.0/8): what it advertises to the others."""
    cpus: float = 1
    """Ray's CPU resource of the node (logical: the machine's cores are shared)."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom Ray resources of the node (what launcher.ray_learner_resources / ray_engine_resources ask for)."""

    def __post_init__(self) -> None:
        try:
            ip = ipaddress.ip_address(self.address)
        except ValueError:
            raise ValueError(f"RayNode {self.name!r}: address {self.address!r} is not an IP address; "
                             "use one of 127.0.0.2 ... 127.255.255.254") from None
        if ip.version != 4 or not ip.is_loopback:
            raise ValueError(f"RayNode {self.name!r}: address {self.address} is not a loopback address; "
                             "a loopback cluster takes 127.0.0.0/8 addresses only (127.0.0.2, 127.0.0.3, ...)")


def ray_command() -> str:
    """The `ray` command of this interpreter's environment (else the one on PATH)."""
    here = Path(sys.executable).with_name("ray")
    found = str(here) if here.exists() else shutil.which("ray")
    if found is None:
        raise FileNotFoundError("no `ray` command beside this interpreter or on PATH: pip install 'entr-megatron[cluster]'")
    return found


def loopback_aliases_work(address: str = "127.0.0.2") -> bool:
    """Whether this machine can listen on `address` (Linux: every 127.0.0.0/8 address is loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def port_above_ray_workers(host: str) -> int:
    """A free port on `host` above Ray's default worker ports (10002-19999), which `ray start` refuses to share."""
    for _ in range(200):
        port = free_port(host=host)
        if port > RAY_WORKER_PORTS[1]:
            return port
    raise RuntimeError(f"no free port above {RAY_WORKER_PORTS[1]} on {host}")


class LoopbackCluster:
    """A Ray cluster of `nodes` on this machine (the first is the head; see the module docstring)."""

    def __init__(self, nodes: Sequence[RayNode], *, root: str | None = None, env: Mapping[str, str] | None = None,
                 fast_failure: bool = True, ray: str | None = None):
        if not nodes:
            raise ValueError("a cluster needs at least its head node")
        names = [n.name for n in nodes]
        addresses = [n.address for n in nodes]
        if len(set(names)) != len(names) or len(set(addresses)) != len(addresses):
            raise ValueError(f"node names and addresses must be unique, got {list(zip(names, addresses))}")
        self.nodes = {n.name: n for n in nodes}
        self.head = nodes[0]
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="entr-ray-", dir="/tmp"))  # short: unix socket paths
        self.root.mkdir(parents=True, exist_ok=True)
        token = self.root / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.driver_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        """What a driver's environment needs to join (`{**os.environ, **cluster.driver_env}`): the
        cluster's token (every node and driver must show it: Ray's daemons listen beyond loopback)."""
        self._env = {**os.environ, **SHARED_MACHINE_ENV, **(FAST_FAILURE_ENV if fast_failure else {}), **(env or {}),
                     **self.driver_env}
        self._env.pop("RAY_ADDRESS", None)  # a node joins the address given here, nothing else
        self._ray = ray or ray_command()
        self.port = port_above_ray_workers(self.head.address)
        self._client_port = port_above_ray_workers(self.head.address)
        self._procs: dict[str, subprocess.Popen] = {}
        self._watchdog: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The head's GCS address (launcher.ray_address)."""
        return f"{self.head.address}:{self.port}"

    def start(self, timeout_s: float = 300.0) -> LoopbackCluster:
        """Starts the head, then the other nodes (at once), each `timeout_s` at most."""
        self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.root),
                                           "1" if self._own_root else "0"], start_new_session=True)
        try:
            self._start([self.head.name], timeout_s)
            self._start([n for n in self.nodes if n != self.head.name], timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _command(self, node: RayNode) -> list[str]:
        cmd = [self._ray, "start", "--block", "--disable-usage-stats", f"--node-ip-address={node.address}",
               f"--num-cpus={node.cpus:g}", f"--resources={json.dumps(dict(node.resources))}",
               f"--temp-dir={self.root / node.name}"]
        if node is self.head:
            return cmd + ["--head", f"--port={self.port}", "--include-dashboard=false",
                          f"--ray-client-server-port={self._client_port}"]
        return cmd + [f"--address={self.address}"]

    def _start(self, names: Sequence[str], timeout_s: float) -> None:
        """Starts `names` at once; a node whose `ray start` gives up (Ray waits 30 s at most for its
        raylet to register, which a loaded machine can miss) is started again, `START_ATTEMPTS` times."""
        for name in names:
            self._launch(name)
        deadline = time.monotonic() + timeout_s
        for name in names:
            attempt = 1
            while _STARTED not in self.log(name):
                code = self._procs[name].poll()
                if code is not None and attempt < START_ATTEMPTS and time.monotonic() < deadline:
                    self.kill(name)  # what the failed start left running
                    (self.root / f"{name}.log").rename(self.root / f"{name}.failed-{attempt}.log")
                    attempt += 1
                    self._launch(name)
                    continue
                if code is not None:
                    raise RuntimeError(f"Ray node {name} ({self.nodes[name].address}) exited with code {code} while "
                                       f"starting ({attempt} attempts):\n{self.log(name)[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Ray node {name} ({self.nodes[name].address}) did not start within "
                                       f"{timeout_s:g} s:\n{self.log(name)[-3000:]}")
                time.sleep(0.2)

    def _launch(self, name: str) -> None:
        with (self.root / f"{name}.log").open("w") as log:
            # a session of its own: kill() reaches every process of the node, and nothing else
            self._procs[name] = subprocess.Popen(self._command(self.nodes[name]), stdout=log, stderr=subprocess.STDOUT,
                                                 env=self._env, start_new_session=True)
        (self.root / "sessions").write_text(" ".join(str(p.pid) for p in self._procs.values()))

    def log(self, name: str) -> str:
        """What node `name`'s `ray start` printed."""
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def pids(self, name: str) -> list[int]:
        """The live processes of node `name` (its session: `ray start`, raylet, agents, workers)."""
        proc = self._procs.get(name)
        if proc is None:
            return []
        sid = proc.pid  # (its processes keep the session after `ray start` itself exited)
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getsid(int(entry)) == sid:
                        out.append(int(entry))
                except (ProcessLookupError, PermissionError):
                    continue
        return out

    def kill(self, name: str) -> None:
        """SIGKILL every process of node `name`, at once (a machine lost: nothing says goodbye)."""
        proc = self._procs.get(name)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.pids(name):  # a process that left the group but not the session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)

    def restart(self, name: str, timeout_s: float = 300.0) -> None:
        """Node `name` again (after `kill`), with the same address and resources."""
        if name == self.head.name:
            raise ValueError("the head cannot be restarted (its GCS holds the cluster); start a new cluster")
        self.kill(name)
        self._start([name], timeout_s)

    def stop(self) -> None:
        """Every node, workers first, then the head; the temporary directory too if made here."""
        for name in [n for n in self._procs if n != self.head.name] + [self.head.name]:
            self.kill(name)
        self._procs.clear()
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

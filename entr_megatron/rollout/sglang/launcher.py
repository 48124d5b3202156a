"""Start and stop SGLang servers (and optionally an sglang-router in front of them).

    servers = launch_servers(
        [SGLangServerConfig("Qwen/Qwen3-8B", port=30000 + i, tp_size=2, base_gpu_id=2 * i, dtype="bfloat16")
         for i in range(4)],
        log_dir="runs/x/sglang",
    )
    router = launch_router(RouterConfig(worker_urls=tuple(s.url for s in servers), port=29999),
                           log_path="runs/x/sglang/router.log")
    ...
    router.terminate(); terminate_all(servers)

Each server is `python -m sglang.launch_server --model-path ... --tp-size ... --port ...
--dtype ... --mem-fraction-static ... [extra args]` in its own session (so terminating
it ends its scheduler and detokenizer children too), with stdout and stderr in one
log file. `wait_healthy` polls GET /health (503 while the server warms up) until 200,
and fails early with the log's tail when the process exits. Each
process also gets a watcher (`orphan_guard.py`) that stops its group should this process die
without terminating it (kill -9, the OOM killer). The flags were checked
against SGLang 0.5.23 (srt/arg_groups/fields/*.py: model_path, tp_size, port, host,
dtype choices, mem_fraction_static, base_gpu_id, weight_version, random_seed, api_key;
exec_.py: enable_return_routed_experts) and
sglang-router 0.3.2 (sglang_router/launch_router.py, router_args.py: --worker-urls,
--host, --port, --policy, --api-key). Nothing here imports sglang.

Network: servers and router listen on `host`, 127.0.0.1 unless configured. With
`api_key_env` the process gets `--api-key <the key>` appended to its own sys.argv by a
small Python shim (`API_KEY_SHIM`) that reads the variable, so the key is in no command
line (`ps`, /proc/<pid>/cmdline show the variable's name) and in no log: the process's
output reaches its log through a pipe that replaces the key by `REDACTED` (SGLang prints
its server args, the key among them, at start-up). A server checks the key on every
endpoint but /health*, /ready and /metrics; sglang-router 0.3.2's --api-key is the key it
sends to the workers (whether it checks its own clients' is the router's business: keep
it on loopback).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from entr_megatron.rollout.sglang import orphan_guard
from entr_megatron.rollout.sglang.client import SGLangClient, SGLangError, api_key_from_env
from entr_megatron.rollout.sglang.preflight import check_server
from entr_megatron.rollout.sglang.protocol import ROUTES_FLAG

__all__ = [
    "API_KEY_SHIM",
    "DTYPES",
    "REDACTED",
    "ROUTER_POLICIES",
    "ManagedProcess",
    "RouterConfig",
    "SGLangServerConfig",
    "launch_router",
    "launch_servers",
    "router_command",
    "server_command",
    "terminate_all",
]

logger = logging.getLogger(__name__)

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
"""--dtype choices of SGLang 0.5.23."""
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
"""--policy choices of sglang-router 0.3.2."""
LOG_TAIL_LINES = 40
"""Lines of a failed process's log quoted in the error."""
REDACTED = "<redacted>"
"""What the API key reads as in a process's log."""
API_KEY_SHIM = (
    "import os, runpy, sys; env, how, target, *args = sys.argv[1:]; "
    "sys.argv = [target, *args, '--api-key', os.environ[env]]; "
    "runpy.run_module(target, run_name='__main__', alter_sys=True) if how == '-m' else "
    "runpy.run_path(target, run_name='__main__')"
)
"""`python -c API_KEY_SHIM <variable> -m <module> | <script> <args...>`: runs the module (as
`python -m` would) or the script with `--api-key <value of the variable>` added to its sys.argv."""
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
"""A CPU server's environment: without it `--device cpu` is not taken as CPU (docs/SGLANG_ON_CPU.md)."""
CPU_FLAGS = ("--device", "cpu", "--skip-tokenizer-init", "--sleep-on-idle")
"""A CPU server's flags: token ids in and out (no tokenizer or detokenizer work); an idle scheduler
waits on its sockets instead of spinning (it took 70% of a core, idle, beside the learner)."""
PROGRESS_INTERVAL_S = 15.0
"""`wait_healthy` reports a server still starting this often."""
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Hosts that listen on every interface: clients on this node dial 127.0.0.1."""


def _client_url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"http://{host}:{port}"


def _with_api_key(cmd: list[str], api_key_env: str | None, what: str) -> list[str]:
    """`cmd` (python -m module ... or python script ...) run through `API_KEY_SHIM` when there is a key."""
    if api_key_env is None:
        return cmd
    if len(cmd) >= 3 and cmd[1] == "-m":
        return [cmd[0], "-c", API_KEY_SHIM, api_key_env, "-m", *cmd[2:]]
    if len(cmd) >= 2 and cmd[1].endswith(".py"):
        return [cmd[0], "-c", API_KEY_SHIM, api_key_env, "path", *cmd[1:]]
    raise ValueError(f"{what}.api_key_env needs a Python command (python -m <module> or python <script>.py) to hand the "
                     f"key over without a command line; got command_prefix {cmd[:2]}")


@dataclass(frozen=True)
class SGLangServerConfig:
    """One `sglang.launch_server` process."""

    model_path: str
    port: int = 30000
    host: str = "127.0.0.1"
    tp_size: int = 1
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights and KV cache; None: SGLang's default."""
    base_gpu_id: int | None = None
    """First GPU of this server (several servers on one node); None: SGLang's default (0)."""
    weight_version: str | None = "0"
    """Initial weight version label (SGLang's default is "default", which has no int value)."""
    random_seed: int | None = None
    return_routed_experts: bool = False
    """Start with --enable-return-routed-experts, so that answers carry MoE routes when asked
    (routing replay; only for MoE models: SGLang sizes its capture buffer from num_experts_per_tok)."""
    extra_args: tuple[str, ...] = ()
    """Passed through unchanged, e.g. ("--disable-radix-cache", "--sampling-mask-max-tokens", "8192")."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to this process's environment (e.g. CUDA_VISIBLE_DEVICES)."""
    command_prefix: tuple[str, ...] | None = None
    """None: (python, "-m", "sglang.launch_server"). Tests put a mock server here."""
    api_key_env: str | None = None
    """Environment variable holding the server's --api-key (see the module docstring); None: no key."""
    python: str | None = None
    """Interpreter that runs sglang.launch_server (a venv of its own); None: sys.executable."""
    device: str | None = None
    """"cpu": a CPU server (`CPU_ENV`, `CPU_FLAGS`, no --base-gpu-id); None: SGLang's default (CUDA)."""
    max_total_tokens: int | None = None
    """KV-cache tokens (--max-total-tokens); None: SGLang sizes it from mem_fraction_static."""

    def __post_init__(self):
        if self.device not in (None, "cpu"):
            raise ValueError(f"SGLangServerConfig.device must be None (GPU) or 'cpu', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"SGLangServerConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.tp_size < 1:
            raise ValueError(f"SGLangServerConfig.tp_size must be >= 1, got {self.tp_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"SGLangServerConfig.port must be in 1..65535, got {self.port}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"SGLangServerConfig.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    @property
    def url(self) -> str:
        return _client_url(self.host, self.port)

    @property
    def process_env(self) -> dict[str, str]:
        """What the server's process gets on top of this one's environment."""
        return {**(CPU_ENV if self.device == "cpu" else {}), **self.env}


def server_command(config: SGLangServerConfig) -> list[str]:
    """The argv of one server (through `API_KEY_SHIM` with an api_key_env: no key in it)."""
    c = config
    cmd = list(c.command_prefix or (c.python or sys.executable, "-m", "sglang.launch_server"))
    cmd += ["--model-path", c.model_path, "--host", c.host, "--port", str(c.port), "--tp-size", str(c.tp_size), "--dtype", c.dtype]
    if c.device == "cpu":
        cmd += CPU_FLAGS
    if c.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(c.max_total_tokens)]
    if c.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
    if c.base_gpu_id is not None and c.device != "cpu":  # on CPU SGLang takes it for a NUMA node
        cmd += ["--base-gpu-id", str(c.base_gpu_id)]
    if c.weight_version is not None:
        cmd += ["--weight-version", str(c.weight_version)]
    if c.random_seed is not None:
        cmd += ["--random-seed", str(c.random_seed)]
    if c.return_routed_experts:
        cmd.append(ROUTES_FLAG)
    return _with_api_key(cmd + list(c.extra_args), c.api_key_env, "SGLangServerConfig")


@dataclass(frozen=True)
class RouterConfig:
    """One `sglang_router.launch_router` process in front of `worker_urls`."""

    worker_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 29999
    policy: str = "cache_aware"
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    command_prefix: tuple[str, ...] | None = None
    """None: (sys.executable, "-m", "sglang_router.launch_router")."""
    api_key_env: str | None = None
    """Environment variable holding the workers' API key (the router's --api-key); None: no key."""

    def __post_init__(self):
        if not self.worker_urls:
            raise ValueError("RouterConfig.worker_urls is empty")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"RouterConfig.policy must be one of {ROUTER_POLICIES}, got {self.policy!r}")

    @property
    def url(self) -> str:
        return _client_url(self.host, self.port)


def router_command(config: RouterConfig) -> list[str]:
    """The argv of the router (through `API_KEY_SHIM` with an api_key_env: no key in it)."""
    cmd = list(config.command_prefix or (sys.executable, "-m", "sglang_router.launch_router"))
    cmd += ["--worker-urls", *config.worker_urls, "--host", config.host, "--port", str(config.port), "--policy", config.policy]
    return _with_api_key(cmd + list(config.extra_args), config.api_key_env, "RouterConfig")


class ManagedProcess:
    """A server process in its own session, logging to one file. With an `api_key` (the key the
    process was handed through its environment) its output goes through a pipe that replaces
    the key by `REDACTED` on its way to the log, and the health checks send it."""

    def __init__(self, name: str, argv: Sequence[str], url: str, log_path: str | os.PathLike,
                 env: Mapping[str, str] | None = None, *, api_key: str | None = None):
        self.name, self.argv, self.url = name, list(argv), url
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._api_key = api_key
        self._pump: threading.Thread | None = None
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, stdout=log if api_key is None else subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, start_new_session=True,
            )
        if api_key is not None:
            self._pump = threading.Thread(target=_copy_redacted, args=(self.proc.stdout, self.log_path, api_key),
                                          name=f"log {name}", daemon=True)
            self._pump.start()
        self._guard = _start_orphan_guard(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(collections.deque(f, maxlen=lines))
        except OSError as e:
            return f"(log unreadable: {e})"

    def wait_healthy(self, timeout_s: float, path: str = "/health", interval_s: float = 1.0,
                     progress: Callable[[str], None] | None = None) -> None:
        """Poll `path` until it answers 200; raise (with the log's tail) on exit or timeout.
        `progress(line)` is told every PROGRESS_INTERVAL_S that the server is still starting."""
        client = SGLangClient(self.url, api_key=self._api_key)
        start = time.monotonic()
        deadline, report = start + timeout_s, start + PROGRESS_INTERVAL_S
        while True:
            if not self.alive():
                self._flush_log()
                err = SGLangError(f"{self.name} exited with code {self.proc.returncode} before it was healthy", url=self.url)
                err.add_note(f"log {self.log_path}, last lines:\n{self.log_tail()}")
                raise err
            left = deadline - time.monotonic()
            if client.is_healthy(timeout=max(0.1, min(30.0, left)), path=path, retries=0):  # this loop retries
                return
            if time.monotonic() >= deadline:
                err = SGLangError(f"{self.name} not healthy after {timeout_s:.0f} s ({self.url}{path})", url=self.url)
                err.add_note(f"log {self.log_path}, last lines:\n{self.log_tail()}")
                raise err
            if progress is not None and time.monotonic() >= report:
                report += PROGRESS_INTERVAL_S
                last = next((line.strip() for line in reversed(self.log_tail(5).splitlines()) if line.strip()), "")
                progress(f"{self.name} still starting after {time.monotonic() - start:.0f} s (on CPU mostly importing "
                         f"sglang, 60-100 s on 2 cores); its log says: {last[-120:]}")
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))

    def terminate(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code. Idempotent."""
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        # Children that outlive the leader (scheduler, detokenizer) share its session.
        self._signal(signal.SIGKILL)
        self._flush_log()
        if self._guard is not None and self._guard.poll() is None:  # it would see the group gone within 1 s
            self._guard.kill()
            self._guard.wait(10)
        return self.proc.returncode

    def _flush_log(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until the redacting pipe has written what the exited process printed."""
        if self._pump is not None and not self.alive():
            self._pump.join(timeout_s)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the group this process leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def _start_orphan_guard(pgid: int) -> subprocess.Popen | None:
    """The watcher that stops the group `pgid` if this process dies without terminating it
    (orphan_guard.py); None, with a warning, where /proc cannot tell this process's start time."""
    start = orphan_guard.start_time(os.getpid())
    if start is None:
        logger.warning("no /proc/self/stat: launched servers will outlive this process if it is killed")
        return None
    return subprocess.Popen([sys.executable, "-I", orphan_guard.__file__, str(os.getpid()), start, str(pgid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _copy_redacted(stream, log_path: Path, secret: str) -> None:
    """Copy a process's output to its log, line by line, with `secret` replaced (a pump thread)."""
    # As printed, and inside a repr (SGLang logs its ServerArgs dataclass).
    needles = {secret.encode(), repr(secret)[1:-1].encode()}
    mask = REDACTED.encode()
    with stream, open(log_path, "ab", buffering=0) as log:
        for line in iter(stream.readline, b""):
            for needle in needles:
                line = line.replace(needle, mask)
            try:
                log.write(line)
            except OSError:  # a full disk: keep draining, or the process blocks on its next print
                pass


def launch_servers(
    configs: Sequence[SGLangServerConfig], log_dir: str | os.PathLike, startup_timeout_s: float = 1800.0,
    interval_s: float = 2.0, progress: Callable[[str], None] | None = None,
) -> list[ManagedProcess]:
    """Start every server at once, then wait for all to be healthy; on any failure stop them all
    and raise (the error quotes the failed server's log). Logs: log_dir/sglang-<port>.log. Before
    any start, what can fail at once fails at once (`preflight.check_server`: the interpreter, the
    port, the model directory); `progress` hears from servers still starting (`wait_healthy`)."""
    ports = [c.port for c in configs]
    if len(set(ports)) != len(ports):
        raise ValueError(f"two servers on one port: {ports}")
    keys = [api_key_from_env(c.api_key_env, "SGLangServerConfig.api_key_env") for c in configs]  # before any start
    for c in configs:
        check_server(c.command_prefix is None, c.python or sys.executable, c.host, c.port, c.model_path)
    servers: list[ManagedProcess] = []
    try:
        for c, key in zip(configs, keys):
            log = Path(log_dir) / f"sglang-{c.port}.log"
            servers.append(ManagedProcess(f"sglang server :{c.port}", server_command(c), c.url, log, c.process_env,
                                          api_key=key))
        deadline = time.monotonic() + startup_timeout_s
        for s in servers:
            s.wait_healthy(max(1.0, deadline - time.monotonic()), interval_s=interval_s, progress=progress)
        return servers
    except BaseException:
        terminate_all(servers)
        raise


def launch_router(
    config: RouterConfig, log_path: str | os.PathLike, startup_timeout_s: float = 300.0, interval_s: float = 1.0,
) -> ManagedProcess:
    """Start the router and wait for its /health."""
    key = api_key_from_env(config.api_key_env, "RouterConfig.api_key_env")
    router = ManagedProcess(f"sglang-router :{config.port}", router_command(config), config.url, log_path, config.env,
                            api_key=key)
    try:
        router.wait_healthy(startup_timeout_s, interval_s=interval_s)
    except BaseException:
        router.terminate()
        raise
    return router


def terminate_all(processes: Sequence[ManagedProcess], grace_s: float = 30.0) -> None:
    """SIGTERM all at once, then reap each (SIGKILL after the grace period)."""
    for p in processes:
        if p.alive():
            p._signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.terminate(max(0.0, deadline - time.monotonic()))

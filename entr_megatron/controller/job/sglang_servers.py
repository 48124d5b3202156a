"""The SGLang servers of a training run, kept in service while it runs.

    servers = start_servers(cfg, model_dir, stack, log_dir)      # launched here, or rollout.sglang.urls
    engines = servers.engine_set()                               # EngineSet: one SGLangEngine per server
    servers.connect_weights(group, address, port, range(len(servers.urls)), fresh=True)  # rank 0's weight group
    recovery = ServerRecovery(cfg, servers, engines, pusher, address, stack)     # the controller's `recovery`

The controller generates through an `EngineSet` of one `SGLangEngine` per server (without a router),
so that a server's failure is its own: its requests are lost, the others keep generating. When a
call to a server fails, a push does not arrive within rollout.push_timeout_s, or no sample comes
for rollout.poll_timeout_s, `ServerRecovery.failed` asks every server in service for
/model_info (rollout.sglang.request_timeout_s, http_retries); those that do not answer (or whose
process exited) are handled by `replace`:

| server                       | what happens                                                                     |
|------------------------------|----------------------------------------------------------------------------------|
| launched by `train`          | its process group killed, a new server started on the same port (its log appended), counted in `engines/restarts` (at most rollout.max_engine_restarts) |
| given by rollout.sglang.urls | set aside (not ours to restart); its /health probed with backoff (rollout.sglang.probe_interval_s, doubled up to PROBE_MAX_INTERVAL_S) and, once it answers, taken back between two steps (`readmit`) with the learner's weights |
| none left in service         | wait up to rollout.sglang.server_wait_s for one to answer again, then stop naming each server and its error (RestartsExhausted) |

After each change the weight-update group is rebuilt over the servers in service: they are paused
(retract), their weight version relabelled -1 (learner rank 0's engine requires one version on every
server and a newer one from the learner), the old group left, learner rank 0 reconnected on a fresh
port, and the learner's version pushed to all of them (SGLang loads each bucket as it arrives, so
after a broken update every server gets the whole version again). The controller then resubmits the
groups that were lost (loop.py `Controller.recover`). With sglang-router in front there is one engine
over the router and no recovery (the router holds its own list of workers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entr_megatron.config.run import RunConfig
from entr_megatron.controller.job.sglang_setup import check_launch, model_vocab_size, route_layout, sglang_wire_dtype
from entr_megatron.controller.ranks.learner_worker import LearnerWorker
from entr_megatron.controller.rl.engines import EngineSet, RestartsExhausted
from entr_megatron.controller.rl.interfaces import Recovery
from entr_megatron.rollout.sglang import (
    ManagedProcess,
    SGLangClient,
    SGLangEngine,
    SGLangEngineConfig,
    SGLangError,
    SGLangServerConfig,
)
from entr_megatron.utils.console import say
from entr_megatron.utils.spawn import free_port

__all__ = ["PROBE_MAX_INTERVAL_S", "SGLangServers", "ServerRecovery", "server_configs", "sglang_engine", "start_servers"]

PROBE_MAX_INTERVAL_S = 60.0
"""Longest wait between two /health probes of a server given by URL that dropped out."""
NO_PREFIX_CACHE = "--disable-radix-cache"
"""Given to servers launched for kv_on_update 'keep': a weight update paused in place cannot flush
SGLang's prefix cache (it refuses while requests run), so new requests would reuse prompt KV computed
by older weights under the new version's label (seen on a real server: a new request's first token
came from the previous version). Without it each request computes its prompt with the weights it
is labelled with, as the embedded engine's new requests do."""
RELAUNCH_GRACE_S = 5.0
"""A failed launched server's process group gets this long after SIGTERM before SIGKILL."""


@dataclass
class SGLangServers:
    """The run's servers: their URLs and, for those launched here, their processes and launch
    configs; how to build an engine over one or over several of them."""

    cfg: RunConfig
    urls: list[str]
    engine_kwargs: dict[str, Any]
    """SGLangEngineConfig.from_config's keyword arguments (weight dtype, routes, vocab size)."""
    launch: list[SGLangServerConfig | None] = field(default_factory=list)
    """Per server: how it was launched here; None: given by URL."""
    processes: list[ManagedProcess | None] = field(default_factory=list)
    log_dir: Path | None = None
    router_url: str | None = None

    def tp_sizes(self, indices: Sequence[int]) -> tuple[int, ...] | None:
        """Known when launched here; None: each server is asked (/server_info)."""
        sizes = [None if self.launch[i] is None else self.launch[i].tp_size for i in indices]
        return None if None in sizes else tuple(sizes)

    def engine_config(self, indices: Sequence[int], **overrides: Any) -> SGLangEngineConfig:
        """An engine over the servers `indices` (no router)."""
        return SGLangEngineConfig.from_config(self.cfg.rollout, [self.urls[i] for i in indices],
                                              tp_sizes=self.tp_sizes(indices), mode=self.cfg.controller.mode,
                                              **{**self.engine_kwargs, **overrides})

    def one_engine(self) -> SGLangEngine:
        """One engine over every server, or over the router in front of them (`make_engines`)."""
        indices = range(len(self.urls))
        return SGLangEngine(self.engine_config(indices, router_url=self.router_url))

    def engine_set(self) -> EngineSet:
        """One engine per server: a server's failure is its own (module docstring)."""
        return EngineSet([SGLangEngine(self.engine_config([i])) for i in range(len(self.urls))])

    def client(self, index: int) -> SGLangClient:
        from entr_megatron.rollout.sglang.client import api_key_from_env

        s = self.cfg.rollout.sglang
        return SGLangClient(self.urls[index], s.request_timeout_s, api_key=api_key_from_env(s.api_key_env),
                            retries=s.http_retries, retry_backoff_s=s.retry_backoff_s)

    def connect_weights(self, group: Any, address: str, port: int, indices: Sequence[int], fresh: bool = False) -> None:
        """Learner rank 0's weight-update group over the servers `indices`, on `port` (with
        rollout.placement colocated no group: the servers read rank 0's shared memory). Not `fresh`
        (a rebuild): each leaves the old group and has its version relabelled -1 first (module
        docstring), so that the learner's next push reaches them all."""
        if not fresh:
            for i in indices:
                client = self.client(i)
                try:
                    client.destroy_weights_update_group()
                except SGLangError:
                    pass  # not in one (a relaunched server), or it left with a dead learner
                client.update_weight_version("-1", abort_all_requests=False)
        r = self.cfg.rollout
        group.call(LearnerWorker.connect_weight_sync, address, port, (), r.weight_bucket_bytes, None,
                   sglang=self.engine_config(indices), snapshot=r.weight_snapshot, placement=r.placement)

    def relaunch(self, index: int) -> None:
        """Kill launched server `index` (its whole process group) and start it again on its port,
        its log appended; raises SGLangError (with the log's tail) when it does not come up."""
        from entr_megatron.rollout.sglang import launch_servers

        old = self.processes[index]
        if old is not None:
            old.terminate(grace_s=RELAUNCH_GRACE_S)
        [self.processes[index]] = launch_servers([self.launch[index]], self.log_dir,
                                                 startup_timeout_s=self.cfg.rollout.sglang.startup_timeout_s, progress=say)

    def terminate(self) -> None:
        """Stop the servers launched here (at the end of the job)."""
        from entr_megatron.rollout.sglang import terminate_all

        terminate_all([p for p in self.processes if p is not None])


def sglang_engine(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None) -> SGLangEngine:
    """One SGLangEngine over the run's servers (launched here on `rollout.sglang.host`, with a router
    when asked, or given by `rollout.sglang.urls`: `start_servers`); their shutdown on `stack`.
    With `rollout.sglang.api_key_env` the servers, the router and every client get the key.
    Recording routes (`RunConfig.records_routes`) of an MoE model, the servers launched here get
    --enable-return-routed-experts and the engine asks for the routes (sglang_setup.route_layout)."""
    engine = start_servers(cfg, model_dir, stack, log_dir).one_engine()
    stack.callback(engine.shutdown)
    return engine


def start_servers(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None,
                  threads: int | None = None) -> SGLangServers:
    """The run's servers: launched here on `rollout.sglang.host` (with a router when asked) or
    given by `rollout.sglang.urls`; their shutdown on `stack` (see `sglang_engine`). `threads`:
    OpenMP threads of each server launched on the CPU (None: torch's default, every core)."""
    from entr_megatron.rollout.sglang import RouterConfig, launch_router, launch_servers

    r, s = cfg.rollout, cfg.rollout.sglang
    log_dir = Path(log_dir) if log_dir is not None else Path(cfg.logging.run_dir) / "sglang"
    routes = route_layout(model_dir) if cfg.records_routes else None
    kwargs = dict(weight_dtype=sglang_wire_dtype(cfg), routes=routes, vocab_size=model_vocab_size(model_dir))
    if s.urls is None:
        check_launch(cfg)
        configs = server_configs(cfg, model_dir, routes is not None, threads)
        where = "on the CPU" if configs[0].device == "cpu" else f"tp {s.tp_size}"
        say(f"launching {len(configs)} SGLang server(s) ({where}, ports {s.base_port}.., "
            f"{configs[0].python or 'this interpreter'}), logs in {log_dir}")
        servers = SGLangServers(cfg, [c.url for c in configs], kwargs, list(configs), [], log_dir)
        stack.callback(servers.terminate)
        servers.processes = list(launch_servers(configs, log_dir, startup_timeout_s=s.startup_timeout_s, progress=say))
    else:
        servers = SGLangServers(cfg, list(s.urls), kwargs, [None] * len(s.urls), [None] * len(s.urls), log_dir)
        check_prefix_caches(cfg, servers)
    if s.router:
        router = launch_router(RouterConfig(worker_urls=tuple(servers.urls), host=s.host, port=free_port(),
                                            policy=s.router_policy, api_key_env=s.api_key_env),
                               log_dir / "router.log")
        stack.callback(router.terminate)
        servers.router_url = router.url
    return servers


def server_configs(cfg: RunConfig, model_dir: Path, routes: bool, threads: int | None = None) -> list[SGLangServerConfig]:
    """How `train` launches its servers: on the GPUs after the local learner ranks' (which hold GPUs
    0 .. nproc_per_node - 1), or on this node's CPU with launcher.device 'cpu' (docs/SGLANG_ON_CPU.md:
    CPU flags, max_total_tokens bounded, `threads` OpenMP threads each (wiring.cpu_threads: an
    embedded engine's share), gloo on loopback). With kv_on_update 'keep' they run without the
    prefix cache (`NO_PREFIX_CACHE`)."""
    from entr_megatron.config.rollout import CPU_MAX_TOTAL_TOKENS
    from entr_megatron.utils.spawn import is_loopback

    r, s = cfg.rollout, cfg.rollout.sglang
    cpu = cfg.launcher.device == "cpu"
    env: dict[str, str] = {}
    if cpu:
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        if is_loopback(s.host):  # the weight group's gloo pairs on the server's side, as ours (weight_sync/group.py)
            env["GLOO_SOCKET_IFNAME"] = "lo"
    total = s.max_total_tokens if s.max_total_tokens is not None or not cpu else CPU_MAX_TOTAL_TOKENS
    extra = tuple(s.extra_args)
    if (r.kv_on_update or "recompute") == "keep" and NO_PREFIX_CACHE not in extra:
        extra += (NO_PREFIX_CACHE,)
    first_gpu = cfg.launcher.nproc_per_node
    return [SGLangServerConfig(str(model_dir), port=s.base_port + i, host=s.host, tp_size=s.tp_size, dtype=r.dtype,
                               mem_fraction_static=s.mem_fraction_static,
                               base_gpu_id=None if cpu else first_gpu + i * s.tp_size,
                               random_seed=cfg.controller.seed + i, return_routed_experts=routes,
                               extra_args=extra, api_key_env=s.api_key_env, env=env,
                               python=None if s.python is None else str(Path(s.python).absolute()),
                               device="cpu" if cpu else None, max_total_tokens=total)
            for i in range(r.num_engines)]


def check_prefix_caches(cfg: RunConfig, servers: SGLangServers) -> None:
    """With kv_on_update 'keep', servers given by URL must run without the prefix cache (NO_PREFIX_CACHE:
    a push paused in place would leave old weights' prompt KV to new requests). Asked of /server_info."""
    if (cfg.rollout.kv_on_update or "recompute") != "keep":
        return
    for i, url in enumerate(servers.urls):
        if not servers.client(i).server_info().get("disable_radix_cache", False):
            raise ValueError(
                f"rollout.kv_on_update='keep' needs SGLang servers without the prefix cache, and {url} "
                f"(rollout.sglang.urls) has it: restart it with {NO_PREFIX_CACHE}, or set rollout.kv_on_update="
                "'recompute' (a weight update paused in place cannot flush it, so new requests would reuse prompt "
                "KV computed by older weights)")


class _Prober(threading.Thread):
    """Asks a server's /health until it answers 200, waiting `interval_s`, then twice as long, ...
    (at most PROBE_MAX_INTERVAL_S) between two tries."""

    def __init__(self, client: SGLangClient, interval_s: float, timeout_s: float):
        super().__init__(name=f"probe {client.url}", daemon=True)
        self.client, self.interval_s, self.timeout_s = client, interval_s, timeout_s
        self.answered = threading.Event()
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        wait = self.interval_s
        while not self.stopped.wait(wait):
            if self.client.is_healthy(timeout=self.timeout_s, retries=0):
                self.answered.set()
                return
            wait = min(2 * wait, PROBE_MAX_INTERVAL_S)


class ServerRecovery(Recovery):
    """The `recovery` of a run's SGLang servers (see the module docstring); the controller calls
    `failed`, `replace` and, between steps, `returned` / `readmit`."""

    def __init__(self, cfg: RunConfig, servers: SGLangServers, engines: EngineSet, pusher: Any, address: str,
                 stack: ExitStack):
        super().__init__()
        self.cfg, self.servers, self.engines, self.pusher, self.address = cfg, servers, engines, pusher, address
        self.out: dict[int, _Prober] = {}
        """Servers given by URL that dropped out, probed until they answer."""
        stack.callback(self.close)

    def in_service(self) -> list[int]:
        return [i for i in range(len(self.servers.urls)) if i not in self.out]

    def out_of_service(self) -> int:
        return len(self.out)

    def noticed(self) -> bool:
        return bool(self.engines.failed)

    def failed(self) -> list[tuple[int, str]]:
        """Servers in service whose process exited or that do not answer /model_info (a launched
        one that does not is killed now)."""
        out = []
        for index in self.in_service():
            process = self.servers.processes[index]
            if process is not None and not process.alive():
                out.append((index, f"the server process exited (exit code {process.proc.returncode}); last lines of "
                                   f"{process.log_path}:\n{process.log_tail(10)}"))
                continue
            health = self.engines.engines[index].health()
            if not health.alive:
                if process is not None:
                    process.terminate(grace_s=0)
                out.append((index, health.error or self.engines.failed.get(index) or "not alive"))
        return out

    def replace(self, failed: list[tuple[int, str]], version: int, pending_push: Any = None) -> None:
        """Relaunch the failed servers launched here, set aside those given by URL, rebuild the
        weight group over the servers in service and push `version` to them. Raises
        RestartsExhausted past rollout.max_engine_restarts, or when no server is left for
        rollout.sglang.server_wait_s."""
        limit = self.cfg.rollout.max_engine_restarts
        ours = [(i, e) for i, e in failed if self.servers.launch[i] is not None]
        if ours and self.restarts + len(ours) > limit:
            index, error = ours[0]
            raise RestartsExhausted(f"SGLang server {self.servers.urls[index]} failed, and {self.restarts} server(s) "
                                    f"were already relaunched in this job (rollout.max_engine_restarts={limit}); "
                                    f"its last error:\n{error}")
        if pending_push is not None and hasattr(pending_push, "abandon"):
            pending_push.abandon()
        for index, error in failed:
            url, why = self.servers.urls[index], _first_line(error)
            self.engines.engines[index].shutdown()
            if self.servers.launch[index] is not None:
                self.restarts += 1  # counted before it starts: a server that never comes up spends the budget
                say(f"SGLang server {url} failed ({why}): relaunching it (relaunch {self.restarts} of at most {limit})")
                self.servers.relaunch(index)
                self.engines.replace(index, SGLangEngine(self.servers.engine_config([index])))
            else:
                s = self.cfg.rollout.sglang
                say(f"SGLang server {url} (rollout.sglang.urls) failed ({why}): going on without it, probing "
                    f"its /health every {s.probe_interval_s:g} s and more (it is taken back when it answers)")
                self.engines.park(index)
                self.out[index] = _Prober(self.servers.client(index), s.probe_interval_s, s.request_timeout_s)
        if not self.in_service():
            self._wait_for_one(failed)
        self._rebuild(version)

    def returned(self) -> bool:
        """Whether a server that dropped out answers again (`readmit` takes it back)."""
        return any(p.answered.is_set() for p in self.out.values())

    def readmit(self, version: int) -> None:
        """Take back the servers that answer again: the weight group rebuilt, `version` pushed."""
        if self._take_back(f" at weight version {version}"):
            self._rebuild(version)

    def _take_back(self, when: str = "") -> list[int]:
        back = [i for i, p in self.out.items() if p.answered.is_set()]
        for index in back:
            del self.out[index]
            self.engines.replace(index, SGLangEngine(self.servers.engine_config([index])))
            say(f"SGLang server {self.servers.urls[index]} answers again: taken back{when}")
        return back

    def _wait_for_one(self, failed: list[tuple[int, str]]) -> None:
        """No server in service: until one that dropped out answers, at most rollout.sglang.server_wait_s."""
        wait_s = self.cfg.rollout.sglang.server_wait_s
        say(f"no SGLang server left in service: waiting up to {wait_s:g} s (rollout.sglang.server_wait_s) "
            "for one to answer again")
        deadline = time.monotonic() + wait_s
        while not self.returned():
            if time.monotonic() >= deadline:
                errors = "\n".join(f"  {self.servers.urls[i]}: {_first_line(e)}" for i, e in failed)
                raise RestartsExhausted(f"every SGLang server stopped answering, and none answered /health within "
                                        f"{wait_s:g} s (rollout.sglang.server_wait_s):\n{errors}\nstart them again "
                                        "(or fix rollout.sglang.urls) and rerun: the run resumes from its last "
                                        "checkpoint")
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        self._take_back()

    def _rebuild(self, version: int) -> None:
        """The weight group over the servers in service, paused meanwhile; `version` pushed to them."""
        indices = self.in_service()
        for i in indices:
            self.engines.engines[i].pause()
        self.servers.connect_weights(self.pusher.group, self.address, free_port(), indices)
        self.pusher.push(version).wait()  # rank 0's engine pauses and resumes them itself
        for i in indices:
            self.engines.engines[i].resume()

    def close(self) -> None:
        for prober in self.out.values():
            prober.stopped.set()


def _first_line(error: str) -> str:
    """An SGLang error's message (its notes, the server's answer among them, follow it)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[0] if lines else "no error given"


def reconnect_sglang(cfg: RunConfig, group: Any, address: str, port: int, view: Any, old: Any) -> Any:
    """Relaunched learner ranks (wiring.relaunch_learner) to the servers in service: the weight group
    rebuilt (versions relabelled -1), and the controller's view told so, so that the checkpoint's
    weights are pushed first whatever the servers held."""
    from entr_megatron.controller.ranks.remote import RemotePusher

    recovery = old.recovery
    servers: SGLangServers = view.servers
    indices = recovery.in_service() if recovery is not None else list(range(len(servers.urls)))
    servers.connect_weights(group, address, port, indices)
    view.reset_version(-1)
    pusher = RemotePusher(group, on_delivered=view.confirm_version, push_timeout_s=cfg.rollout.push_timeout_s)
    pusher.recovery = recovery
    if recovery is not None:
        recovery.pusher = pusher
    return pusher

"""The processes of a run and how they are connected, per engine kind.

    engine, learner, pusher = connect(cfg, model_dir, stack, log_dir)   # all stopped by `stack`
    Controller(engine, learner, pusher, task, options)

| rollout.engine | engine (the controller generates with it)  | pusher (RemotePusher): how the weights get there          |
|----------------|--------------------------------------------|-----------------------------------------------------------|
| embedded       | an EngineSet of them (Ray: when several)   | stage broadcast groups; a receiver thread per engine here |
| sglang         | PushedVersionView over an EngineSet of one | none here: rank 0's SGLangTransport updates the servers   |
|                | SGLangEngine per server (a router: one)    |                                                           |

The learner (RemoteLearner) and the pusher are two roles of the same learner ranks (one worker group).

Embedded engines can be replaced while the job runs, local processes and Ray actors
(controller/ranks/ray_engine.py) alike: `pusher.recovery` (an `EngineRecovery`) finds the engines that
died or stopped answering, starts new ones in their place, rebuilds the broadcast groups on a
fresh port and pushes the learner's weights (the controller resubmits the groups that were lost:
controller/rl/loop.py `Controller.recover`).
SGLang servers have theirs (`ServerRecovery`, sglang_servers.py: relaunched when launched here,
set aside and probed when given by URL).

Failed learner ranks are replaced with the engines kept (`relaunch_learner`, called by
controller/job/run.py up to launcher.max_restarts times): new ranks, new weight groups with the
running engines, and the engines told that the next version may be older than theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

from entr_megatron.config.controller import SEQUENTIAL_MODES
from entr_megatron.config.run import RunConfig
from entr_megatron.controller.job.sglang_servers import ServerRecovery, reconnect_sglang, sglang_engine, start_servers
from entr_megatron.controller.job.sglang_setup import PushedVersionView, forget_server_versions
from entr_megatron.controller.ranks.learner_worker import LearnerWorker, LearnerWorkerSpec, make_learner_worker
from entr_megatron.controller.ranks.ray_workers import RayWorkerGroup, node_lost
from entr_megatron.controller.ranks.remote import RemoteLearner, RemotePusher
from entr_megatron.controller.ranks.workers import ProcessWorkerGroup, WorkerGroup
from entr_megatron.controller.rl.engines import EngineSet, RestartsExhausted
from entr_megatron.controller.rl.interfaces import ABANDON_TIMEOUT_S, Recovery
from entr_megatron.rollout.engine import RolloutEngine
from entr_megatron.utils.console import say
from entr_megatron.utils.ray_connect import connect_ray
from entr_megatron.utils.spawn import available_cores

__all__ = ["CONNECTORS", "EngineRecovery", "connect", "connect_embedded", "connect_sglang", "embedded_engine",
           "learner_group", "make_engines", "with_episodes"]

Connection = tuple[RolloutEngine, RemoteLearner, RemotePusher]


def with_episodes(cfg: RunConfig, task: Any, engine: RolloutEngine) -> RolloutEngine:
    """`engine` itself for a single-turn task; for a multi-turn one (config.task.MULTI_TURN_TASKS) an
    `EpisodeEngine` over it, whose samples are whole tool episodes within `rollout.agent`'s budgets."""
    from entr_megatron.config.task import MULTI_TURN_TASKS
    from entr_megatron.rollout.episodes import EpisodeBudgets, EpisodeEngine

    if cfg.task.name not in MULTI_TURN_TASKS:
        return engine
    a = cfg.rollout.agent
    return EpisodeEngine(engine, task.new_environment,
                         EpisodeBudgets(a.max_turns, a.max_turn_tokens, a.max_response_tokens), a.tool_workers)


def connect(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> Connection:
    """Starts the engines and the learner ranks from `model_dir` and connects the weight path
    between them; their shutdown (and that of servers launched here) on `stack`."""
    say(f"starting {cfg.rollout.num_engines} {cfg.rollout.engine} engine(s) and "
        f"{cfg.launcher.world_size} learner rank(s) ({cfg.launcher.kind})")
    return CONNECTORS[cfg.rollout.engine](cfg, model_dir, stack, log_dir)


def connect_embedded(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> Connection:
    """Embedded engines: each receives the buckets of every pipeline stage's broadcast group.
    They sit in an `EngineSet` (even one) that `pusher.recovery` can mend (processes or Ray actors)."""
    group, engines = _start_with_learner(cfg, model_dir, stack, lambda: make_engines(cfg, model_dir, stack, log_dir))
    address, base_port = _meeting_point(cfg, group)
    pusher = RemotePusher(group, push_timeout_s=cfg.rollout.push_timeout_s)
    _connect_weights(cfg, pusher, address, base_port, engines)
    engine_set = EngineSet(engines)
    pusher.recovery = EngineRecovery(cfg, model_dir, stack, engine_set, pusher, address)
    return engine_set, RemoteLearner(group), pusher


def _connect_weights(cfg: RunConfig, pusher: RemotePusher, address: str, base_port: int,
                     engines: list[RolloutEngine]) -> None:
    """The learner ranks' weight sync and the pusher's receivers: broadcast groups between the
    learner's stage senders and `engines`, stage p on base_port + p."""
    from entr_megatron.weight_sync import ColocatedReceiver, receiver_for, stage_groups

    colocated = cfg.rollout.placement == "colocated"  # control messages only: gloo, even beside a GPU learner
    wgroups = stage_groups(address, base_port, pp_size=cfg.parallel.pp, engine_ranks=(1,) * len(engines),
                           backend="gloo" if colocated else None)
    wire_dtype = None if cfg.rollout.dtype == cfg.model.dtype else cfg.rollout.dtype
    timeout = cfg.rollout.push_timeout_s  # also gloo's: a stopped member cannot hold the senders longer
    pusher.group.call(LearnerWorker.connect_weight_sync, address, base_port, (1,) * len(engines),
                      cfg.rollout.weight_bucket_bytes, wire_dtype, timeout_s=timeout,
                      snapshot=cfg.rollout.weight_snapshot, placement=cfg.rollout.placement)
    pusher.engines = list(engines)
    receivers = [receiver_for(wgroups, i, timeout_s=timeout) for i in range(len(engines))]
    if colocated:  # the same groups and ranks; the bytes land in the engines' shared staging copies
        receivers = [ColocatedReceiver(r.groups, r.rank, r.timeout_s) for r in receivers]
    pusher.receivers = receivers


DEAD_NODE_WAIT_S = 60.0
"""Longest wait for Ray to call an unanswering engine node dead before its replacement is placed
(Ray's own health checks: seconds to half a minute, ray_nodes.FAST_FAILURE_ENV on the loopback cluster)."""


class EngineRecovery(Recovery):
    """Replaces the embedded engines of an `EngineSet` that died or stopped answering.

        failed = recovery.failed()                 # [(index, error)]: health-checked, the silent ones SIGKILLed
        recovery.replace(failed, version, push)    # new engines at `version`, weight groups rebuilt

    The engines are local processes (`EmbeddedEngine`) or, with launcher.kind 'ray', Ray actors
    (`RayEngine`: a dead actor fails its calls, a silent one its health check; `kill` is Ray's).
    A new engine starts from the run's start model (the engine config of the one it replaces)
    and gets the learner's weights as `version` over a new group of the engines below it; then
    the groups of every engine are rebuilt once more on a fresh port (a member that died breaks a
    gloo group for all of its members). At most `rollout.max_engine_restarts` replacements per job."""

    def __init__(self, cfg: RunConfig, model_dir: Path, stack: ExitStack, engines: EngineSet, pusher: RemotePusher,
                 address: str):
        super().__init__()
        self.cfg, self.model_dir, self.stack = cfg, model_dir, stack
        self.engines, self.pusher, self.address = engines, pusher, address

    def noticed(self) -> bool:
        return bool(self.engines.failed)

    def failed(self) -> list[tuple[int, str]]:
        """The engines that are dead or did not answer a health check within
        `rollout.embedded.health_timeout_s` (those are SIGKILLed now), with their last error."""
        out = []
        for index, engine in enumerate(self.engines.engines):
            health = engine.health(timeout_s=self.cfg.rollout.embedded.health_timeout_s)
            if not health.alive:
                engine.kill()
                out.append((index, health.error or self.engines.failed.get(index) or "not alive"))
        return out

    def replace(self, failed: list[tuple[int, str]], version: int, pending_push=None) -> None:
        """New engines in place of `failed`, all engines at the learner's `version` afterwards.
        Raises RestartsExhausted past `rollout.max_engine_restarts`; EngineError when an engine
        fails meanwhile."""
        limit = self.cfg.rollout.max_engine_restarts
        if self.restarts + len(failed) > limit:
            index, error = failed[0]
            raise RestartsExhausted(f"embedded engine {index} failed, and {self.restarts} engine(s) were already "
                                    f"replaced in this job (rollout.max_engine_restarts={limit}); its last "
                                    f"error:\n{error}")
        if pending_push is not None:
            pending_push.abandon()
        for index, error in failed:
            self.restarts += 1  # counted before it starts: an engine that never comes up spends the budget
            say(f"embedded engine {index} failed ({error.strip().splitlines()[-1] if error.strip() else error}): "
                f"starting a new one (replacement {self.restarts} of at most {limit})")
            self.engines.engines[index].shutdown()
            self.engines.replace(index, self._new_engine(index))
        everyone = list(self.engines.engines)
        behind = [e for e in everyone if e.weight_version < version]
        if behind:
            self._rebuild(behind)
            self.pusher.push(version).wait()
        if len(behind) < len(everyone):
            self._rebuild(everyone)

    def _wait_for_ray_to_drop(self, index: int, node: str | None) -> None:
        """The replaced Ray engine's node no longer answers but Ray still lists it alive (its health
        checks take seconds): wait, at most `DEAD_NODE_WAIT_S`, until Ray calls it dead, or the
        replacement may be placed there (the engines spread one per node, and that node now has
        none) and fail in turn, a second replacement for one failure."""
        import ray  # lazy: Ray, for launcher.kind 'ray' only

        if node is None or not node_lost(ray, node):
            return  # the engine died, its node lives (or is gone from Ray already: nothing to wait for)
        say(f"embedded engine {index}'s node {node} does not answer: waiting up to {DEAD_NODE_WAIT_S:.0f} s for "
            "Ray to call it dead before placing the replacement")
        deadline = time.monotonic() + DEAD_NODE_WAIT_S
        while time.monotonic() < deadline:
            if not any(n.get("Alive") and n["NodeManagerAddress"] == node for n in ray.nodes()):
                return
            time.sleep(0.5)

    def _rebuild(self, engines: list[RolloutEngine]) -> None:
        _, base_port = _meeting_point(self.cfg, self.pusher.group)  # fresh ports on rank 0's node
        _connect_weights(self.cfg, self.pusher, self.address, base_port, engines)

    def _new_engine(self, index: int) -> RolloutEngine:
        if self.cfg.launcher.kind == "ray":
            self._wait_for_ray_to_drop(index, self.engines.engines[index].node)
        engine = embedded_engine(self.cfg, self.model_dir, index)
        self.stack.callback(engine.shutdown)
        if self.cfg.launcher.kind == "ray":  # a Ray actor (RayEngine): where Ray placed it
            say(f"embedded engine {index} replaced: {engine.where}")
        return engine


def connect_sglang(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> Connection:
    """SGLang servers: learner rank 0 updates them itself (SGLangTransport, see sglang_setup.py);
    a delivered push sets the version the controller sees. Without a router the controller drives
    one engine per server, which `pusher.recovery` (a `ServerRecovery`) keeps in service."""
    forget_server_versions(cfg)
    threads = cpu_threads(cfg, "rl").engine  # of servers launched on the CPU
    group, servers = _start_with_learner(cfg, model_dir, stack,
                                         lambda: start_servers(cfg, model_dir, stack, log_dir, threads))
    address, base_port = _meeting_point(cfg, group)
    inner = servers.one_engine() if servers.router_url is not None else servers.engine_set()
    stack.callback(inner.shutdown)
    servers.connect_weights(group, address, base_port, range(len(servers.urls)), fresh=True)
    view = PushedVersionView(inner, servers)
    pusher = RemotePusher(group, on_delivered=view.confirm_version, push_timeout_s=cfg.rollout.push_timeout_s)
    if servers.router_url is None:
        pusher.recovery = ServerRecovery(cfg, servers, inner, pusher, address, stack)
    return view, RemoteLearner(group), pusher


CONNECTORS: dict[str, Callable[..., Connection]] = {"embedded": connect_embedded, "sglang": connect_sglang}
"""rollout.engine -> how its engines and the learner ranks are started and connected."""


def relaunch_learner(cfg: RunConfig, model_dir: Path, stack: ExitStack, engine: RolloutEngine,
                     pusher: RemotePusher) -> tuple[RemoteLearner, RemotePusher]:
    """New learner ranks in place of `pusher.group`'s (stopped here: a failed rank leaves its peers
    in a collective), connected to the engines `connect` started (`engine`, as it returned it): the
    weight groups rebuilt on a fresh port, and the engines told that the next version may be
    older than the one they hold (the last checkpoint's). The caller has aborted the groups in
    flight (`Controller.abandon`) and loads the checkpoint into the new ranks."""
    pusher.group.shutdown()
    group = learner_group(cfg, model_dir, "rl")
    stack.callback(group.shutdown)  # before the engines' (registered earlier)
    address, base_port = _meeting_point(cfg, group)
    return RemoteLearner(group), RELAUNCHERS[cfg.rollout.engine](cfg, group, address, base_port, engine, pusher)


def _reconnect_embedded(cfg: RunConfig, group, address: str, base_port: int, engine: RolloutEngine,
                        old: RemotePusher) -> RemotePusher:
    deadline = time.monotonic() + ABANDON_TIMEOUT_S
    for index, update in enumerate(old.last_updates):  # the failed learner's last version, if still on its way
        update.join(max(deadline - time.monotonic(), 0.0))
        if update.is_alive():  # an embedded engine (EmbeddedEngine or RayEngine): both can be killed
            say(f"engine {index} still waits for weights from the failed learner after {ABANDON_TIMEOUT_S:.0f} s: "
                "killed (it is replaced at the first push)")
            update.engine.kill()
    pusher = RemotePusher(group, push_timeout_s=cfg.rollout.push_timeout_s)
    for e in old.engines:
        try:
            e.forget_version()
        except Exception as err:  # noqa: BLE001 - a dead engine: replaced at the first push
            say(f"engine {e!r} did not take the version reset ({err}); it is replaced if it failed")
    _connect_weights(cfg, pusher, address, base_port, old.engines)
    pusher.recovery = old.recovery
    if pusher.recovery is not None:
        pusher.recovery.pusher = pusher
    return pusher


RELAUNCHERS: dict[str, Callable[..., RemotePusher]] = {"embedded": _reconnect_embedded, "sglang": reconnect_sglang}
"""rollout.engine -> how relaunched learner ranks are connected to the running engines."""


def _start_with_learner(cfg: RunConfig, model_dir: Path, stack: ExitStack, start_engines: Callable[[], Any]):
    """The RL learner ranks and `start_engines()`: local ranks are spawned first and load (import
    Megatron, build the model) while the engines start. The ranks' shutdown goes on `stack` after
    the engines' whatever happens, so that they stop first."""
    group = learner_group(cfg, model_dir, "rl", wait=False)
    try:
        engines = start_engines()
    finally:
        stack.callback(group.shutdown)
    return group, engines


def _meeting_point(cfg: RunConfig, group) -> tuple[str, int]:
    """Once the ranks are ready: where their broadcast groups meet, one group per pipeline stage,
    hosted where learner rank 0 runs (its node's address, ports free there; single-node stages: a
    multi-node PP>1 layout would need each stage sender's address), stage p on base_port + p."""
    address, base_port = group.wait_ready().call(LearnerWorker.meeting_point, cfg.parallel.pp)[0]
    if cfg.launcher.kind == "ray":
        say(f"weight groups meet at {address}:{base_port} (learner rank 0's node)")
    return address, base_port


def learner_group(cfg: RunConfig, model_dir: Path, phase: str, wait: bool = True) -> WorkerGroup:
    """The learner ranks (`launcher.world_size` processes or Ray actors) of `phase` ("sft", "rl").
    `wait=False`: local ranks are spawned and go on loading while the caller starts other
    processes; `group.wait_ready()` before the first call (Ray actors are always ready)."""
    spec = LearnerWorkerSpec(cfg, str(model_dir), phase)
    launcher = cfg.launcher
    world = launcher.world_size
    threads = cpu_threads(cfg, phase).learner
    if launcher.kind == "ray":
        gpus = 1.0 if launcher.device == "cuda" else 0.0
        key = cfg.rollout.sglang.api_key_env if cfg.rollout.engine == "sglang" else None  # rank 0 updates the servers
        group = RayWorkerGroup(world, make_learner_worker, (spec,), threads_per_rank=threads, gpus_per_rank=gpus,
                               ray_address=launcher.ray_address, env_from_driver=(key,) if key else (),
                               resources=launcher.ray_learner_resources)
        say(f"learner ranks ({phase}): {group.where()}; rendezvous {group.master}; the controller on "
            f"{group.driver_node}")
        return group
    return ProcessWorkerGroup(world, make_learner_worker, (spec,), threads_per_rank=threads,
                              master_addr=launcher.master_addr, wait=wait)


def make_engines(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> list[RolloutEngine]:
    """The run's engines, their shutdown (and that of servers launched here) on `stack`.
    SGLang: one `SGLangEngine` over every server (it balances the requests itself)."""
    r = cfg.rollout
    if r.engine == "sglang":
        return [sglang_engine(cfg, model_dir, stack, log_dir)]
    if cfg.launcher.kind == "ray":
        connect_ray(cfg.launcher.ray_address)
    engines = []
    for i in range(r.num_engines):  # they all load at once (local processes and Ray actors)
        engine = embedded_engine(cfg, model_dir, i, wait=False)
        stack.callback(engine.shutdown)
        engines.append(engine)
    engines = [engine.wait_ready() for engine in engines]
    if cfg.launcher.kind == "ray":
        say("engines: " + ", ".join(f"{i} {e.where}" for i, e in enumerate(engines)))
    return engines


def embedded_engine(cfg: RunConfig, model_dir: Path, index: int, wait: bool = True) -> RolloutEngine:
    """Embedded engine `index` of the run: a local process, or a Ray actor with launcher.kind 'ray'
    (ready when returned; `wait=False`: it may still be loading, see `wait_ready`)."""
    config = _embedded_config(cfg, model_dir, index)
    if cfg.launcher.kind == "ray":
        from entr_megatron.controller.ranks.ray_engine import RayEngine

        launcher = cfg.launcher
        return RayEngine(config, num_cpus=cfg.rollout.embedded.num_threads or 1, resources=launcher.ray_engine_resources,
                         scheduling_strategy=None if launcher.ray_engine_strategy == "DEFAULT" else
                         launcher.ray_engine_strategy, answer_timeout_s=cfg.rollout.embedded.health_timeout_s, wait=wait)
    from entr_megatron.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(config, wait=wait)


def _embedded_config(cfg: RunConfig, model_dir: Path, index: int):
    from entr_megatron.rollout.embedded import EmbeddedEngineConfig

    return EmbeddedEngineConfig.from_config(cfg.rollout, model_dir=str(model_dir), max_model_len=cfg.model.max_seq_len,
                                            seed=cfg.controller.seed + index, record_routes=cfg.records_routes,
                                            num_threads=cpu_threads(cfg, "rl").engine,
                                            device=engine_device(cfg, index))


def engine_device(cfg: RunConfig, index: int) -> str:
    """Where embedded engine `index` computes: the CPU, or with rollout.embedded.device 'cuda'
    GPU index mod launcher.gpus_per_node of this node, beside the learner ranks on it."""
    if cfg.rollout.embedded.device == "cpu":
        return "cpu"
    return f"cuda:{index % cfg.launcher.gpus_per_node}"


class CpuThreads(NamedTuple):
    learner: int | None
    """torch threads of each learner rank (None: torch's default)."""
    engine: int | None
    """torch threads of each embedded engine process (None: torch's default)."""


def cpu_threads(cfg: RunConfig, phase: str) -> CpuThreads:
    """Threads of the learner ranks and embedded engines of a job on one CPU machine in `phase`
    ("sft", "rl"): the fields set in the config (launcher.cpu_threads_per_rank,
    rollout.embedded.num_threads) as they are, except in the warm-up, whose only processes are
    learner ranks: they share every core. An unset field puts the machine's cores where the work
    is: when one side waits while the other works (the sync and fixed_lag modes) each process may
    use all the cores its side has (learner ranks share them, engines share them); when both work at
    once (one_step_off, fully_async) the cores are split between learner ranks and engines, one
    share each. OMP_WAIT_POLICY is left at its default: PASSIVE made sync runs on 2 cores about 2x
    slower per step (its threads sleep and wake on every small op). SGLang servers launched on the
    CPU count as engines (their OpenMP threads: `engine`). On GPU, with Ray, or with engines
    elsewhere (SGLang servers given by URL): as set (None: torch's default)."""
    launcher, rollout = cfg.launcher, cfg.rollout
    learner, engine = launcher.cpu_threads_per_rank, rollout.embedded.num_threads
    if launcher.device != "cpu" or launcher.kind != "local" or launcher.nnodes != 1:
        return CpuThreads(learner, engine)
    cores = available_cores()
    ranks = launcher.nproc_per_node
    here = rollout.engine == "embedded" or rollout.sglang.urls is None  # SGLang: launched on this CPU
    engines = rollout.num_engines if here else 0
    if phase == "sft":  # no engine runs beside the warm-up: its ranks get every core whatever is set
        return CpuThreads(max(learner or 1, cores // ranks), engine)
    if not engines or cfg.controller.mode in SEQUENTIAL_MODES:
        auto_learner, auto_engine = max(1, cores // ranks), max(1, cores // max(engines, 1))
    else:
        share = max(1, cores // (ranks + engines))
        auto_engine = share
        auto_learner = max(1, (cores - engines * share) // ranks)
    return CpuThreads(learner or auto_learner, engine or auto_engine)

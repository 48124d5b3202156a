"""The processes of a run and how they are connected, per engine kind.

    engine, learner, pusher = connect(cfg, model_dir, stack, log_dir)   # all stopped by `stack`
    Controller(engine, learner, pusher, task, options)

| rollout.engine | engine (the controller generates with it)  | pusher (RemotePusher): how the weights get there          |
|----------------|--------------------------------------------|-----------------------------------------------------------|
| embedded       | the engines (an EngineSet when several)    | stage broadcast groups; a receiver thread per engine here |
| sglang         | PushedVersionView over one SGLangEngine    | none here: rank 0's SGLangTransport updates the servers   |

The learner (RemoteLearner) and the pusher are two roles of the same learner ranks (one worker group).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from entr_megatron.config.run import RunConfig
from entr_megatron.controller.console import say
from entr_megatron.controller.learner_worker import LearnerWorkerSpec, make_learner_worker
from entr_megatron.controller.remote import RemoteLearner, RemotePusher
from entr_megatron.controller.sglang_setup import PushedVersionView, forget_server_versions, sglang_engine
from entr_megatron.controller.workers import ProcessWorkerGroup, RayWorkerGroup
from entr_megatron.rollout.engine import RolloutEngine
from entr_megatron.utils.spawn import free_port_range

__all__ = ["CONNECTORS", "connect", "connect_embedded", "connect_sglang", "learner_group", "make_engines"]

Connection = tuple[RolloutEngine, RemoteLearner, RemotePusher]


def connect(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> Connection:
    """Starts the engines and the learner ranks from `model_dir` and connects the weight path
    between them; their shutdown (and that of servers launched here) on `stack`."""
    say(f"starting {cfg.rollout.num_engines} {cfg.rollout.engine} engine(s) and "
        f"{cfg.launcher.world_size} learner rank(s) ({cfg.launcher.kind})")
    return CONNECTORS[cfg.rollout.engine](cfg, model_dir, stack, log_dir)


def connect_embedded(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> Connection:
    """Embedded engines: each receives the buckets of every pipeline stage's broadcast group."""
    from entr_megatron.weight_sync import receiver_for, stage_groups

    engines = make_engines(cfg, model_dir, stack, log_dir)
    group, address, base_port = _start_learner(cfg, model_dir, stack)
    wgroups = stage_groups(address, base_port, pp_size=cfg.parallel.pp, engine_ranks=(1,) * len(engines))
    wire_dtype = None if cfg.rollout.dtype == cfg.model.dtype else cfg.rollout.dtype
    group.call("connect_weight_sync", address, base_port, (1,) * len(engines), _bucket_bytes(cfg), wire_dtype,
               snapshot=cfg.rollout.weight_snapshot)
    receivers = [receiver_for(wgroups, i) for i in range(len(engines))]
    return _as_one_engine(engines), RemoteLearner(group), RemotePusher(group, engines, receivers)


def connect_sglang(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> Connection:
    """SGLang servers: learner rank 0 updates them itself (SGLangTransport, see sglang_setup.py);
    a delivered push sets the version the controller sees."""
    forget_server_versions(cfg)
    engine = sglang_engine(cfg, model_dir, stack, log_dir)
    group, address, base_port = _start_learner(cfg, model_dir, stack)
    group.call("connect_weight_sync", address, base_port, (), _bucket_bytes(cfg), None, sglang=engine.config,
               snapshot=cfg.rollout.weight_snapshot)
    view = PushedVersionView(engine)
    return view, RemoteLearner(group), RemotePusher(group, on_delivered=view.confirm_version)


CONNECTORS: dict[str, Callable[..., Connection]] = {"embedded": connect_embedded, "sglang": connect_sglang}
"""rollout.engine -> how its engines and the learner ranks are started and connected."""


def _bucket_bytes(cfg: RunConfig) -> int:
    return (cfg.rollout.weight_bucket_mib or 512) << 20


def _start_learner(cfg: RunConfig, model_dir: Path, stack: ExitStack):
    """The RL learner ranks, and where their broadcast groups meet: one group per pipeline stage,
    hosted where learner rank 0 runs (single-node stages; a multi-node PP>1 layout would need each
    stage sender's address), stage p on base_port + p."""
    group = learner_group(cfg, model_dir, "rl")
    stack.callback(group.shutdown)
    address = group.call("master_address")[0]
    base_port = free_port_range(cfg.parallel.pp)
    return group, address, base_port


def learner_group(cfg: RunConfig, model_dir: Path, phase: str):
    """The learner ranks (`launcher.world_size` processes or Ray actors) of `phase` ("sft", "rl")."""
    spec = LearnerWorkerSpec(cfg, str(model_dir), phase)
    launcher = cfg.launcher
    world = launcher.world_size
    threads = launcher.cpu_threads_per_rank
    if phase == "sft" and launcher.device == "cpu" and launcher.kind == "local":
        threads = max(threads or 1, (os.cpu_count() or 1) // world)  # no engine runs beside the warm-up
    if launcher.kind == "ray":
        gpus = 1.0 if launcher.device == "cuda" else 0.0
        return RayWorkerGroup(world, make_learner_worker, (spec,), threads_per_rank=threads, gpus_per_rank=gpus,
                              ray_address=launcher.ray_address)
    return ProcessWorkerGroup(world, make_learner_worker, (spec,), threads_per_rank=threads,
                              master_addr=launcher.master_addr)


def make_engines(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> list[RolloutEngine]:
    """The run's engines, their shutdown (and that of servers launched here) on `stack`.
    SGLang: one `SGLangEngine` over every server (it balances the requests itself)."""
    r = cfg.rollout
    if r.engine == "sglang":
        return [sglang_engine(cfg, model_dir, stack, log_dir)]
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig

    on_ray = cfg.launcher.kind == "ray"
    if on_ray:
        _ray_init(cfg)
        from entr_megatron.controller.ray_engine import RayEngine
    engines = []
    for i in range(r.num_engines):
        config = EmbeddedEngineConfig.from_config(r, model_dir=str(model_dir), max_model_len=cfg.model.max_seq_len,
                                                  seed=cfg.controller.seed + i)
        engine = RayEngine(config, num_cpus=r.embedded.num_threads or 1) if on_ray else EmbeddedEngine(config)
        stack.callback(engine.shutdown)
        engines.append(engine)
    return engines


def _ray_init(cfg: RunConfig) -> None:
    try:
        import ray
    except ImportError as e:
        raise ImportError("launcher.kind='ray' needs Ray: pip install 'entr-megatron[cluster]'") from e
    if not ray.is_initialized():
        ray.init(address=cfg.launcher.ray_address, include_dashboard=False)


def _as_one_engine(engines: list[RolloutEngine]) -> RolloutEngine:
    if len(engines) == 1:
        return engines[0]
    from entr_megatron.controller.engines import EngineSet

    return EngineSet(engines)

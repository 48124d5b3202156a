"""The `launcher` and `logging` sections: where the processes run, and what they write. Layer L0."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Literal, get_args

from entr_megatron.config.validate import FieldError, bad, boolean, choice, integer, is_number, string

RAY_ADDRESS_FORMS = "'auto', 'local', 'HOST:PORT' (the head's GCS port, e.g. 10.0.0.1:6379) or 'ray://HOST:PORT' " \
                    "(Ray Client, e.g. ray://10.0.0.1:10001)"
"""The addresses `ray.init(address=...)` takes, as errors spell them."""
RAY_PROBE_TIMEOUT_S = 2.0
"""How long `check_ray_reachable` waits for a TCP connection before it calls the address dead."""
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d{1,5})$")
_ADDRESS_ENV = "RAY_ADDRESS"  # what Ray's 'auto' reads first


def parse_ray_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a 'HOST:PORT' / '[IPv6]:PORT' / 'ray://HOST:PORT' Ray address, None for
    'auto' and 'local'; ValueError (the rule, for the caller to attach to its field) for anything else."""
    if address in ("auto", "local"):
        return None
    if address.startswith(("http://", "https://")):
        raise ValueError(f"is an HTTP address (the dashboard's or the job API's?); Ray connects to {RAY_ADDRESS_FORMS}")
    rest = address.removeprefix("ray://")
    if "://" in rest:
        raise ValueError(f"has an unknown scheme; must be {RAY_ADDRESS_FORMS}")
    m = _HOST_PORT.match(rest)
    if m is None:
        raise ValueError(f"must be {RAY_ADDRESS_FORMS}")
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"has port {port}, outside 1..65535; must be {RAY_ADDRESS_FORMS}")
    return m["v6"] or m["host"], port


def check_ray_reachable(address: str | None, field: str = "launcher.ray_address",
                        timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Before `ray.init`: a TCP connection to the address's host and port within `timeout_s` (Ray
    itself retries for about half a minute and then raises a traceback). 'auto' probes $RAY_ADDRESS
    when set (else Ray looks for a local cluster and says at once when there is none); None and
    'local' start a new local cluster: nothing to probe. Raises FieldError naming `field`."""
    section, _, name = field.rpartition(".")
    shown = address
    if address == "auto" and os.environ.get(_ADDRESS_ENV):
        address, shown = os.environ[_ADDRESS_ENV], f"auto (${_ADDRESS_ENV}={os.environ[_ADDRESS_ENV]})"
    if address is None:
        return
    if not isinstance(address, str):
        raise FieldError(section, name, shown, f"must be a string: {RAY_ADDRESS_FORMS}")
    try:
        target = parse_ray_address(address)
    except ValueError as e:
        raise FieldError(section, name, shown, str(e)) from None
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s):
            pass
    except OSError as e:
        reason = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise FieldError(section, name, shown, f"nothing accepts a connection at {target[0]}:{target[1]} "
                         f"({reason}): is the Ray head running (ray start --head) and "
                         "the address its GCS port (6379) or Ray Client port (10001, with ray://)?") from None


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray sets on every node itself: a run asks for them through other fields."""
RayEngineStrategy = Literal["SPREAD", "DEFAULT"]
RAY_ENGINE_STRATEGIES: tuple[str, ...] = get_args(RayEngineStrategy)


def _ray_resources(obj: object, name: str) -> None:
    """Field `name` must be null or a mapping of custom Ray resource names to amounts > 0."""
    value = getattr(obj, name)
    if value is None:
        return
    rule = ("must be null or a mapping of custom Ray resource names (as given to `ray start --resources`) "
            "to amounts > 0, e.g. {learner: 1}")
    if not isinstance(value, dict) or not value:
        raise bad(obj, name, value, rule)
    for key, amount in value.items():
        if not isinstance(key, str) or not key or not is_number(amount) or amount <= 0:
            raise bad(obj, name, value, rule)
        if key in RAY_BUILTIN_RESOURCES:
            raise bad(obj, name, value, f"{key!r} is set by Ray itself (ask for CPUs with launcher.cpu_threads_per_rank "
                      "and rollout.embedded.num_threads, GPUs with launcher.device); " + rule)
    object.__setattr__(obj, name, {k: float(v) for k, v in value.items()})


LauncherKind = Literal["local", "ray"]
LAUNCHERS: tuple[str, ...] = get_args(LauncherKind)
Device = Literal["cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)


@dataclass(frozen=True)
class LauncherConfig:
    """Where the processes run. Learner world size = nnodes * nproc_per_node."""

    SECTION = "launcher"

    kind: LauncherKind = "local"
    """One of LAUNCHERS: 'local' processes (torch.distributed) or 'ray' actors in placement groups."""

    device: Device = "cpu"
    """One of DEVICES: 'cpu' (gloo) or 'cuda' (NCCL, one GPU per learner rank)."""

    nnodes: int = 1
    """Nodes the learner spans. >= 1."""

    nproc_per_node: int = 1
    """Learner ranks per node (on cuda: GPUs per node given to the learner). >= 1; local CPU ranks at
    most CPU_RANKS_PER_CORE per core of the machine (checked when a job starts)."""

    gpus_per_node: int = 0
    """GPUs on each node (placement); 0 on CPU. On cuda: >= nproc_per_node."""

    engine_nodes: int = 0
    """Extra nodes for the rollout engines; 0: engines use the learner nodes' remaining GPUs (or CPU). >= 0."""

    ray_address: str | None = None
    """kind 'ray': address of an existing cluster, one of RAY_ADDRESS_FORMS; None starts a local one.
    `train` probes it (TCP, RAY_PROBE_TIMEOUT_S) before connecting."""

    ray_learner_resources: dict[str, float] | None = None
    """kind 'ray': custom Ray resources each learner rank needs besides its CPUs (and GPU), e.g.
    {learner: 1} with `ray start --resources '{"learner": 8}'` on the learner nodes: the ranks go
    only there (one placement group, packed). None: any node with the CPUs (GPUs)."""

    ray_engine_resources: dict[str, float] | None = None
    """kind 'ray': custom Ray resources each embedded engine actor needs besides its CPUs, e.g.
    {engine: 1}: engines (and their replacements) go only to nodes that offer it. None: any node."""

    ray_engine_strategy: RayEngineStrategy = "SPREAD"
    """kind 'ray': one of RAY_ENGINE_STRATEGIES, how Ray places the engine actors: 'SPREAD' one per
    node while nodes are left, 'DEFAULT' Ray's own choice (it fills a node first)."""

    master_addr: str = "127.0.0.1"
    """Rendezvous address of learner rank 0 (torchrun's --master-addr)."""

    master_port: int = 0
    """Rendezvous port; 0 picks a free one (single node only). In [0, 65535]."""

    cpu_threads_per_rank: int | None = None
    """torch intra-op threads of each learner rank (the warm-up's ranks get every core anyway). None,
    on one CPU machine: the cores where the work is (all of them in sync and fixed_lag modes, where
    the learner and engines take turns; a share beside the engines' in the overlapping modes;
    controller/wiring.cpu_threads); elsewhere torch's default. >= 1."""

    max_restarts: int = 0
    """torchrun's --max-restarts: when a learner rank fails (raises or dies), stop every rank and
    start new ones (processes, or Ray actors with kind 'ray') from the last checkpoint, the engines
    kept, up to this many times per job; then the error ends the job. metrics.jsonl keeps one line
    per step. >= 0."""

    def __post_init__(self) -> None:
        choice(self, "kind", LauncherKind)
        choice(self, "device", Device)
        integer(self, "nnodes", low=1)
        integer(self, "nproc_per_node", low=1)
        integer(self, "gpus_per_node", low=0)
        integer(self, "engine_nodes", low=0)
        string(self, "ray_address", optional=True)
        _ray_resources(self, "ray_learner_resources")
        _ray_resources(self, "ray_engine_resources")
        choice(self, "ray_engine_strategy", RayEngineStrategy)
        string(self, "master_addr")
        integer(self, "master_port", low=0, high=65535)
        integer(self, "cpu_threads_per_rank", low=1, optional=True)
        integer(self, "max_restarts", low=0)
        if self.ray_address is not None and self.kind != "ray":
            raise bad(self, "ray_address", self.ray_address, "is only used with launcher.kind='ray'; use null")
        for name in ("ray_learner_resources", "ray_engine_resources"):
            if getattr(self, name) is not None and self.kind != "ray":
                raise bad(self, name, getattr(self, name), "is only used with launcher.kind='ray'; use null")
        if self.ray_address is not None:
            try:
                parse_ray_address(self.ray_address)
            except ValueError as e:
                raise bad(self, "ray_address", self.ray_address, str(e)) from None
        if self.device == "cuda" and self.gpus_per_node < self.nproc_per_node:
            raise bad(
                self, "gpus_per_node", self.gpus_per_node,
                f"launcher.device='cuda' needs >= launcher.nproc_per_node={self.nproc_per_node} GPUs per node",
            )
        if self.kind == "local" and self.nnodes > 1 and self.master_port == 0:
            raise bad(self, "master_port", 0, "a multi-node local launch needs a fixed port in [1, 65535]")

    @property
    def world_size(self) -> int:
        """Learner ranks."""
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking (pip install 'entr-megatron[study]'), beside metrics.jsonl and TensorBoard.
    A resumed run continues the same W&B run (its id is kept in RUN_DIR/wandb_run_id); every
    metric is plotted against the training step ("step"), also when async steps log out of order."""

    SECTION = "logging.wandb"

    project: str = "entr-megatron"
    """W&B project."""

    group: str | None = None
    """Runs shown together (a study sets it to its name). None: no group."""

    name: str | None = None
    """Display name. None: the run directory's name."""

    mode: WandbMode = "online"
    """One of WANDB_MODES: 'online', 'offline' (sync later with `wandb sync`), 'disabled'."""

    entity: str | None = None
    """W&B team or user. None: your default entity."""

    def __post_init__(self) -> None:
        string(self, "project")
        for name in ("group", "name", "entity"):
            string(self, name, optional=True)
        choice(self, "mode", WandbMode)


@dataclass(frozen=True)
class LoggingConfig:
    """Run directory, metrics and console output."""

    SECTION = "logging"

    run_dir: str = "runs/entr"
    """Directory of metrics.jsonl, TensorBoard events, checkpoints and logs (the CLI's --run-dir wins)."""

    tensorboard: bool = True
    """Write TensorBoard events next to metrics.jsonl."""

    progress_bar: bool = True
    """Show a progress bar with reward, throughput and lag (off: one log line per log_interval)."""

    log_interval: int = 1
    """Steps between console log lines / metrics.jsonl records. >= 1."""

    level: LogLevel = "info"
    """Console log level: one of LOG_LEVELS."""

    wandb: WandbConfig | None = None
    """Also log to Weights & Biases (see WandbConfig). None: no W&B."""

    def __post_init__(self) -> None:
        string(self, "run_dir")
        boolean(self, "tensorboard")
        boolean(self, "progress_bar")
        integer(self, "log_interval", low=1)
        choice(self, "level", LogLevel)


CPU_RANKS_PER_CORE = 4
"""Most local CPU learner ranks (launcher.nproc_per_node, kind 'local', device 'cpu') per core of the
machine, checked when a job starts (controller/job/run.py `check_local_ranks`), not when a config is
built (a config is also loaded elsewhere, e.g. to plan a study): each rank imports torch and
Megatron (some 400 MB) and its gloo collectives wait on the slowest; past a few per core a job
makes no progress."""

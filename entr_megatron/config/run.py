"""The whole run: one typed, nested, frozen config validated before any process starts.

Layer L0: plain dataclasses, no torch/megatron and nothing from the package above
`config/`. Each section lives in the module of its name (model.py holds `model` and
`parallel`, task.py `task` and `sft`, launcher.py `launcher` and `logging`); this module
holds the run and the rules that span sections. Every error names the dotted field, the
value and what is allowed (validate.py). YAML files and dotted overrides: see `loader.py`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.controller import ControllerConfig
from entr_megatron.config.launcher import LauncherConfig, LoggingConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.config.model import ModelConfig, ParallelConfig
from entr_megatron.config.rollout import WEIGHT_SNAPSHOTS, RolloutConfig
from entr_megatron.config.task import MULTI_TURN_TASKS, SFTConfig, TaskConfig
from entr_megatron.config.validate import bad

__all__ = ["WEIGHT_SNAPSHOTS", "RunConfig"]  # WEIGHT_SNAPSHOTS: its importers' old home


@dataclass(frozen=True)
class RunConfig:
    """One training run; every section validated, then the cross-section rules below."""

    SECTION = ""  # the root: its rules name full dotted paths

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallelism of the learner."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, off-policy correction (ENTR), policy loss."""

    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Packing, optimizer and LR schedule of the learner."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference engines and sampling."""

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The training loop."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and rewards."""

    sft: SFTConfig | None = None
    """Supervised warm-up before RL; null skips it."""

    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Processes and placement."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and output."""

    def __post_init__(self) -> None:
        self._check_parallel()
        self._check_rollout()
        if self.model.max_prompt_len + self.rollout.sampling.max_new_tokens > self.model.max_seq_len:
            raise bad(
                self, "model.max_seq_len", self.model.max_seq_len,
                f"must be >= model.max_prompt_len + rollout.sampling.max_new_tokens = "
                f"{self.model.max_prompt_len + self.rollout.sampling.max_new_tokens}",
            )
        self._check_fixed_lag()
        self._check_agent()
        expected = self.rollout.prompts_per_step * self.rollout.sampling.n
        dp = self.parallel.data_parallel_size(self.launcher.world_size)
        if self.learner.mini_batches * dp > expected:
            raise bad(
                self, "learner.mini_batches", self.learner.mini_batches,
                f"must be at most {max(expected // dp, 1)}: each mini-batch of the {expected} sequences of a step "
                f"(rollout.prompts_per_step * rollout.sampling.n) needs one per data-parallel rank (dp={dp})",
            )
        if self.algorithm.loss_norm_tokens is None:
            # Dr.GRPO's constant: the generation budget (the loss of a sequence then does not
            # depend on how long its batch-mates are).
            algorithm = dataclasses.replace(self.algorithm, loss_norm_tokens=self.rollout.sampling.max_new_tokens)
            object.__setattr__(self, "algorithm", algorithm)

    def _check_fixed_lag(self) -> None:
        c, max_new = self.controller, self.rollout.sampling.max_new_tokens
        if c.mode != "fixed_lag":
            return
        if self.rollout.dynamic_filtering:
            raise bad(self, "rollout.dynamic_filtering", True,
                      "controller.mode='fixed_lag' generates each step's groups ahead with fixed versions "
                      "and cannot sample replacements for filtered ones; set it false")
        if c.intra_lag and c.intra_lag * c.intra_lag_stride_for(max_new) >= max_new:
            raise bad(self, "controller.intra_lag_stride", c.intra_lag_stride,
                      f"intra_lag ({c.intra_lag}) switches every intra_lag_stride tokens must all fall inside "
                      f"rollout.sampling.max_new_tokens={max_new}: need intra_lag * stride < {max_new}"
                      + ("" if c.intra_lag_stride else f" (and intra_lag < {max_new})"))

    def _check_agent(self) -> None:
        if self.task.name not in MULTI_TURN_TASKS:
            return
        agent, max_new = self.rollout.agent, self.rollout.sampling.max_new_tokens
        if agent.max_response_tokens < max_new:
            raise bad(self, "rollout.agent.max_response_tokens", agent.max_response_tokens,
                      f"must be >= rollout.sampling.max_new_tokens={max_new} (an episode's policy tokens are "
                      "part of its response)")
        if self.model.max_prompt_len + agent.max_response_tokens > self.model.max_seq_len:
            raise bad(self, "model.max_seq_len", self.model.max_seq_len,
                      f"must be >= model.max_prompt_len + rollout.agent.max_response_tokens = "
                      f"{self.model.max_prompt_len + agent.max_response_tokens} (task.name={self.task.name!r} "
                      "episodes hold tool outputs too)")

    def _check_parallel(self) -> None:
        p, world = self.parallel, self.launcher.world_size
        model_parallel = p.tp * p.pp * p.cp
        if p.dp is None and world % model_parallel:
            raise bad(
                self, "parallel.tp", p.tp,
                f"tp * pp * cp = {model_parallel} must divide the learner world size {world} "
                "(launcher.nnodes * launcher.nproc_per_node)",
            )
        if p.dp is not None and model_parallel * p.dp != world:
            raise bad(
                self, "parallel.dp", p.dp,
                f"tp * pp * cp * dp = {model_parallel * p.dp} must equal the learner world size {world} "
                "(launcher.nnodes * launcher.nproc_per_node); null derives it",
            )
        dp = p.data_parallel_size(world)
        if (p.tp * p.cp * dp) % (p.ep * p.expert_tp):
            raise bad(
                self, "parallel.ep", p.ep,
                f"ep * expert_tp = {p.ep * p.expert_tp} must divide tp * cp * dp = {p.tp * p.cp * dp}",
            )

    def _check_rollout(self) -> None:
        r, launcher = self.rollout, self.launcher
        if r.engine == "embedded" and r.embedded.device == "cuda":
            for name, value, want, why in (
                ("launcher.device", launcher.device, "cuda", "the engines share the learner's GPUs"),
                ("rollout.placement", r.placement, "colocated", "an engine on a GPU takes its weights through "
                 "CUDA IPC; a separate one would need an NCCL weight group (use SGLang servers for that)"),
                ("launcher.kind", launcher.kind, "local", "engine i runs on GPU i mod launcher.gpus_per_node "
                 "of the driver's node"),
            ):
                if value != want:
                    raise bad(self, name, value, f"must be {want!r}: {why}", when="rollout.embedded.device='cuda'")
        if r.engine == "sglang":
            if self.parallel.pp != 1:
                raise bad(
                    self, "parallel.pp", self.parallel.pp,
                    "rollout.engine='sglang' needs parallel.pp=1 (the servers take one weight-update group, "
                    "fed by learner rank 0; pipeline stages would each pause and update them separately)",
                )
            if r.placement == "colocated":  # /update_weights_from_tensor: the servers map rank 0's shared memory
                if launcher.kind != "local" or launcher.nnodes != 1:
                    raise bad(self, "rollout.placement", r.placement,
                              "needs launcher.kind 'local' and launcher.nnodes 1: the servers read the weights "
                              "from learner rank 0's shared memory, so they must run on its host; use 'separate'",
                              when="rollout.engine='sglang'")
                remote = [u for u in r.sglang.urls or () if not _is_loopback_url(u)]
                if remote:
                    raise bad(self, "rollout.placement", r.placement,
                              f"needs servers on this host (a loopback address in rollout.sglang.urls), got {remote[0]!r}: "
                              "the servers read the weights from learner rank 0's shared memory; use 'separate'",
                              when="rollout.engine='sglang'")
            if r.sglang.urls is not None:  # servers run elsewhere: nothing to place, any learner device
                if len(r.sglang.urls) != r.num_engines:
                    raise bad(
                        self, "rollout.num_engines", r.num_engines,
                        f"must equal the number of rollout.sglang.urls ({len(r.sglang.urls)}): one engine per server",
                    )
                return
            if launcher.device == "cpu":  # servers on this node's CPU (docs/SGLANG_ON_CPU.md): no GPUs to place
                if r.sglang.tp_size != 1:
                    raise bad(self, "rollout.sglang.tp_size", r.sglang.tp_size,
                              "must be 1: a CPU server is one process on this node's cores", when="launcher.device='cpu'")
                return
            total = (launcher.nnodes + launcher.engine_nodes) * launcher.gpus_per_node
            needed = launcher.world_size + r.gpus_needed
            if needed > total:
                raise bad(
                    self, "rollout.num_engines", r.num_engines,
                    f"learner ({launcher.world_size} GPUs) + engines (num_engines * sglang.tp_size = "
                    f"{r.gpus_needed} GPUs) need {needed} GPUs, but (launcher.nnodes + launcher.engine_nodes) "
                    f"* launcher.gpus_per_node = {total}",
                )
            if r.sglang.tp_size > launcher.gpus_per_node:
                raise bad(
                    self, "rollout.sglang.tp_size", r.sglang.tp_size,
                    f"a server must fit on one node: <= launcher.gpus_per_node={launcher.gpus_per_node}",
                )

    @property
    def records_routes(self) -> bool:
        """Whether the engines return MoE routes: asked for (rollout.record_routes), or replayed by
        R3 (algorithm.routing_replay 'r3'), which needs them."""
        return self.rollout.record_routes or self.algorithm.routing_replay == "r3"

    @property
    def global_batch_size(self) -> int:
        """Sequences per training step."""
        return self.rollout.prompts_per_step * self.rollout.sampling.n

    @property
    def data_parallel_size(self) -> int:
        """The learner's data-parallel size (set or derived from the world size)."""
        return self.parallel.data_parallel_size(self.launcher.world_size)


def _is_loopback_url(url: str) -> bool:
    """Whether an http(s) URL names this host by a loopback address (127.0.0.0/8, ::1, "localhost")."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

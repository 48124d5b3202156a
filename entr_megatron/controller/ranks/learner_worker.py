"""One learner rank of a run: the Megatron model, its optimizer, checkpoints and weight pushes.

    worker = LearnerWorker(LearnerWorkerSpec(run_config, model_dir, phase="rl"))   # in the rank's process
    worker.train(batch, version)       # every rank, the same global batch (each takes its DP share)
    worker.push(version)               # every rank; the stage senders broadcast in the background
    worker.wait_push()                 # the engines hold `version`
    worker.save(root, step, extra)     # Megatron dist checkpoint (model, optimizer, scheduler, RNG, extra)

A `WorkerGroup` (workers.py) builds one per rank, in local processes or Ray
actors, and calls the same method on every rank; `RemoteLearner` (remote.py)
turns those calls into the controller's `Learner` and `WeightPusher`.
The process must have the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) set before construction.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.config.run import RunConfig
from entr_megatron.learner.fused_output import enable_fused_output
from entr_megatron.learner.hf_export import save_hf_checkpoint
from entr_megatron.learner.scoring import score_sequences
from entr_megatron.parallel.cpu_compat import enable_cpu_compat
from entr_megatron.parallel.groups import destroy, init_distributed_from_env, initialize_model_parallel
from entr_megatron.rollout.engine import EngineError
from entr_megatron.rollout.sglang import SGLangEngine
from entr_megatron.types import TrainBatch
from entr_megatron.utils.faults import maybe_fault
from entr_megatron.utils.spawn import LOOPBACK, bind_ip, free_port_range
from entr_megatron.weight_sync import (
    BucketTransport,
    ColocatedTransport,
    SGLangTensorTransport,
    SGLangTransport,
    WeightSync,
    WeightSyncConfig,
    stage_groups,
)
from entr_megatron.weight_sync.sync import is_weight_sender

__all__ = ["LearnerWorker", "LearnerWorkerSpec", "make_learner_worker", "sft_learner_config"]

log = logging.getLogger(__name__)

PHASES = ("rl", "sft")
SFT_ALGORITHM = AlgorithmConfig(policy_loss="nll", correction="none", loss_agg_mode="token-mean")
"""Supervised warm-up: the negative log-likelihood of the target tokens, through the same train step."""


@dataclass(frozen=True)
class LearnerWorkerSpec:
    run: RunConfig
    model_dir: str
    """HF directory the weights start from (config.json + safetensors)."""
    phase: str = "rl"
    """"rl": the run's algorithm and optimizer; "sft": `SFT_ALGORITHM` and `sft_learner_config`."""

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")


def sft_learner_config(run: RunConfig) -> LearnerConfig:
    """The learner settings of the warm-up: the run's, with the `sft` section's learning rate,
    a 10% warm-up and a cosine decay to a tenth over `sft.steps`, and one optimizer step per
    batch (`learner.mini_batches` and `learner.epochs` are RL settings)."""
    sft = run.sft
    if sft is None:
        raise ValueError("the config has no `sft` section")
    warmup = max(sft.steps // 10, 0)
    optim = dataclasses.replace(
        run.learner.optim, lr=sft.lr, min_lr=sft.lr / 10, lr_warmup_steps=warmup,
        lr_decay_style="cosine" if sft.steps > warmup + 1 else "constant",
        lr_decay_steps=sft.steps if sft.steps > warmup + 1 else None,
    )
    return dataclasses.replace(run.learner, optim=optim, mini_batches=1, epochs=1)


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LearnerWorker:
    """One rank (see the module docstring); every public method is called on every rank."""

    def __init__(self, spec: LearnerWorkerSpec):
        # lazy: megatron, in the rank's process only (the controller imports this module for its methods)
        from entr_megatron.learner.build import build_learner_model_from_hf, read_hf_config
        from entr_megatron.learner.optimizer import build_optimizer, wrap_model_chunks
        from entr_megatron.learner.trainer import RLTrainer

        run = spec.run
        self.spec, self.run = spec, run
        self.info = init_distributed_from_env()
        if not torch.cuda.is_available():
            enable_cpu_compat()
        p = run.parallel
        self.groups = initialize_model_parallel(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, vpp=p.vpp,
                                                expert_tp=p.expert_tp, seed=run.controller.seed + 1234)
        self.hf_config = read_hf_config(spec.model_dir)
        overrides = {"calculate_per_token_loss": True}
        if p.sequence_parallel:
            overrides["sequence_parallel"] = True
        self.chunks, self.model_spec = build_learner_model_from_hf(
            spec.model_dir, self.groups, dtype=_torch_dtype(run.model.dtype), vp_size=p.vpp,
            config_overrides=overrides,
            routing_replay=run.algorithm.routing_replay if spec.phase != "sft" else "off",
        )
        if run.learner.fused_output:
            enable_fused_output(self.chunks)  # the last stage returns hidden states; the loss multiplies them
        if spec.phase == "sft":
            self.learner_cfg, self.algo_cfg = sft_learner_config(run), SFT_ALGORITHM
        else:
            self.learner_cfg, self.algo_cfg = run.learner, run.algorithm
        self.ddp = wrap_model_chunks(self.chunks, self.groups, self.learner_cfg)
        self.optimizer, self.scheduler = build_optimizer(self.ddp, self.learner_cfg)
        self.trainer = RLTrainer(self.ddp, self.groups, self.learner_cfg, self.algo_cfg, self.optimizer, self.scheduler,
                                 vocab_size=self.model_spec.vocab_size, temperature=run.rollout.sampling.temperature)
        self.sync = None
        self._push = None
        self._sglang = None  # the SGLang client of SGLangTransport (rank 0, rollout.engine 'sglang')

    # --- training ---------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Layout and size, for the run's log."""
        params = sum(p.numel() for c in self.chunks for p in c.parameters())
        g = self.groups
        return {"rank": self.info.rank, "tp": g.tp_size, "pp": g.pp_size, "dp": g.dp_size, "ep": g.ep_size,
                "cp": g.cp_size, "local_params": params}

    def train(self, batch: TrainBatch, version: int | None = None) -> dict[str, float]:
        """The optimizer steps of one rollout batch (`learner.mini_batches` x `learner.epochs`) on
        the global `batch`; each rank trains its data-parallel share of every mini-batch. Returns
        the steps' metrics merged (`merge_step_metrics`). `version`, the policy version being
        trained (the controller's `Learner` protocol), becomes the batch's `policy_version`: a3po
        interpolates its proximal policy by each token's lag (policy-lag metrics are the
        controller's, computed from the samples)."""
        from entr_megatron.learner.rollout_batch import merge_step_metrics  # lazy: megatron (see __init__)

        t0 = time.perf_counter()
        # The weights a push borrowed must be on the wire before they change (the trainer times the
        # wait: timing/weight_borrow_wait_s).
        before_update = self.sync.wait_borrowed if self.sync is not None else None
        if version is not None:
            maybe_fault(f"rank{self.info.rank}", version, "train")  # tests only (utils/faults.py)
            batch = dataclasses.replace(batch, policy_version=version)
        steps = self.trainer.train_rollout_batch(batch, before_update=before_update)
        metrics = merge_step_metrics(steps)
        metrics["timing/learner_step_s"] = time.perf_counter() - t0
        return metrics

    # --- weights to the engines -------------------------------------------------------------------
    def master_address(self) -> str:
        """The address of global rank 0 (torch.distributed's MASTER_ADDR), where weight groups meet."""
        return self.info.master_addr

    def meeting_point(self, ports: int) -> tuple[str, int] | None:
        """On rank 0: (its address, the first of `ports` consecutive ports free there), where the
        weight groups meet (stage p on the first + p); None on the other ranks, which may run on
        other nodes."""
        if self.info.rank != 0:
            return None
        return self.info.master_addr, free_port_range(ports, host=bind_ip(self.info.master_addr) or LOOPBACK)

    def connect_weight_sync(self, master_address: str, base_port: int, engine_ranks: tuple[int, ...],
                            bucket_bytes: int, dtype: str | None, timeout_s: float = 600.0,
                            sglang: Any = None, snapshot: str = "borrow", placement: str = "separate") -> bool:
        """Builds this rank's `WeightSync` (groups on `base_port + stage`); True on the stage senders.

        placement: `RolloutConfig.placement`; "colocated" copies the buckets into the engines'
        shared staging copies (`weight_sync.colocated.ColocatedTransport`) instead of broadcasting them.

        snapshot: `WeightSyncConfig.snapshot`; with "borrow", `train` makes its optimizer step
        (and `load` the checkpoint) wait until the last push no longer reads the parameters.

        sglang: an `SGLangEngineConfig` of the run's SGLang servers. The sender (rank 0; PP = 1)
        then drives them itself through `SGLangTransport` (their weight-update group on
        `base_port`), or with placement "colocated" through `SGLangTensorTransport` (servers on
        this host read each bucket from shared memory), and every rank cuts buckets the engine's
        way (its bucket bytes and dtype: `bucket_bytes`, `dtype` and `engine_ranks` are not used)."""
        if self.sync is not None:  # rebuilt (an engine was replaced): leave the old group first
            self.sync.close(wait_s=5.0)
            self.sync = None
        sender = is_weight_sender(self.groups)
        if sglang is not None:
            if self.groups.pp_size != 1:
                raise ValueError(f"SGLang servers take weights from one learner stage (parallel.pp=1), "
                                 f"got pp={self.groups.pp_size}")
            transport = None
            if sender:
                # This process's own client of the servers: its update_weights runs the handshake
                # (the controller's client only generates; see controller/job/sglang_setup.py).
                self._sglang = SGLangEngine(sglang)
                if placement == "colocated":  # servers on this host read the buckets from shared memory
                    transport = SGLangTensorTransport(self._sglang)
                else:
                    transport = SGLangTransport(self._sglang, master_address, base_port, timeout_s=timeout_s)
            config = WeightSyncConfig(bucket_bytes=sglang.weight_bucket_bytes, dtype=sglang.weight_dtype,
                                      snapshot=snapshot)
        else:
            colocated = placement == "colocated"  # its group carries control messages only: gloo, even on GPU
            wgroups = stage_groups(master_address, base_port, pp_size=self.groups.pp_size, engine_ranks=engine_ranks,
                                   backend="gloo" if colocated else None)
            kind = ColocatedTransport if colocated else BucketTransport
            transport = kind(wgroups[self.groups.pp_rank], timeout_s=timeout_s) if sender else None
            config = WeightSyncConfig(bucket_bytes=bucket_bytes, dtype=dtype, snapshot=snapshot)
        self.sync = WeightSync.for_learner(self.chunks, self.model_spec, self.groups, transport, config)
        return sender

    def push(self, version: int) -> float:
        """Snapshots (or borrows) the weights as `version`; the broadcast continues in the
        background. Returns how long this rank was blocked (s)."""
        if self.sync is None:
            raise RuntimeError("connect_weight_sync first")
        self._push = self.sync.push(version)
        return self._push.report.blocked_s

    def wait_push(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Waits for the last push; its report (the senders' `transfer_s` and GB/s). A push that did
        not reach the engines this rank updates itself (SGLang servers: an EngineError, or no end
        within `timeout_s`) is reported as {"engine_error": message}, not raised: the rank is
        fine, and the driver replaces the engine (controller/ranks/remote.py)."""
        if self._push is None:
            return {}
        try:
            report = self._push.wait(timeout_s)
        except (EngineError, TimeoutError) as e:
            if self._sglang is None:
                raise
            return {"engine_error": f"{type(e).__name__}: {e}"}
        handoff = self.sync.transport if isinstance(self.sync.transport, ColocatedTransport) else None
        return {"blocked_s": report.blocked_s, "transfer_s": report.transfer_s, "bytes": float(report.num_bytes),
                "gbytes_per_s": report.gbytes_per_s, "sender": float(report.sender),
                "colocated_copies": float(handoff.last_copies if handoff is not None else 0)}

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self, root: str, step: int, extra_state: Any = None, keep_last: int | None = None) -> str:
        from entr_megatron.checkpoint.io import save_checkpoint  # lazy: megatron (see __init__)

        path = save_checkpoint(root, step, self.ddp, self.optimizer, self.scheduler, extra_state,
                               keep_last=keep_last, model_config=self.hf_config)
        return os.fspath(path)

    def load(self, root: str, step: int | None = None, verify: bool = True) -> tuple[int, Any]:
        from entr_megatron.checkpoint.io import load_checkpoint  # lazy: megatron (see __init__)

        if self.sync is not None:
            self.sync.wait_borrowed()  # the weights are about to change
        return load_checkpoint(root, self.ddp, self.optimizer, self.scheduler, step=step, verify=verify)

    def target_logprobs(self, examples: list[tuple]) -> list[float]:
        """log p(target | prompt) of each (prompt ids, target ids[, target mask]) example under the
        current weights at temperature 1 (teacher forced; the sum over the target's tokens, only
        those the mask keeps: a tool trace's observations are given, not predicted), on every rank."""
        sequences = [list(ex[0]) + list(ex[1]) for ex in examples]
        scored = score_sequences(self.chunks, self.model_spec, self.groups, sequences)
        out = []
        for ex, (lp, _) in zip(examples, scored):
            tail = lp[len(ex[0]) - 1:].double()
            if len(ex) > 2:
                tail = tail[torch.tensor(ex[2], dtype=torch.bool)]
            out.append(float(tail.sum()))
        return out

    def export_hf(self, out_dir: str) -> str:
        """Writes the current weights as an HF directory (config.json, safetensors), atomically."""
        save_hf_checkpoint(self.chunks, self.model_spec, self.groups, out_dir, hf_config=self.hf_config)
        return out_dir

    def shutdown(self) -> None:
        if self.sync is not None:
            try:
                self.sync.close()
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("weight sync close failed: %s", e)
            self.sync = None
        if self._sglang is not None:
            self._sglang.shutdown()  # its threads only: the servers belong to the driver
            self._sglang = None
        destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def make_learner_worker(spec: LearnerWorkerSpec) -> LearnerWorker:
    """Module-level factory (picklable for spawned processes and Ray actors)."""
    return LearnerWorker(spec)


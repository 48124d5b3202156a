"""`RLTrainer`: one learner rank's training, built once (torchtitan-style), read top to bottom.

    trainer = RLTrainer(ddp_chunks, groups, learner_cfg, algo_cfg, optimizer, scheduler,
                        vocab_size=V, temperature=T)        # the layout and configs checked here, once
    steps = trainer.train_rollout_batch(batch)              # mini-batches x epochs optimizer steps
      -> trainer.logprobs(share)                            # pi_old of the shares trained after a step
      -> trainer.train_step(share, old_logprobs)            # one optimizer step
           -> run_schedule (train_step.py): packed micro-batches through Megatron's pipeline schedule
                -> make_policy_loss_func (loss.py): vocab-parallel log-prob + entropy -> policy loss
           -> optimizer_step (optimizer.py)

The controller reaches it through `LearnerWorker.train` (controller/ranks/learner_worker.py), which
holds one `RLTrainer` per rank. `train_step`, `train_rollout_batch` and `compute_logprobs` below
are one-call forms for tests and benchmarks (a trainer built for that one call).

pi_old (rollout_batch.py's docstring) is the policy before the rollout batch's first optimizer
step: the first share of the first epoch takes it detached from its own training pass, the
other shares are scored up front by `logprobs`, before any weight moves; only corrections that
anchor on it (`AlgorithmConfig.uses_old_logprobs`) and routing replay 'r2' pay for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.utils import get_model_config
from torch import Tensor

from entr_megatron.algorithm.metrics import MetricStats, finalize_mismatch_metrics, mismatch_metric_stats
from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.learner.batching import MicroBatch, split_for_data_parallel
from entr_megatron.learner.loss import make_logprob_loss_func, make_policy_loss_func
from entr_megatron.learner.loss_report import LossReport
from entr_megatron.learner.optimizer import check_training_config, optimizer_step
from entr_megatron.learner.rollout_batch import split_mini_batches
from entr_megatron.learner.routing_replay import ReplayStep
from entr_megatron.learner.train_step import (
    check_layout,
    current_device,
    from_last_stage,
    microbatches_for_step,
    prepare_config,
    run_schedule,
)
from entr_megatron.types import TrainBatch

__all__ = ["RLTrainer", "compute_logprobs", "train_rollout_batch", "train_step"]


class RLTrainer:
    """This rank's model chunks, optimizer and parallel groups with the run's learner and algorithm
    configs, the true vocabulary size and the sampling temperature.

    Args:
        model_chunks: one per virtual pipeline stage; DDP-wrapped (``optimizer.wrap_model_chunks``)
            to train, plain chunks do for `logprobs`.
        groups: the ``ParallelGroups`` of the layout.
        learner_cfg, algo_cfg: the run's ``learner`` and ``algorithm`` sections.
        optimizer, scheduler: from ``optimizer.build_optimizer``; None: `logprobs` only.
        vocab_size: the true (unpadded) vocabulary size: output columns beyond it (Megatron pads
            the vocabulary to a multiple of the TP size) stay out of the softmax, as in the
            engines and ``score``. None: every column is real.
        temperature: the rollouts' sampling temperature T: log-probs and entropy are taken of
            softmax(z / T), the distribution the behaviour log-probs were measured under.
    """

    def __init__(self, model_chunks: list, groups, learner_cfg: LearnerConfig, algo_cfg: AlgorithmConfig | None = None,
                 optimizer=None, scheduler=None, *, vocab_size: int | None = None, temperature: float = 1.0) -> None:
        self.chunks, self.groups, self.learner_cfg = model_chunks, groups, learner_cfg
        self.algo_cfg = algo_cfg if algo_cfg is not None else AlgorithmConfig()
        self.optimizer, self.scheduler = optimizer, scheduler
        self.vocab_size, self.temperature = vocab_size, temperature
        self.config = get_model_config(model_chunks[0])
        check_layout(groups)
        prepare_config(self.config, groups)
        if optimizer is not None:
            check_training_config(self.config, learner_cfg)
            if not all(isinstance(c, DistributedDataParallel) for c in model_chunks):
                raise ValueError("RLTrainer needs DDP-wrapped model chunks to train: call "
                                 "learner.optimizer.wrap_model_chunks first")
            self.config.finalize_model_grads_func = finalize_model_grads

    # --- training -------------------------------------------------------------------------------------
    def train_rollout_batch(self, batch: TrainBatch,
                            before_update: Callable[[], object] | None = None) -> list[dict[str, float]]:
        """``learner.mini_batches * learner.epochs`` optimizer steps on the GLOBAL ``batch``.

        Every rank of the learner passes the same global batch; each mini-batch is split over
        data-parallel ranks (``split_for_data_parallel``) and trained by `train_step`. Returns the
        metrics of every step in order (epoch-major), each with ``optim/minibatch`` and
        ``optim/epoch``. ``before_update`` runs before every optimizer step (only the first can
        wait: a weight push reads the weights of the version before it).
        """
        groups, cfg, algo = self.groups, self.learner_cfg, self.algo_cfg
        dp = groups.dp_size
        minis = split_mini_batches(batch, cfg.mini_batches)
        if any(m.num_seqs < dp for m in minis):
            raise ValueError(
                f"learner.mini_batches={cfg.mini_batches} leaves {min(m.num_seqs for m in minis)} sequences "
                f"in a mini-batch of this {batch.num_seqs}-sequence rollout batch, fewer than the {dp} data-parallel "
                f"ranks; use at most {batch.num_seqs // dp} mini-batches"
            )
        shares = [m if dp == 1 else split_for_data_parallel(m, dp)[groups.dp_rank] for m in minis]
        old: list[Tensor | None] = [None] * len(shares)
        # Routing replay 'r2' records pi_old's routes in that same scoring pass (into the share's extras).
        scores_old = algo.uses_old_logprobs or algo.routing_replay == "r2"
        t_old = time.perf_counter()
        if scores_old and cfg.steps_per_batch > 1:
            # Share 0 of epoch 0 trains before anything moved: its pi_old comes from its own pass.
            first = 0 if cfg.epochs > 1 else 1
            for k in range(first, len(shares)):
                logprobs = self.logprobs(shares[k])[0]
                old[k] = logprobs if algo.uses_old_logprobs else None
        old_s = time.perf_counter() - t_old
        unreplayed = {}
        if algo.measure_unreplayed and algo.routing_replay != "off":  # before any weight moves
            unreplayed = self.unreplayed_mismatch(shares)
        steps = []
        for epoch in range(cfg.epochs):
            for k, share in enumerate(shares):
                metrics = self.train_step(share, old_logprobs=old[k], before_update=before_update)
                metrics["optim/minibatch"], metrics["optim/epoch"] = float(k), float(epoch)
                steps.append(metrics)
        steps[0].update(unreplayed)  # one value per rollout batch: merge_step_metrics keeps it
        steps[0]["timing/learner_old_logprobs_s"] = old_s  # the pi_old pass (0 without one)
        return steps

    def train_step(self, batch: TrainBatch, old_logprobs: Tensor | None = None,
                   before_update: Callable[[], object] | None = None) -> dict[str, float]:
        """One optimizer step of the RL loss on ``batch`` (this data-parallel rank's sequences,
        ``batching.split_for_data_parallel``, the same on every TP/PP rank of the replica).

        ``old_logprobs``: pi_old, the log-probs of ``batch`` (packed ``[T]``, `logprobs`) under the
        weights before this rollout batch's first optimizer step, for corrections that anchor on
        it (``algo_cfg.uses_old_logprobs``). None: the weights have not moved since then, so pi_old
        is the current policy, detached, taken in the same pass (exact). ``before_update``: called
        after forward and backward, just before the optimizer changes the weights (e.g.
        `WeightSync.wait_borrowed`: a push still reading them).

        Returns the same metrics on every rank: ``loss`` (exact: global numerator / global count),
        the mismatch metrics (mismatch/*, mask/fraction, is/ess, entropy_bin/*), the correction's
        and loss's metrics (token-weighted over micro-batches and DP), ``optim/grad_norm``,
        ``optim/skipped`` (1.0 when the non-finite norm skipped the step), ``optim/lr`` and
        ``batch/microbatches``; with MoE routing replay (``algo_cfg.routing_replay``, the model
        built for it) ``routing/disagree_frac`` and per layer.
        """
        if self.optimizer is None:
            raise ValueError("this RLTrainer was built without an optimizer: it can only score (logprobs)")
        groups, algo, cfg = self.groups, self.algo_cfg, self.learner_cfg
        t0 = time.perf_counter()
        micro = microbatches_for_step(batch, groups, cfg, self.config)
        replay = ReplayStep.for_batch(self.chunks, batch, groups, scoring=False, mode=algo.routing_replay)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        def make_loss(index: int, mb: MicroBatch):
            return make_policy_loss_func(mb, groups.tp, algo, cfg, vocab_size=self.vocab_size,
                                         temperature=self.temperature, old_logprobs_T=old_logprobs)

        t1 = time.perf_counter()
        reports = run_schedule(self.chunks, micro, groups, make_loss, forward_only=False, replay=replay)
        t2 = time.perf_counter()
        waited = [0.0]

        def timed_before_update():
            tw = time.perf_counter()
            try:
                return before_update() if before_update is not None else None
            finally:
                waited[0] = time.perf_counter() - tw

        step = optimizer_step(self.optimizer, self.scheduler, cfg.optim.clip_grad, before_update=timed_before_update)
        t3 = time.perf_counter()
        metrics = LossReport.total(reports).all_reduced(groups).metrics() if groups.is_last_stage() else {}
        metrics = from_last_stage(metrics, groups)
        t4 = time.perf_counter()
        metrics.update({  # seconds (on a GPU, a part's queued kernels count in the next part that waits for them)
            "timing/learner_prepare_s": t1 - t0,
            "timing/learner_forward_backward_s": t2 - t1,
            "timing/learner_optimizer_s": t3 - t2 - waited[0],
            "timing/weight_borrow_wait_s": waited[0],
            "timing/learner_metrics_s": t4 - t3,
        })
        metrics.update({
            "optim/grad_norm": step.grad_norm,
            "optim/skipped": 0.0 if step.applied else 1.0,
            "optim/lr": step.lr,
            "batch/microbatches": float(len(micro)),
        })
        if replay is not None:
            metrics.update(replay.metrics(groups, current_device()))
        return metrics

    # --- scoring --------------------------------------------------------------------------------------
    def logprobs(self, batch: TrainBatch, routing_replay: str | None = None) -> tuple[Tensor, Tensor] | tuple[None, None]:
        """Log-probs and entropy of every target position of ``batch`` under the current weights.

        Forward only (no gradients, modules in eval mode), through the same packing and pipeline
        schedule as `train_step`. Returns float32 ``[T]`` tensors in ``batch``'s packed layout
        (position j of a sequence: log p(token j+1 | tokens 0..j); 0 at each sequence's last
        position) on the LAST pipeline stage, ``(None, None)`` elsewhere. ``routing_replay``: None
        replays MoE routes as the model was built to ('r2' records them); 'off' lets every router
        choose.
        """
        groups, cfg = self.groups, self.learner_cfg
        micro = microbatches_for_step(batch, groups, cfg, self.config)
        replay = ReplayStep.for_batch(self.chunks, batch, groups, scoring=True, mode=routing_replay)

        def make_loss(index: int, mb: MicroBatch):
            return make_logprob_loss_func(mb, index, groups.tp, cfg, vocab_size=self.vocab_size,
                                          temperature=self.temperature)

        was_training = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()
        try:
            with torch.no_grad():
                reports = run_schedule(self.chunks, micro, groups, make_loss, forward_only=True, replay=replay)
        finally:
            for c, training in zip(self.chunks, was_training):
                c.train(training)
        if replay is not None:
            replay.finish(batch)
        if not groups.is_last_stage():
            return None, None
        total = batch.tokens_T.numel()
        logprobs = torch.zeros(total, dtype=torch.float32)
        entropy = torch.zeros(total, dtype=torch.float32)
        for report in reports:
            mb = micro[report["index"]]
            real = mb.source_index >= 0
            logprobs[mb.source_index[real]] = report["logprobs"].float().cpu()[real]
            entropy[mb.source_index[real]] = report["entropy"].float().cpu()[real]
        last_positions = batch.cu_seqlens[1:] - 1  # no next token there
        logprobs[last_positions] = 0.0
        entropy[last_positions] = 0.0
        return logprobs, entropy

    def unreplayed_mismatch(self, shares: list[TrainBatch]) -> dict[str, float]:
        """The behaviour-vs-learner mismatch with MoE routing replay off: one forward-only pass of
        each of this DP rank's ``shares`` in which every router chooses its own experts.
        ``mismatch_unreplayed/{k3, mean_abs_delta, tokens}`` and
        ``mismatch_unreplayed/entropy_bin/<lo>-<hi>/k3`` (the learner's entropy there), over every
        DP rank's policy tokens, the same on every rank (``algorithm.measure_unreplayed``)."""
        groups = self.groups
        sums: dict[str, Tensor] = {}
        for share in shares:
            logprobs, entropy = self.logprobs(share, routing_replay="off")
            if logprobs is not None:
                stats = mismatch_metric_stats(logprobs, share.behaviour_logprobs_T, entropy, share.loss_mask_T)
                sums = {k: sums.get(k, 0.0) + v for k, v in stats.sums.items()}
        metrics: dict[str, float] = {}
        if groups.is_last_stage():
            total = torch.stack(list(sums.values())).to(current_device())
            if groups.dp_size > 1:
                dist.all_reduce(total, group=groups.dp)
            final = finalize_mismatch_metrics(MetricStats(dict(zip(sums, total.cpu())), {}, {}))
            for key in ("mismatch/k3", "mismatch/mean_abs_delta", "mismatch/tokens"):
                metrics[key.replace("mismatch/", "mismatch_unreplayed/")] = float(final[key])
            metrics.update({f"mismatch_unreplayed/{k}": float(v) for k, v in final.items()
                            if k.startswith("entropy_bin/") and k.endswith("/k3")})
        return from_last_stage(metrics, groups)


# --- one-call forms (tests, benchmarks) ---------------------------------------------------------------

def train_step(model_chunks: list, optimizer, scheduler, batch: TrainBatch, groups, algo_cfg: AlgorithmConfig,
               learner_cfg: LearnerConfig, *, vocab_size: int | None = None, temperature: float = 1.0,
               old_logprobs: Tensor | None = None,
               before_update: Callable[[], object] | None = None) -> dict[str, float]:
    """`RLTrainer.train_step` of a trainer built for this one call."""
    trainer = RLTrainer(model_chunks, groups, learner_cfg, algo_cfg, optimizer, scheduler, vocab_size=vocab_size,
                        temperature=temperature)
    return trainer.train_step(batch, old_logprobs=old_logprobs, before_update=before_update)


def train_rollout_batch(model_chunks: list, optimizer, scheduler, batch: TrainBatch, groups, algo_cfg: AlgorithmConfig,
                        learner_cfg: LearnerConfig, *, vocab_size: int | None = None, temperature: float = 1.0,
                        before_update: Callable[[], object] | None = None) -> list[dict[str, float]]:
    """`RLTrainer.train_rollout_batch` of a trainer built for this one call."""
    trainer = RLTrainer(model_chunks, groups, learner_cfg, algo_cfg, optimizer, scheduler, vocab_size=vocab_size,
                        temperature=temperature)
    return trainer.train_rollout_batch(batch, before_update=before_update)


def compute_logprobs(model_chunks: list, batch: TrainBatch, groups, learner_cfg: LearnerConfig,
                     vocab_size: int | None = None, temperature: float = 1.0,
                     routing_replay: str | None = None) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """`RLTrainer.logprobs` of a scoring-only trainer built for this one call."""
    trainer = RLTrainer(model_chunks, groups, learner_cfg, vocab_size=vocab_size, temperature=temperature)
    return trainer.logprobs(batch, routing_replay=routing_replay)

"""All optimizer steps of one rollout batch: mini-batches, epochs and the old policy pi_old.

    global batch (one policy version)
      -> split_mini_batches: `mini_batches` contiguous shares (each then split over DP)
      -> pi_old of every share that trains after the weights first move (one forward each)
      -> epochs x mini-batches train_step calls: the ENTR mask and every correction are
         computed inside each step's loss, so each sees the weights as they are then
      -> one metrics dict per optimizer step; merge_step_metrics folds them for the log

pi_old is the policy before the first optimizer step of the rollout batch (verl's
old_log_prob, AReaL's proximal policy). For the first mini-batch of the first epoch it
is the current policy itself, taken detached in the training pass (exact, no extra
forward); the other shares are scored once up front by ``compute_logprobs``, before any
weight moves. Only corrections that anchor on pi_old (``AlgorithmConfig.uses_old_logprobs``)
and MoE routing replay 'r2' (which records pi_old's routes in those forwards and replays them
in the shares' training forwards) pay for them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig
from entr_megatron.learner.batching import select_sequences, split_for_data_parallel
from entr_megatron.learner.train_step import compute_logprobs, train_step, unreplayed_mismatch
from entr_megatron.types import TrainBatch

__all__ = ["merge_step_metrics", "split_mini_batches", "train_rollout_batch"]


def split_mini_batches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """``count`` contiguous shares of ``batch`` whose sequence counts differ by at most one
    (the first ``num_seqs % count`` get the extra one), in batch order: a GRPO group stays
    together whenever the group size divides the share size."""
    n = batch.num_seqs
    if not 1 <= count <= n:
        raise ValueError(f"learner.mini_batches={count} is not valid for a rollout batch of {n} sequences; "
                         f"must be in [1, {n}]")
    base, extra = divmod(n, count)
    bounds = [0]
    for k in range(count):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [select_sequences(batch, list(range(a, b))) for a, b in zip(bounds[:-1], bounds[1:])]


def train_rollout_batch(model_chunks, optimizer, scheduler, batch: TrainBatch, groups, algo_cfg: AlgorithmConfig,
                        learner_cfg: LearnerConfig, *, vocab_size: int | None = None, temperature: float = 1.0,
                        before_update: Callable[[], object] | None = None) -> list[dict[str, float]]:
    """``learner_cfg.mini_batches * learner_cfg.epochs`` optimizer steps on the GLOBAL ``batch``.

    Every rank of the learner passes the same global batch; each mini-batch is split over
    data-parallel ranks (``split_for_data_parallel``) and trained by ``train_step``. Returns
    the metrics of every step in order (epoch-major), each with ``optim/minibatch`` and
    ``optim/epoch``. ``vocab_size`` and ``temperature`` as in ``train_step``. ``before_update`` runs before every optimizer step (only the first can
    wait: a weight push reads the weights of the version before it).
    """
    dp = groups.dp_size
    minis = split_mini_batches(batch, learner_cfg.mini_batches)
    if any(m.num_seqs < dp for m in minis):
        raise ValueError(
            f"learner.mini_batches={learner_cfg.mini_batches} leaves {min(m.num_seqs for m in minis)} sequences "
            f"in a mini-batch of this {batch.num_seqs}-sequence rollout batch, fewer than the {dp} data-parallel "
            f"ranks; use at most {batch.num_seqs // dp} mini-batches"
        )
    shares = [m if dp == 1 else split_for_data_parallel(m, dp)[groups.dp_rank] for m in minis]
    old: list[Tensor | None] = [None] * len(shares)
    # Routing replay 'r2' records pi_old's routes in that same scoring pass (into the share's extras).
    scores_old = algo_cfg.uses_old_logprobs or algo_cfg.routing_replay == "r2"
    if scores_old and learner_cfg.steps_per_batch > 1:
        # Share 0 of epoch 0 trains before anything moved: its pi_old comes from its own pass.
        first = 0 if learner_cfg.epochs > 1 else 1
        for k in range(first, len(shares)):
            logprobs = compute_logprobs(model_chunks, shares[k], groups, learner_cfg, vocab_size=vocab_size,
                                        temperature=temperature)[0]
            old[k] = logprobs if algo_cfg.uses_old_logprobs else None
    unreplayed = {}
    if algo_cfg.measure_unreplayed and algo_cfg.routing_replay != "off":  # before any weight moves
        unreplayed = unreplayed_mismatch(model_chunks, shares, groups, learner_cfg, vocab_size=vocab_size,
                                         temperature=temperature)
    steps = []
    for epoch in range(learner_cfg.epochs):
        for k, share in enumerate(shares):
            metrics = train_step(model_chunks, optimizer, scheduler, share, groups, algo_cfg, learner_cfg,
                                 vocab_size=vocab_size, temperature=temperature, old_logprobs=old[k],
                                 before_update=before_update)
            metrics["optim/minibatch"], metrics["optim/epoch"] = float(k), float(epoch)
            steps.append(metrics)
    steps[0].update(unreplayed)  # one value per rollout batch: merge_step_metrics keeps it
    return steps


def merge_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """One record for a rollout batch's steps: the mean of each metric over the steps, the
    maximum of ``*_max`` and ``*/max`` keys, the sum of ``optim/skipped``, ``optim/lr`` of the
    last step, and ``optim/steps``. One step: its own metrics (plus ``optim/steps`` = 1)."""
    if not steps:
        raise ValueError("no optimizer step to merge")
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        if key == "optim/skipped":
            merged[key] = float(sum(values))
        elif key == "optim/lr":
            merged[key] = values[-1]
        elif key.endswith(("_max", "/max")):
            merged[key] = max(values)
        elif key.endswith(("_min", "/min")):
            merged[key] = min(values)
        else:
            merged[key] = sum(values) / len(values)
    merged.pop("optim/minibatch", None)
    merged.pop("optim/epoch", None)
    merged["optim/steps"] = float(len(steps))
    return merged

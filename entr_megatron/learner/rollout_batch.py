"""All optimizer steps of one rollout batch (`RLTrainer.train_rollout_batch`, trainer.py): mini-batches,
epochs and the old policy pi_old; this module splits the batch and merges the steps' metrics.

    global batch (one policy version)
      -> split_mini_batches: `mini_batches` contiguous shares (each then split over DP)
      -> pi_old of every share that trains after the weights first move (one forward each)
      -> epochs x mini-batches train_step calls: the ENTR mask and every correction are
         computed inside each step's loss, so each sees the weights as they are then
      -> one metrics dict per optimizer step; merge_step_metrics folds them for the log

pi_old is the policy before the first optimizer step of the rollout batch (verl's
old_log_prob, AReaL's proximal policy). For the first mini-batch of the first epoch it
is the current policy itself, taken detached in the training pass (exact, no extra
forward); the other shares are scored once up front by ``RLTrainer.logprobs``, before any
weight moves. Only corrections that anchor on pi_old (``AlgorithmConfig.uses_old_logprobs``)
and MoE routing replay 'r2' (which records pi_old's routes in those forwards and replays them
in the shares' training forwards) pay for them.
"""

from __future__ import annotations

from entr_megatron.learner.batching import select_sequences
from entr_megatron.types import TrainBatch

__all__ = ["merge_step_metrics", "split_mini_batches"]


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


def merge_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """One record for a rollout batch's steps: the mean of each metric over the steps, the
    maximum of ``*_max`` and ``*/max`` keys, the sum of ``optim/skipped`` and of ``timing/*``
    (seconds of the whole batch), ``optim/lr`` of the last step, and ``optim/steps``. One step:
    its own metrics (plus ``optim/steps`` = 1)."""
    if not steps:
        raise ValueError("no optimizer step to merge")
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        if key == "optim/skipped" or key.startswith("timing/"):
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

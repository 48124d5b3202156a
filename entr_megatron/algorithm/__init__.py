"""L1: pure tensor math of the RL algorithm on one device (never torch.distributed or megatron).

Tensors are padded [B, T] (B responses, T response positions) with a bool
`response_mask_BT`; per-sequence values are [B].

- entr.py: the ENTR rule, entr_score / entr_mask, and the calibrated variant's pieces
- advantages.py: GRPO, Dr.GRPO, RLOO (ADVANTAGE_ESTIMATORS)
- correction_base.py, corrections_*.py, corrections.py: per-token weight / mask / ratio
  anchor of ENTR and the baselines (CORRECTIONS)
- policy_losses.py: PPO-clip, REINFORCE, CISPO, GSPO per-token losses and the supervised
  NLL warm-up loss (POLICY_LOSSES)
- aggregation.py: token-mean and sequence reductions with global counts (LOSS_AGGREGATIONS)
- metrics.py: mismatch metrics and their reducible sums
- objective.py: policy_loss_terms (what the learner calls per micro-batch) and
  compute_policy_loss (the whole-batch scalar on one device)
"""

from entr_megatron.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from entr_megatron.algorithm.aggregation import LOSS_AGGREGATIONS, aggregate_loss
from entr_megatron.algorithm.correction_base import CorrectionFn, CorrectionInputs, CorrectionOutput
from entr_megatron.algorithm.corrections import CORRECTIONS
from entr_megatron.algorithm.entr import ENTR_DEFAULT_EPS, ENTR_DEFAULT_TAU, entr_mask, entr_score
from entr_megatron.algorithm.masked_ops import broadcast_to_tokens
from entr_megatron.algorithm.metrics import (
    DEFAULT_ENTROPY_BIN_EDGES,
    MetricStats,
    finalize_mismatch_metrics,
    mismatch_metric_stats,
    mismatch_metrics,
)
from entr_megatron.algorithm.objective import PolicyTerms, compute_policy_loss, policy_loss_terms
from entr_megatron.algorithm.policy_losses import POLICY_LOSSES, LossInputs, PolicyLossOutput

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "DEFAULT_ENTROPY_BIN_EDGES",
    "ENTR_DEFAULT_EPS",
    "ENTR_DEFAULT_TAU",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "CorrectionFn",
    "CorrectionInputs",
    "CorrectionOutput",
    "LossInputs",
    "MetricStats",
    "PolicyLossOutput",
    "PolicyTerms",
    "aggregate_loss",
    "broadcast_to_tokens",
    "compute_policy_loss",
    "dr_grpo_advantages",
    "entr_mask",
    "entr_score",
    "finalize_mismatch_metrics",
    "grpo_advantages",
    "mismatch_metric_stats",
    "mismatch_metrics",
    "policy_loss_terms",
    "rloo_advantages",
]

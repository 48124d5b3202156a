"""Configuration of the RL algorithm: advantages, off-policy correction, policy loss, reduction.

Layer L0: this module must not import `entr_megatron.algorithm` (L1). The valid
names live here as plain tuples; a unit test checks that the algorithm's
registries have exactly these keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "dr_grpo", "rloo")
CORRECTION_NAMES = (
    "none",
    "entr",
    "entr_calibrated",
    "entr_soft",
    "tis",
    "mis_token",
    "mis_seq",
    "mis_geo",
    "icepop",
    "kpop",
    "m2po",
    "decoupled",
)
POLICY_LOSS_NAMES = ("ppo_clip", "reinforce", "cispo", "gspo", "nll")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ENTROPY_SOURCES = ("learner", "rollout")

# (eps_clip_low, eps_clip_high) used when the config leaves them unset. Each loss
# has its own scale: GSPO clips a sequence-level ratio, which moves far less than
# a token ratio (GSPO paper: 3e-4 / 4e-4); CISPO (MiniMax-M1) disables the lower
# bound (1 - 1.0 = 0) and only truncates large weights; PPO uses DAPO's
# asymmetric clip-higher. REINFORCE and NLL (supervised warm-up) do not clip; their
# entries keep the table total.
CLIP_RANGE_DEFAULTS: dict[str, tuple[float, float]] = {
    "ppo_clip": (0.2, 0.28),
    "reinforce": (0.2, 0.28),
    "cispo": (1.0, 0.28),
    "gspo": (3e-4, 4e-4),
    "nll": (0.2, 0.28),
}

# Corrections that cannot run without the log-probs of a recomputed proximal/old policy.
CORRECTIONS_REQUIRING_OLD_LOGPROBS = ("decoupled",)


@dataclass(frozen=True)
class AlgorithmConfig:
    """Everything the pure algorithm layer needs; validated on construction."""

    advantage_estimator: str = "grpo"
    """Group advantage estimator: one of ADVANTAGE_ESTIMATOR_NAMES."""

    correction: str = "entr"
    """Off-policy correction (per-token weight / mask / ratio anchor): one of CORRECTION_NAMES."""

    tau: float = 0.5
    """ENTR threshold: keep a token when delta^2 / (H + entr_eps) <= tau. Also sets the
    soft-ENTR clamp width. > 0. 0.5 admits |delta| <= 0.71 at H = 1 nat (ENTR.md)."""

    entr_eps: float = 0.01
    """ENTR entropy floor eps in delta^2 / (H + eps) (paper value 0.01). > 0."""

    calibrated_z: float = 3.5
    """entr_calibrated: keep a token when its calibrated score S <= z^2. > 0."""

    calibrated_min_sigma2: float = 1e-6
    """entr_calibrated: lower bound on the batch scale sigma2_hat, so a batch whose median
    deviation is exactly 0 (bitwise on-policy) does not mask every token that moved. > 0."""

    soft_mask_multiple: float = 2.0
    """entr_soft: hard-mask tokens with |delta| > soft_mask_multiple * b, b = sqrt(tau (H + eps)). >= 1."""

    tis_cap: float = 2.0
    """tis: truncation C of the importance weight min(pi_old / mu, C). > 0."""

    mis_token_band: tuple[float, float] = (0.5, 2.0)
    """mis_token: keep tokens whose ratio pi / mu lies in [lo, hi]; 0 <= lo <= 1 <= hi."""

    mis_seq_band: tuple[float, float] = (0.5, 2.0)
    """mis_seq: keep sequences whose product of token ratios lies in [lo, hi]; 0 <= lo <= 1 <= hi."""

    mis_geo_band: tuple[float, float] = (0.5, 2.0)
    """mis_geo: keep sequences whose geometric-mean token ratio lies in [lo, hi]; 0 <= lo <= 1 <= hi."""

    icepop_band: tuple[float, float] = (0.5, 5.0)
    """icepop: keep tokens whose ratio lies in [lo, hi] (Ring-1T uses [0.5, 5]); 0 <= lo <= 1 <= hi."""

    kpop_threshold: float = 0.05
    """kpop: drop tokens whose two-outcome Bernoulli KL(mu(y) || pi(y)) exceeds this (nats). > 0."""

    m2po_threshold: float = 0.04
    """m2po: drop the largest delta^2 until the mean delta^2 of the kept tokens is <= this. > 0."""

    decoupled_cap: float = 5.0
    """decoupled (AReaL): cap of the behaviour weight min(pi_prox / mu, cap). > 0."""

    policy_loss: str = "ppo_clip"
    """Per-token policy loss: one of POLICY_LOSS_NAMES. "nll" is the supervised (SFT)
    warm-up loss -log pi; pair it with correction "none"."""

    eps_clip_low: float | None = None
    """Lower clip width: ratio clipped below at 1 - eps_clip_low. In [0, 1]; None takes
    CLIP_RANGE_DEFAULTS[policy_loss]."""

    eps_clip_high: float | None = None
    """Upper clip width: ratio clipped above at 1 + eps_clip_high. >= 0; None takes
    CLIP_RANGE_DEFAULTS[policy_loss]."""

    dual_clip_c: float | None = 3.0
    """ppo_clip dual clip: for A < 0 the loss is bounded by -c * A. > 1; None disables."""

    loss_agg_mode: str = "token-mean"
    """How per-token losses become one scalar: one of LOSS_AGG_MODES. token-mean divides by
    every response token, masked ones included (ENTR.md)."""

    entropy_source: str = "learner"
    """Which entropy ENTR divides by: 'learner' (H(pi_theta), same forward pass) or
    'rollout' (H(mu) returned by the engine, as in the paper)."""

    def __post_init__(self) -> None:
        _require_choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATOR_NAMES)
        _require_choice("correction", self.correction, CORRECTION_NAMES)
        _require_choice("policy_loss", self.policy_loss, POLICY_LOSS_NAMES)
        _require_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _require_choice("entropy_source", self.entropy_source, ENTROPY_SOURCES)
        for name in (
            "tau",
            "entr_eps",
            "calibrated_z",
            "calibrated_min_sigma2",
            "tis_cap",
            "kpop_threshold",
            "m2po_threshold",
            "decoupled_cap",
        ):
            _require_in_range(name, getattr(self, name), low=0.0, low_open=True)
        _require_in_range("soft_mask_multiple", self.soft_mask_multiple, low=1.0)
        for name in ("mis_token_band", "mis_seq_band", "mis_geo_band", "icepop_band"):
            # YAML gives lists; store an immutable, hashable tuple of floats.
            object.__setattr__(self, name, _require_band(name, getattr(self, name)))
        if self.eps_clip_low is not None:
            _require_in_range("eps_clip_low", self.eps_clip_low, low=0.0, high=1.0)
        if self.eps_clip_high is not None:
            _require_in_range("eps_clip_high", self.eps_clip_high, low=0.0)
        if self.dual_clip_c is not None:
            _require_in_range("dual_clip_c", self.dual_clip_c, low=1.0, low_open=True)

    def clip_range(self, loss_name: str | None = None) -> tuple[float, float]:
        """(eps_low, eps_high) for `loss_name` (default: self.policy_loss); unset values
        fall back to that loss's CLIP_RANGE_DEFAULTS entry."""
        default_low, default_high = CLIP_RANGE_DEFAULTS[loss_name or self.policy_loss]
        low = default_low if self.eps_clip_low is None else float(self.eps_clip_low)
        high = default_high if self.eps_clip_high is None else float(self.eps_clip_high)
        return low, high

    @property
    def requires_old_logprobs(self) -> bool:
        """True when the correction needs a recomputed old/proximal policy forward pass."""
        return self.correction in CORRECTIONS_REQUIRING_OLD_LOGPROBS


def _require_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"AlgorithmConfig.{field}={value!r} is not valid; allowed: {', '.join(allowed)}")


def _require_number(field: str, value: Any, rule: str) -> float:
    # bool is an int subclass; `tau: true` in YAML is a typo, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"AlgorithmConfig.{field}={value!r} is not valid; must be a number {rule}")
    return float(value)


def _require_in_range(
    field: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    rule = f"in {'(' if low_open else '['}{low}, {high}]"
    number = _require_number(field, value, rule)
    too_low = number <= low if low_open else number < low
    if too_low or number > high:
        raise ValueError(f"AlgorithmConfig.{field}={value!r} is not valid; must be {rule}")


def _require_band(field: str, value: Any) -> tuple[float, float]:
    rule = "a pair [lo, hi] with 0 <= lo <= 1 <= hi (on-policy tokens, ratio 1, must be kept)"
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"AlgorithmConfig.{field}={value!r} is not valid; must be {rule}")
    lo, hi = (_require_number(field, v, rule) for v in value)
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"AlgorithmConfig.{field}={value!r} is not valid; must be {rule}")
    return lo, hi

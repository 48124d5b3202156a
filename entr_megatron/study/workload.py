"""The planner's inputs and output: `Costs` (a cluster's per-operation costs), `Workload` (what a
run asks of it) and `Plan` (what the simulation predicts). See planner.py for the model.

Both inputs are validated when built: every field is typed, every number has a stated range,
and an error names the field (`workload.max_policy_lag=-1 is not valid; must be an integer in
[0, 1024]`). The bound on staleness is the one `train` applies
(`config.controller.MAX_POLICY_LAG_LIMIT`), so a workload the planner accepts is one a run
accepts. The time costs have no default: a cost left out of a cluster description is an error
naming it, not 0 seconds.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from entr_megatron.config.controller import CONTROLLER_MODES, LAGGED_MODES, MAX_POLICY_LAG_LIMIT, ControllerConfig
from entr_megatron.config.rollout import (
    MAX_ENGINES, MAX_NEW_TOKENS, MAX_PROMPTS_PER_STEP, MAX_SAMPLES_PER_PROMPT, RolloutConfig, SamplingConfig,
)
from entr_megatron.config.validate import FieldError, integer, number

__all__ = ["COST_FIELDS", "MODES", "Costs", "Plan", "Workload"]

MODES = CONTROLLER_MODES
"""The modes the planner simulates: the run config's (config.controller.ControllerMode)."""

MAX_STEPS = 100_000
MAX_SIMULATED_SEQUENCES = 1_000_000
"""Most sequences one simulation draws (steps x prompts_per_step x n): some 15 s per mode on one core
and a few hundred MB at most; the planner's own bound, beside each field's."""
MAX_TOKENS = MAX_NEW_TOKENS
"""Bound of the token counts: max_new_tokens, prompt_len, response_median, max_batch_size (train's
bound of rollout.sampling.max_new_tokens; prompts_per_step, n and engines have train's bounds too)."""
MAX_RESPONSE_SIGMA = 10
"""Lognormal spread of response lengths (beyond some 3 nearly every draw is clipped to 1 or max_new_tokens)."""

COST_FIELDS = ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s", "train_per_token_s",
               "train_overhead_s", "push_s", "swap_s")
"""The time costs (seconds): required, each a finite number >= 0 (0 only when written as 0)."""


def _unknown(cls: type, data: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(known)}")


def _mapping(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping of field: value, got {type(data).__name__} {data!r}")
    return data


@dataclass(frozen=True)
class Costs:
    """Per-operation costs in seconds and the engines' shape (see planner.py's model)."""

    SECTION = "costs"

    decode_base_s: float
    """One decode step of b running sequences takes decode_base_s + decode_per_seq_s * b. >= 0."""
    decode_per_seq_s: float
    """>= 0; decode_base_s + decode_per_seq_s > 0."""
    prefill_per_token_s: float
    """Admitting a sequence adds this per prompt token to its first decode step. >= 0."""
    train_per_token_s: float
    """The learner trains T tokens in train_overhead_s + train_per_token_s * T. >= 0."""
    train_overhead_s: float
    """>= 0."""
    push_s: float
    """A weight push, on the learner's side. >= 0."""
    swap_s: float
    """Engines stall this long when they swap weights. >= 0."""
    engines: int = 1
    """In [1, MAX_ENGINES]."""
    max_batch_size: int = 64
    """Sequences one engine decodes at once; the rest wait. In [1, MAX_TOKENS]."""
    prompt_len: int = 16
    """Prompt tokens of every sequence. In [0, MAX_TOKENS]."""
    response_median: float = 64.0
    """Response lengths: lognormal with this median and `response_sigma`, clipped to [1, max_new_tokens].
    In [0, MAX_TOKENS]."""
    response_sigma: float = 0.0
    """In [0, MAX_RESPONSE_SIGMA] (0: every response the median's length)."""
    max_new_tokens: int = 128
    """In [1, MAX_TOKENS]."""

    def __post_init__(self) -> None:
        for name in COST_FIELDS:
            number(self, name, low=0)
        number(self, "response_median", low=0, high=MAX_TOKENS)
        number(self, "response_sigma", low=0, high=MAX_RESPONSE_SIGMA)
        integer(self, "engines", low=1, high=MAX_ENGINES)
        for name in ("max_batch_size", "max_new_tokens"):
            integer(self, name, low=1, high=MAX_TOKENS)
        integer(self, "prompt_len", low=0, high=MAX_TOKENS)
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            raise FieldError("costs", "decode_base_s", self.decode_base_s,
                             "decode_base_s + decode_per_seq_s must be > 0 (a decode step takes time)",
                             f"decode_per_seq_s={self.decode_per_seq_s!r}")

    @classmethod
    def from_dict(cls, data: Any, where: str = "costs") -> Costs:
        """Costs from a mapping (a cluster YAML's `costs`): unknown keys and missing time costs
        (COST_FIELDS) are errors naming them; the engines' shape keeps its defaults."""
        data = _mapping(data, where)
        _unknown(cls, data, where)
        missing = [name for name in COST_FIELDS if name not in data]
        if missing:
            raise ValueError(f"{where}: missing cost(s) {missing}: every time cost must be given (in seconds, "
                             f">= 0; write 0 for a cost that does not apply); required: {list(COST_FIELDS)}")
        return cls(**data)

    def response_lengths(self, count: int, rng: random.Random) -> list[int]:
        """`count` response lengths drawn with `rng` (see `response_median`)."""
        if self.response_sigma == 0:  # floor or ceil of the median, in the proportion that keeps the mean
            low = math.floor(self.response_median)
            return [max(1, min(self.max_new_tokens, low + (rng.random() < self.response_median - low)))
                    for _ in range(count)]
        mu = math.log(max(self.response_median, 1.0))
        return [max(1, min(self.max_new_tokens, round(rng.lognormvariate(mu, self.response_sigma))))
                for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    """What a run asks of the cluster: the fields of the run config (rollout, controller) that the
    planner models, with the same ranges `train` enforces."""

    SECTION = "workload"

    # Defaults are the run config's (one default per fact; tests/unit/test_one_default.py).
    prompts_per_step: int = RolloutConfig.prompts_per_step
    """Groups (prompts) trained per step (rollout.prompts_per_step). In [1, MAX_PROMPTS_PER_STEP]."""
    n: int = SamplingConfig.n
    """Samples per prompt (rollout.sampling.n). In [1, MAX_SAMPLES_PER_PROMPT]."""
    max_policy_lag: int = ControllerConfig.max_policy_lag
    """Staleness bound (controller.max_policy_lag). In [0, MAX_POLICY_LAG_LIMIT]; one_step_off and
    fully_async need >= 1."""
    steps: int = 50
    """Simulated training steps. In [1, MAX_STEPS]; steps x prompts_per_step x n at most
    MAX_SIMULATED_SEQUENCES."""
    max_inflight_groups: int | None = None
    """fully_async: groups kept in flight (None: 2 * prompts_per_step). In [1, MAX_PROMPTS_PER_STEP *
    (MAX_POLICY_LAG_LIMIT + 1)] (the loop keeps at most prompts_per_step x (max_policy_lag + 1))."""
    inter_lag: int = 0
    """fixed_lag: K (controller.inter_lag). In [0, MAX_POLICY_LAG_LIMIT]."""
    intra_lag: int = 0
    """fixed_lag: J (controller.intra_lag). In [0, MAX_POLICY_LAG_LIMIT]."""
    seed: int = 0
    """Seed of the response lengths. >= 0."""

    def __post_init__(self) -> None:
        integer(self, "prompts_per_step", low=1, high=MAX_PROMPTS_PER_STEP)
        integer(self, "n", low=1, high=MAX_SAMPLES_PER_PROMPT)
        integer(self, "steps", low=1, high=MAX_STEPS)
        for name in ("max_policy_lag", "inter_lag", "intra_lag"):
            integer(self, name, low=0, high=MAX_POLICY_LAG_LIMIT)
        integer(self, "max_inflight_groups", low=1, high=MAX_PROMPTS_PER_STEP * (MAX_POLICY_LAG_LIMIT + 1),
                optional=True)
        integer(self, "seed", low=0)
        sequences = self.steps * self.prompts_per_step * self.n
        if sequences > MAX_SIMULATED_SEQUENCES:
            raise FieldError("workload", "steps", self.steps,
                             f"steps x prompts_per_step x n = {sequences} sequences; must be at most "
                             f"{MAX_SIMULATED_SEQUENCES} (the planner simulates each)",
                             f"prompts_per_step={self.prompts_per_step}, n={self.n}")

    @classmethod
    def from_dict(cls, data: Any, where: str = "workload") -> Workload:
        """A workload from a mapping (a cluster YAML's `workload`); unknown keys are errors."""
        data = _mapping(data, where)
        _unknown(cls, data, where)
        return cls(**data)

    def check_mode(self, mode: str) -> None:
        """Refuses a workload that `train` would refuse in `mode` (a lag of 0 out of sync)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode in LAGGED_MODES and self.max_policy_lag < 1:
            raise FieldError("workload", "max_policy_lag", self.max_policy_lag,
                             f"mode {mode!r} trains on samples at least one version old; must be >= 1 "
                             "(or leave the mode out: --modes sync,fixed_lag)")


@dataclass
class Plan:
    """The simulated run: step times, tokens, busy time and the lag of every trained token."""

    mode: str
    step_s: list[float]
    response_tokens: int
    wall_s: float
    learner_busy_s: float
    engine_busy_s: float
    engines: int
    lag_tokens: dict[int, int] = field(repr=False)
    """Trained tokens per policy lag."""
    step_lag_mean: list[float] = field(repr=False)
    """Mean token lag of each step's batch (the controller's policy_lag/mean)."""
    dropped: int = 0

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_lag(self) -> float:
        total = sum(self.lag_tokens.values())
        return sum(lag * n for lag, n in self.lag_tokens.items()) / total if total else 0.0

    @property
    def max_lag(self) -> int:
        return max(self.lag_tokens, default=0)

    def summary(self) -> dict[str, float]:
        """The row `plan` prints: mean step time, throughput, idle fractions, lags, dropped groups."""
        return {"mode": self.mode, "step_s": self.mean_step_s, "tokens_per_s": self.tokens_per_s,
                "learner_idle": 1 - self.learner_busy_s / self.wall_s if self.wall_s else 0.0,
                "engine_idle": 1 - self.engine_busy_s / (self.wall_s * self.engines) if self.wall_s else 0.0,
                "lag_mean": self.mean_lag, "lag_max": float(self.max_lag), "dropped_groups": float(self.dropped)}

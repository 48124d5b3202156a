"""Configuration of the RL algorithm: advantages, off-policy correction, policy loss, reduction.

Layer L0: this module must not import `entr_megatron.algorithm` (L1). The valid
names live here as `Literal` types (and their tuples); a unit test checks that the
algorithm's registries have exactly these keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from entr_megatron.config.validate import bad, boolean, choice, integer, is_number, number

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
ADVANTAGE_ESTIMATOR_NAMES: tuple[str, ...] = get_args(AdvantageEstimator)
Correction = Literal[
    "none", "naive", "entr", "entr_calibrated", "entr_soft", "tis", "mis_token", "mis_seq", "mis_geo", "icepop",
    "kpop", "m2po", "decoupled", "opsm", "trm", "a3po", "matched_band", "matched_random",
    "random_drop",
]
CORRECTION_NAMES: tuple[str, ...] = get_args(Correction)
ENTR_MASKING: tuple[str, ...] = ("entr", "entr_calibrated", "entr_soft", "matched_band", "matched_random")
"""Corrections that mask by ENTR's rule or by its size already: add_entr_mask / add_random_mask refuse them."""
PolicyLoss = Literal["ppo_clip", "reinforce", "cispo", "gspo", "nll", "dppo_tv", "dppo_kl", "sapo", "vespo"]
POLICY_LOSS_NAMES: tuple[str, ...] = get_args(PolicyLoss)
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
EntropySource = Literal["learner", "rollout"]
ENTROPY_SOURCES: tuple[str, ...] = get_args(EntropySource)

CorrectionMode = Literal["published", "mask_only"]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
CapMode = Literal["drop", "clamp"]
CAP_MODES: tuple[str, ...] = get_args(CapMode)
RoutingReplay = Literal["off", "r2", "r3"]
TisLevel = Literal["token", "sequence"]
TIS_LEVELS: tuple[str, ...] = get_args(TisLevel)
TrmStatistic = Literal["max", "mean"]
TRM_STATISTICS: tuple[str, ...] = get_args(TrmStatistic)
ROUTING_REPLAY_MODES: tuple[str, ...] = get_args(RoutingReplay)

# The aggregation each loss's paper uses, when loss_agg_mode is unset. GSPO averages per
# sequence (1/G sum_i 1/|y_i| sum_t, arXiv:2507.18071 eq. 5); CISPO (arXiv:2506.13585 eq. 4)
# and DAPO's PPO (arXiv:2503.14476 eq. 8) normalise by all tokens of the batch.
DEFAULT_LOSS_AGG_MODES: dict[str, str] = {
    "ppo_clip": "token-mean",
    "reinforce": "token-mean",
    "cispo": "token-mean",
    "gspo": "seq-mean-token-mean",
    "nll": "token-mean",
    # DPPO (arXiv:2602.04879) keeps masked tokens in verl's agg_loss over the response mask, token-mean by default.
    "dppo_tv": "token-mean",
    "dppo_kl": "token-mean",
    # SAPO (arXiv:2511.20347) averages per sequence as GRPO does (verl forces seq-mean-token-mean;
    # AReaL's sapo_loss_fn uses token-mean).
    "sapo": "seq-mean-token-mean",
    # VESPO (arXiv:2602.10693): the authors' verl recipe and TRL both divide by all tokens.
    "vespo": "token-mean",
}

# Corrections whose rejected tokens leave the loss denominator by default: verl's
# rejection sampling multiplies the response mask by the rejection mask
# (verl/trainer/ppo/rollout_corr_helper.py). ENTR counts them (docs/ENTR.md), and so do
# AReaL's decoupled loss (its token count is taken before behav_imp_weight_cap drops
# tokens, areal/utils/functional) and the weighting methods (a zero weight is still a token).
REJECTED_LEAVE_DENOMINATOR = ("mis_token", "mis_seq", "mis_geo", "trm")

# Corrections that, as published, run PPO against pi_old (the policy before the rollout
# batch's first optimizer step) and judge pi_old / mu. The rest compare pi_theta with mu.
CORRECTIONS_ON_OLD_POLICY = ("naive", "tis", "icepop", "mis_token", "mis_seq", "mis_geo", "kpop", "decoupled", "opsm",
                             "trm")

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
    # DPPO reuses the clip widths as its divergence thresholds (verl's clip_ratio_low/high): bounds on
    # pi_theta(y) - pi_anchor(y) for Binary-TV and on the Bernoulli KL for Binary-KL. Values of the
    # DPPO authors' verl example (run_qwen3_30b_a3b_megatron.sh): TV 0.15 / 0.15, KL 0.05 / 0.05.
    "dppo_tv": (0.15, 0.15),
    "dppo_kl": (0.05, 0.05),
    # SAPO and VESPO replace the clip (a soft gate, a sequence weight): entries keep the table total.
    "sapo": (0.2, 0.28),
    "vespo": (0.2, 0.28),
}


@dataclass(frozen=True)
class AlgorithmConfig:
    """Everything the pure algorithm layer needs; validated on construction."""

    SECTION = "AlgorithmConfig"  # the loader re-homes errors to algorithm in a run

    advantage_estimator: AdvantageEstimator = "grpo"
    """Group advantage estimator: one of ADVANTAGE_ESTIMATOR_NAMES."""

    correction: Correction = "entr"
    """Off-policy correction (per-token weight / mask / ratio anchor): one of CORRECTION_NAMES."""

    correction_mode: CorrectionMode = "published"
    """'published': each baseline as its authors define it (docs/ENTR.md's table: e.g. IcePop
    weights pi_old/mu inside its band on PPO against pi_old). 'mask_only': every baseline is
    only its keep rule, judged like ENTR on pi_theta / mu, weight 1, PPO against mu, masked
    tokens in the denominator: ENTR's composition with another rule, to isolate the masks.
    ENTR and 'none' are the same in both; 'tis' and 'naive' have no mask and refuse 'mask_only'."""

    tau: float = 1.0
    """ENTR threshold: keep a token when delta^2 / (H + entr_eps) <= tau. Also sets the
    soft-ENTR clamp width. > 0. 1.0 admits |delta| <= 1.0 at H = 1 nat; the calibration study
    (docs/studies/tau, inter_lag 16, 3 seeds) found it best, masking 9-14% of tokens (ENTR.md)."""

    entr_eps: float = 0.01
    """ENTR entropy floor eps in delta^2 / (H + eps) (paper value 0.01). > 0."""

    random_drop_fraction: float = 0.02
    """random_drop (a control, not a correction): the share of each micro-batch's valid tokens
    dropped at random, whatever ENTR would drop; PPO against mu otherwise. In [0, 1); 0 is 'none'."""

    calibrated_z: float = 3.5
    """entr_calibrated: keep a token when its calibrated score S <= z^2. > 0."""

    calibrated_min_sigma2: float = 1e-6
    """entr_calibrated: lower bound on the batch scale sigma2_hat, so a batch whose median
    deviation is exactly 0 (bitwise on-policy) does not mask every token that moved. > 0."""

    soft_mask_multiple: float = 2.0
    """entr_soft: hard-mask tokens with |delta| > soft_mask_multiple * b, b = sqrt(tau (H + eps)). >= 1."""

    tis_cap: float = 2.0
    """tis: truncation C of the importance weight min(pi_old / mu, C) (Yao et al. 2025; verl's
    rollout_is_threshold 2.0, slime's --tis-clip 2.0). > 0."""

    mis_token_band: tuple[float, float] = (0.5, 2.0)
    """mis_token: token-level masked IS, weight rho * 1[lo <= rho <= hi], rho = pi_old / mu
    (verl: IS cap 2, rejection lower bound 1 / upper). 0 <= lo <= 1 <= hi; hi may be .inf (no upper
    bound: the bands are the only fields that take .inf)."""

    mis_seq_band: tuple[float, float] = (0.5, 2.0)
    """mis_seq: sequence-level masked IS (Seq-MIS, verl's decoupled_seq_is_rs preset): weight
    prod_t rho_t inside [lo, hi], the whole sequence dropped outside. 0 <= lo <= 1 <= hi; hi may be .inf."""

    mis_geo_band: tuple[float, float] = (0.999, 1.001)
    """mis_geo: geometric rejection (verl's geo_rs presets, rs_threshold "0.999_1.001"): drop a
    sequence whose exp(mean_t log rho_t) is outside [lo, hi], weight 1. 0 <= lo <= 1 <= hi; hi may be .inf."""

    icepop_band: tuple[float, float] = (0.5, 5.0)
    """icepop: weight k * 1[lo <= k <= hi], k = pi_old / mu (Ring-1T's alpha = 0.5, beta = 5).
    0 <= lo <= 1 <= hi; hi may be .inf (no upper bound)."""

    kpop_threshold: float = 0.1
    """kpop: drop a token when max(D(p || q), D(q || p)) > this (nats), D the KL between the
    Bernoulli outcomes "token y / any other" with p = pi_old(y), q = mu(y) (AReaL's binary_kl
    rejection; 0.1 is the value reported as the post's default, unverified). > 0."""

    m2po_threshold: float = 0.04
    """m2po: drop the largest (log pi_theta / mu)^2 until the mean of the kept tokens is <= this
    (the M2PO paper's tau = 0.04 in every experiment). > 0."""

    decoupled_cap: float = 5.0
    """decoupled (AReaL): cap of the behaviour weight pi_prox / mu (AReaL's examples:
    behav_imp_weight_cap 5.0). > 0."""

    decoupled_cap_mode: CapMode = "drop"
    """decoupled and a3po: 'drop' tokens whose behaviour weight exceeds decoupled_cap (AReaL: weight 0,
    still counted in the denominator) or 'clamp' the weight to the cap (truncated IS)."""

    tis_level: TisLevel = "token"
    """tis: 'token' truncates each token's pi_old / mu at tis_cap (TRL's vllm_importance_sampling_mode
    token_truncate); 'sequence' truncates the sequence's product prod_t pi_old / mu and puts it on
    every token (TRL's sequence_truncate, verl's rollout_is 'sequence' with a float threshold)."""

    opsm_threshold: float = 0.5
    """opsm: a sequence with a negative advantage is dropped when its mean log(mu / pi_theta) is
    > this (DeepSeek-V3.2's delta; the paper gives no value: 0.5 is TRL's documented suggestion for
    off_policy_mask_threshold, which judges the same mu-vs-pi_theta statistic; slime's --opsm-delta
    1e-4 judges pi_old vs pi_theta). > 0."""

    trm_statistic: TrmStatistic = "max"
    """trm: the sequence statistic of the per-token k3 = rho - 1 - log rho, rho = pi_old / mu:
    'max' (the TRM paper: a sequence is rejected when any token leaves the trust region; verl's
    seq_max_k3) or 'mean' (verl's seq_mean_k3)."""

    trm_threshold: float = 0.01
    """trm: reject a sequence when its k3 statistic is > this (verl's rollout_rs_threshold; 0.01 is
    its seq_mean_k3 presets' value, the paper's is not published). > 0."""

    dppo_ratio_cap: float = 10.0
    """dppo_tv / dppo_kl: the detached ratio in the loss -A sg(min(r, C)) log pi is truncated at C
    (the DPPO authors' code, clip_ratio_c 10.0; verl's actor.yaml gives 3.0). > 1."""

    sapo_tau_pos: float = 1.0
    """sapo: temperature of the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau for A > 0 (SAPO's,
    verl's and AReaL's 1.0). > 0."""

    sapo_tau_neg: float = 1.05
    """sapo: the gate's temperature for A <= 0 (1.05 in SAPO, verl and AReaL). > 0."""

    vespo_k: tuple[float, float] = (2.0, 3.0)
    """vespo: the exponent k of phi(w) = e^lambda w^k e^(-lambda w), (for A >= 0, for A < 0)
    (TRL's vespo_k_pos 2.0, vespo_k_neg 3.0, as the authors' code). Each > 0."""

    vespo_lambda: tuple[float, float] = (3.0, 2.0)
    """vespo: lambda of phi(w), (for A >= 0, for A < 0) (TRL's vespo_lambda_pos 3.0, vespo_lambda_neg
    2.0, as the authors' code). Each > 0."""

    policy_loss: PolicyLoss = "ppo_clip"
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

    loss_agg_mode: LossAggMode | None = None
    """How per-token losses become one scalar: one of LOSS_AGG_MODES; None takes the policy
    loss's published one (DEFAULT_LOSS_AGG_MODES: seq-mean-token-mean for GSPO, token-mean
    otherwise). The resolved mode is `aggregation`."""

    loss_norm_tokens: int | None = None
    """seq-mean-token-sum-norm's constant L in sum_it l_it / (num_seqs * L): Dr.GRPO divides
    by the generation budget, so a run fills it from rollout.sampling.max_new_tokens when unset.
    >= 1. None outside a run: the batch's padded width."""

    rejected_in_denominator: bool | None = None
    """Whether tokens a correction rejects still count in the loss denominator. None: the
    method's own choice (False for mis_* as verl's rejection sampling, True otherwise, always
    True with correction_mode 'mask_only'). The resolved value is `counts_rejected`."""

    entropy_source: EntropySource = "learner"
    """Which entropy ENTR divides by: 'learner' (H(pi_theta), same forward pass) or
    'rollout' (H(mu) returned by the engine, as in the paper)."""

    routing_replay: RoutingReplay = "off"
    """MoE routing replay (docs/ENTR.md, "Routing replay"): one of ROUTING_REPLAY_MODES. 'off': the
    learner routes every forward itself. 'r3': the learner replays the experts the engine chose for
    each token (needs an MoE model and routes recorded by the engine: the embedded engine and
    SGLang servers with --enable-return-routed-experts record them when this is 'r3' or
    rollout.record_routes is on). 'r2': the training forward replays the
    learner's own routing recorded when the batch's old policy was scored (compute_logprobs). The
    gate probabilities of the replayed experts stay differentiable in both."""

    add_entr_mask: bool = False
    """ENTR's keep rule (tau, entr_eps, entropy_source) on top of another correction: a token is kept
    when both keep it; the correction's weight, anchor and denominator stay. `correction: naive`
    with this is ENTR's mask on asynchronous GRPO (PPO against pi_old), the paper's comparison;
    `policy_loss: reinforce` with `correction: none` and this asks whether the mask alone is a
    trust region. Not with the ENTR family or its matched ablations (they are the rule)."""

    add_random_mask: bool = False
    """The control of add_entr_mask: on top of another correction, drop as many valid tokens as ENTR's
    rule (tau, entr_eps, entropy_source) would drop on each micro-batch, chosen uniformly at random
    (matched_random's choice); the correction's weight, anchor and denominator stay. `correction:
    naive` with this asks whether ENTR's rescue of asynchronous GRPO lies in which tokens it drops or
    in how many. Not with add_entr_mask, nor with the ENTR family or its matched ablations."""

    mask_diagnostics: bool = True
    """Per step, what the mask did on its own tokens (algorithm/mask_diagnostics.py):
    `mask/effective_fraction` (dropped tokens that would otherwise carry a gradient) and
    `counterfactual/<rule>/mask_fraction` of entr, icepop, tis, m2po, kpop and dppo at this
    config's settings. A few elementwise passes over each micro-batch's [B, T] tokens."""

    measure_unreplayed: bool = False
    """With routing_replay 'r2' or 'r3': one more forward-only pass of each rollout batch before
    its first optimizer step, in which the learner routes every token itself, logging the
    mismatch replay removes in the same run: mismatch_unreplayed/{k3, mean_abs_delta, tokens}
    and mismatch_unreplayed/entropy_bin/<lo>-<hi>/k3, beside the replayed step's mismatch/k3
    and entropy_bin/<lo>-<hi>/k3. Costs one forward of the batch per step. Nothing with
    routing_replay 'off' (its mismatch/k3 is the unreplayed one), so that a study can grid over
    routing_replay with this on."""

    def __post_init__(self) -> None:
        choice(self, "advantage_estimator", AdvantageEstimator)
        choice(self, "correction", Correction)
        choice(self, "policy_loss", PolicyLoss)
        if self.loss_agg_mode is not None:
            choice(self, "loss_agg_mode", LossAggMode)
        choice(self, "entropy_source", EntropySource)
        choice(self, "correction_mode", CorrectionMode)
        choice(self, "decoupled_cap_mode", CapMode)
        choice(self, "tis_level", TisLevel)
        choice(self, "trm_statistic", TrmStatistic)
        if self.routing_replay is False:  # YAML 1.1 (PyYAML) reads an unquoted off as false
            object.__setattr__(self, "routing_replay", "off")
        choice(self, "routing_replay", RoutingReplay)
        boolean(self, "measure_unreplayed")
        boolean(self, "mask_diagnostics")
        boolean(self, "add_entr_mask")
        boolean(self, "add_random_mask")
        for added in ("add_entr_mask", "add_random_mask"):
            if getattr(self, added) and self.correction in ENTR_MASKING:
                raise bad(self, added, True,
                          "must be false: it adds a mask of ENTR's rule (or of its size) to another correction, and "
                          "this one is ENTR's rule (or its matched ablation) already",
                          when=f"correction={self.correction!r}")
        if self.add_entr_mask and self.add_random_mask:
            raise bad(self, "add_random_mask", True, "must be false beside add_entr_mask: it is that mask's control "
                      "(choose one)", when="add_entr_mask=true")
        if self.correction_mode == "mask_only" and self.correction in ("tis", "naive"):
            raise bad(
                self, "correction_mode", self.correction_mode, "use correction_mode='published'",
                when=f"correction={self.correction!r}: it has no mask (mask_only would make it 'none')",
            )
        integer(self, "loss_norm_tokens", low=1, optional=True)
        boolean(self, "rejected_in_denominator", optional=True)
        for name in (
            "tau",
            "entr_eps",
            "calibrated_z",
            "calibrated_min_sigma2",
            "tis_cap",
            "kpop_threshold",
            "m2po_threshold",
            "decoupled_cap",
            "opsm_threshold",
            "trm_threshold",
            "sapo_tau_pos",
            "sapo_tau_neg",
        ):
            number(self, name, low=0.0, low_open=True)
        number(self, "dppo_ratio_cap", low=1.0, low_open=True)
        number(self, "random_drop_fraction", low=0.0, high=1.0, high_open=True)
        for name in ("vespo_k", "vespo_lambda"):
            _positive_pair(self, name)
        number(self, "soft_mask_multiple", low=1.0)
        for name in ("mis_token_band", "mis_seq_band", "mis_geo_band", "icepop_band"):
            _unit_band(self, name)
        if self.eps_clip_low is not None:
            number(self, "eps_clip_low", low=0.0, high=1.0)
        if self.eps_clip_high is not None:
            number(self, "eps_clip_high", low=0.0)
        if self.dual_clip_c is not None:
            number(self, "dual_clip_c", low=1.0, low_open=True)

    def clip_range(self, loss_name: str | None = None) -> tuple[float, float]:
        """(eps_low, eps_high) for `loss_name` (default: self.policy_loss); unset values
        fall back to that loss's CLIP_RANGE_DEFAULTS entry."""
        default_low, default_high = CLIP_RANGE_DEFAULTS[loss_name or self.policy_loss]
        low = default_low if self.eps_clip_low is None else float(self.eps_clip_low)
        high = default_high if self.eps_clip_high is None else float(self.eps_clip_high)
        return low, high

    @property
    def aggregation(self) -> str:
        """The loss aggregation in force: loss_agg_mode, or the policy loss's published default."""
        return self.loss_agg_mode or DEFAULT_LOSS_AGG_MODES[self.policy_loss]

    @property
    def counts_rejected(self) -> bool:
        """rejected_in_denominator resolved (see there)."""
        if self.rejected_in_denominator is not None:
            return self.rejected_in_denominator
        return self.correction_mode == "mask_only" or self.correction not in REJECTED_LEAVE_DENOMINATOR

    @property
    def uses_old_logprobs(self) -> bool:
        """True when the correction anchors on pi_old, the policy before the rollout batch's first
        optimizer step (published mode of CORRECTIONS_ON_OLD_POLICY). With several optimizer
        steps per rollout batch the learner then recomputes it; with one it is the current
        policy, detached, in the same pass."""
        return self.correction_mode == "published" and self.correction in CORRECTIONS_ON_OLD_POLICY



def _positive_pair(obj: AlgorithmConfig, name: str) -> None:
    """A (for A >= 0, for A < 0) pair of positive numbers; stored as a tuple of floats."""
    value = getattr(obj, name)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(is_number(v) and v > 0 for v in value)):
        raise bad(obj, name, value, "must be a pair [for A >= 0, for A < 0] of numbers > 0")
    object.__setattr__(obj, name, (float(value[0]), float(value[1])))


def _unit_band(obj: AlgorithmConfig, name: str) -> None:
    """A [lo, hi] band around ratio 1; YAML gives lists, stored as an immutable, hashable tuple of floats.

    hi = +inf (YAML .inf) is "no upper bound", the one use of a non-finite number in a run's config."""
    value = getattr(obj, name)
    pair = (isinstance(value, (tuple, list)) and len(value) == 2 and is_number(value[0])
            and (is_number(value[1]) or value[1] == math.inf))
    if not pair or not 0.0 <= value[0] <= 1.0 <= value[1]:
        rule = ("must be a pair [lo, hi] of numbers with 0 <= lo <= 1 <= hi (on-policy tokens, ratio 1, must be "
                "kept); hi may be .inf (no upper bound), lo must be finite")
        raise bad(obj, name, value, rule)
    object.__setattr__(obj, name, (float(value[0]), float(value[1])))

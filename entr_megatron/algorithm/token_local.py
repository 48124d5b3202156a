"""Which configured objectives are token-local: the gradient known per token in the forward pass.

A loss is token-local when d numerator / d logprob_t depends only on token t's log-prob and
entropy and on inputs known before the pass (advantage, mu, pi_old, versions, masks, and an
aggregation scale fixed by the response mask). Then the fused output op
(parallel/fused_output_loss.py) computes each token's gradient as soon as its log-prob is
known, and the backward pass recomputes nothing.

Not token-local: a sequence-level ratio or statistic (gspo, vespo, opsm, trm, mis_seq, mis_geo,
tis at sequence level), a batch statistic (m2po's second moment, entr_calibrated's median, the
matched ablations' ranking over the micro-batch), and a denominator of kept tokens only
(``counts_rejected`` False: seq-mean's 1/|o_i| would move with other tokens' masks).
The entropy is read detached by every loss (learner/loss.py), so no gradient flows to it.
Keys are those of CORRECTIONS and POLICY_LOSSES; tests/unit/test_token_local.py keeps them in step.
"""

from __future__ import annotations

from entr_megatron.config.algorithm import AlgorithmConfig

__all__ = ["TOKEN_LOCAL_CORRECTIONS", "TOKEN_LOCAL_POLICY_LOSSES", "is_token_local", "token_local_reason"]

# Per-token weight, keep mask and anchor: each reads only its own token's log-probs and entropy.
TOKEN_LOCAL_CORRECTIONS = frozenset({
    "none", "naive", "entr", "entr_soft", "tis", "mis_token", "icepop", "kpop", "decoupled", "a3po",
})
# Per-token losses: l_t a function of logprob_t and the correction's per-token outputs.
TOKEN_LOCAL_POLICY_LOSSES = frozenset({"ppo_clip", "reinforce", "cispo", "nll", "dppo_tv", "dppo_kl", "sapo"})


def token_local_reason(cfg: AlgorithmConfig) -> str | None:
    """None when `cfg`'s objective is token-local (see the module docstring), else why not."""
    if cfg.correction not in TOKEN_LOCAL_CORRECTIONS:
        return f"correction {cfg.correction!r} reads other tokens (a sequence or batch statistic)"
    if cfg.correction == "tis" and cfg.tis_level != "token":
        return f"tis_level {cfg.tis_level!r} weighs each token by its sequence's ratio"
    if cfg.policy_loss not in TOKEN_LOCAL_POLICY_LOSSES:
        return f"policy_loss {cfg.policy_loss!r} has a sequence-level ratio"
    if not cfg.counts_rejected:
        return "rejected tokens leave the denominator (rejected_in_denominator false): it depends on the log-probs"
    return None


def is_token_local(cfg: AlgorithmConfig) -> bool:
    """Whether `cfg`'s per-token gradient is known in the forward pass (`token_local_reason` is None)."""
    return token_local_reason(cfg) is None

"""Sampling next tokens, and the exact log-prob and entropy of the distribution sampled.

The behaviour log-prob ENTR needs is log q(y) under the distribution q the token
was actually drawn from, so q is defined once, here, and everything (the draw,
the log-prob, the entropy) uses it. For row b with logits z (math in float32):

1. temperature T > 0: x = z / T (greedy rows: x = z, see below).
2. top-k (k >= 1): keep the tokens whose x is >= the k-th largest x (ties with
   the k-th are kept, as in HF and vLLM).
3. top-p (< 1): p = softmax of the kept x; going down p (ties: lower token id
   first) keep the shortest prefix whose mass reaches top_p, i.e. a token is kept
   iff the mass strictly before it is < top_p. The most likely token always stays.
4. q = softmax of x over the kept set, 0 elsewhere (truncated and renormalised).

The token is drawn by inverse CDF (in token-id order) from one uniform of the
row's own generator, so a request's tokens do not depend on the other rows of
the batch. Returned:
token, log q(token), H(q) = -sum_v q_v log q_v.

Greedy (T == 0): the token is argmax z (the first index on ties, as torch.argmax
and HF generate), and greedy rows report the model's T=1 log-softmax, as SGLang
does: q is softmax(z) over the whole vocabulary (top-k and top-p ignored), so
the log-prob is log softmax(z)(token) and the entropy H(softmax(z)). The point
mass the token really came from would give 0 and 0, which tells a user comparing
the engine with the trainer nothing. (SGLang's `Sampler.forward`,
python/sglang/srt/layers/sampler.py, returns log_softmax(logits) for an all-greedy
batch; its greedy requests run at temperature 1.) A greedy token is never trained
on (rollouts for training are sampled at T > 0), so no ENTR ratio refers to this q.
`raw_logprobs` (untruncated, T = 1) is the same number for greedy rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from entr_megatron.rollout.engine import SamplingParams

__all__ = ["SampledTokens", "row_params", "sample_tokens", "sampling_logprobs"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SampledTokens:
    """One sampled token per row and what describes its distribution."""

    tokens_B: torch.Tensor
    """int64 token ids."""
    logprobs_B: torch.Tensor
    """float32 log q(token) (greedy rows: log softmax(z)(token), module docstring)."""
    entropy_B: torch.Tensor
    """float32 H(q) (greedy rows: H(softmax(z)))."""
    raw_logprobs_B: torch.Tensor | None = None
    """float32 log softmax(z)(token) at T = 1, untruncated (only when asked for)."""


def row_params(params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature_B float32, top_p_B float32, top_k_B int64; 0 = no top-k)."""
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long),
    )


# --- the steps that define q -------------------------------------------------------------


def _scaled(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """x = z / T in float32 (T = 1 for greedy rows)."""
    t_B = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
    return logits_BV.float() / t_B[:, None]


def _kept(x_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """bool [B, V] in token-id order: which tokens survive top-k, then top-p."""
    vocab = x_BV.shape[-1]
    truncated_B = (top_k_B >= 1) & (top_k_B < vocab) | (top_p_B < 1.0)
    if not bool(truncated_B.any()):
        return torch.ones_like(x_BV, dtype=torch.bool)
    # Stable descending sort: ties keep token-id order, so "lower id first" is the tie rule.
    x_sorted_BV, token_BV = torch.sort(x_BV, dim=-1, descending=True, stable=True)
    k_B = torch.where(top_k_B >= 1, top_k_B.clamp(max=vocab), torch.full_like(top_k_B, vocab))
    kth_B1 = x_sorted_BV.gather(-1, (k_B - 1)[:, None])
    keep_BV = x_sorted_BV >= kth_B1
    p_BV = torch.softmax(x_sorted_BV.masked_fill(~keep_BV, _NEG_INF), dim=-1)
    mass_before_BV = p_BV.cumsum(-1) - p_BV
    # top_p == 1 must keep everything: the float32 cumsum can reach 1.0 before the tail ends.
    keep_BV &= (mass_before_BV < top_p_B[:, None]) | (top_p_B >= 1.0)[:, None]
    keep_BV[:, 0] = True
    return torch.empty_like(keep_BV).scatter_(-1, token_BV, keep_BV)


def _support(
    x_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """The kept set of q: `_kept`, except that greedy rows keep the whole vocabulary."""
    greedy_B = temperature_B == 0
    return _kept(x_BV, top_k_B.masked_fill(greedy_B, 0), top_p_B.masked_fill(greedy_B, 1.0))


def _log_q(x_BV: torch.Tensor, keep_BV: torch.Tensor) -> torch.Tensor:
    """log q: log-softmax of x over the kept set, -inf elsewhere."""
    return torch.log_softmax(x_BV.masked_fill(~keep_BV, _NEG_INF), dim=-1)


def _entropy(log_q_BV: torch.Tensor, keep_BV: torch.Tensor) -> torch.Tensor:
    """H(q) = -sum q log q over the kept set (0 log 0 = 0 outside it)."""
    log_q_BV = log_q_BV.masked_fill(~keep_BV, 0.0)
    return -(log_q_BV.exp() * log_q_BV).masked_fill(~keep_BV, 0.0).sum(-1)


def _uniforms(batch: int, generators: torch.Generator | Sequence[torch.Generator | None] | None) -> torch.Tensor:
    """u in [0, 1) (float64) per row: from each row's generator (a list), one shared generator,
    or torch's default generator (None)."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(batch, generator=generators, dtype=torch.float64)
    if len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} rows")
    return torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])


def _draw(log_q_BV: torch.Tensor, keep_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in token-id order (independent of how the batch was sorted): the first
    token whose cumulative q exceeds u * total; the CDF only rises on kept tokens."""
    cdf_BV = log_q_BV.exp().double().cumsum(-1)
    target_B1 = (u_B * cdf_BV[:, -1])[:, None]
    token_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    # Rounding can put the target at the very top of the CDF: take the last kept token.
    last_kept_B = keep_BV.shape[-1] - 1 - keep_BV.flip(-1).int().argmax(-1)
    return torch.minimum(token_B, last_kept_B)


# --- public ------------------------------------------------------------------------------


def sample_tokens(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    generators: torch.Generator | Sequence[torch.Generator | None] | None = None,
    *,
    raw_logprobs: bool = False,
) -> SampledTokens:
    """Draw one token per row from q (greedy rows: take its argmax; module docstring) and
    return log q(token) and H(q).

    `generators`: one per row (greedy rows may pass None; they draw nothing), or a
    single generator for all rows, or None for torch's default generator.
    """
    if logits_BV.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits_BV.shape)}")
    x_BV = _scaled(logits_BV, temperature_B)
    keep_BV = _support(x_BV, temperature_B, top_k_B, top_p_B)
    log_q_BV = _log_q(x_BV, keep_BV)

    tokens_B = logits_BV.argmax(-1)
    sampled = (temperature_B != 0).nonzero().squeeze(-1)
    if sampled.numel():
        if generators is None or isinstance(generators, torch.Generator):
            gens = generators
        else:
            if len(generators) != logits_BV.shape[0]:
                raise ValueError(f"{len(generators)} generators for {logits_BV.shape[0]} rows")
            gens = [generators[i] for i in sampled.tolist()]
        u_S = _uniforms(sampled.numel(), gens).to(logits_BV.device)  # drawn on the CPU: the same on any device
        tokens_B[sampled] = _draw(log_q_BV[sampled], keep_BV[sampled], u_S)

    logprobs_B = log_q_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    entropy_B = _entropy(log_q_BV, keep_BV)
    raw_B = None
    if raw_logprobs:
        raw_B = torch.log_softmax(logits_BV.float(), dim=-1).gather(-1, tokens_B[:, None]).squeeze(-1)
    return SampledTokens(tokens_B, logprobs_B, entropy_B, raw_B)


def sampling_logprobs(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor
) -> torch.Tensor:
    """log q [B, V] (-inf outside the support): the distribution `sample_tokens` draws from
    and reports log q(token) and H(q) of. Greedy rows: log softmax(z) at T = 1 over the whole
    vocabulary (`sample_tokens` takes its argmax instead of drawing)."""
    x_BV = _scaled(logits_BV, temperature_B)
    return _log_q(x_BV, _support(x_BV, temperature_B, top_k_B, top_p_B))

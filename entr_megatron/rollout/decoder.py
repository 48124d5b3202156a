"""Continuous batching over one HF causal LM: requests join and leave between steps.

A step is either a batched prefill of newly admitted requests (which samples their
first token) or one batched decode step of every running request. Between steps
the engine may add, abort, or swap weights (`version` then changes, and every
later token carries the new version).

KV cache: one tensor pair per layer, [B, H, L, D], rows right-aligned (left
padding) with a [B, L] attention mask; position ids count each row's real
tokens, so padding never shifts RoPE. Invariant for a running row: the cache
holds prompt + output[:-1]; output[-1] was sampled and is fed by the next decode
step. Rows that finish are dropped (and all-padding leading columns trimmed);
admitted rows are prefilled on their own and merged in, padding the shorter cache
on the left. After a weight swap the cache is kept by default (its entries were
computed by the previous weights: an in-flight update) or recomputed with the new
weights (`recompute_cache`).

Routes (`record_routes`, MoE models): a token's experts are known when it is fed to
the model, so a sample holds those of its prompt (prefill) and of every response
token but the last (each fed by the next decode step): ``P + R - 1`` rows. A cache
recomputed after a swap replaces them with the new weights' routes, the ones the
cache now holds.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from entr_megatron.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from entr_megatron.rollout.hf_model import CausalLM
from entr_megatron.rollout.sampling import row_params, sample_tokens
from entr_megatron.utils.seeding import mix_seed

__all__ = ["BatchDecoder", "sample_seed"]

KV = list[tuple[torch.Tensor, torch.Tensor]]


def sample_seed(seed: int, sample_index: int) -> int:
    """Seed of sample `sample_index` of a request seeded `seed`: hashed, so that requests
    with neighbouring seeds do not share samples (seed s, sample 1 vs seed s + 1, sample 0)."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class _Sequence:
    """One sample in flight."""

    request: GenerateRequest
    sample_index: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    """``[n, moe_layers, k]`` chunks of the routes of the tokens fed so far (record_routes only)."""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def result(self, finish_reason: str) -> GenerateResult:
        r = self.request
        return GenerateResult(
            request_id=r.request_id, sample_index=self.sample_index, prompt_ids=list(r.prompt_ids),
            output_ids=self.output_ids, logprobs=self.logprobs, versions=self.versions,
            finish_reason=finish_reason, entropy=self.entropy,
            raw_logprobs=self.raw_logprobs if r.params.return_raw_logprobs else None,
            group_id=r.group_id, metadata=r.metadata, routed_experts=self._routed_experts(),
        )

    def _routed_experts(self) -> torch.Tensor | None:
        """``[P + R - 1, moe_layers, k]``, or None (no routes, or aborted before its prefill)."""
        if not self.routes:
            return None
        routes = torch.cat(self.routes)
        return routes if routes.shape[0] == len(self.request.prompt_ids) + len(self.output_ids) - 1 else None


class BatchDecoder:
    """Continuous batched generation with per-token log-probs, entropies and versions (one process, no threads)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 8192,
        eos_token_ids: Iterable[int] = (),
        version: int = 0,
        seed: int = 0,
        record_routes: bool = False,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.lm = CausalLM(model, record_routes=record_routes)
        self.device = next(model.parameters()).device
        """Where the model, its KV cache and the sampling live (per-sample generators stay on the CPU)."""
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or self.lm.max_positions
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.version = version
        """Weight version of the model now: set by whoever swaps weights in."""
        self._seeds = torch.Generator().manual_seed(seed)  # seeds for requests without one
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []  # row i of the cache
        self._kv: KV | None = None
        self._mask: torch.Tensor | None = None  # bool [B, L]
        self.steps = 0
        self.generated_tokens = 0

    # --- membership ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def add(self, request: GenerateRequest) -> None:
        """Queue a request's n samples (its `request_id` must be set)."""
        assert request.request_id is not None
        if self.max_model_len is not None and len(request.prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {len(request.prompt_ids)} tokens leaves no room "
                f"(max_model_len {self.max_model_len})"
            )
        bad = [t for t in request.prompt_ids if t >= self.lm.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id}: token ids {bad[:3]} >= vocab size {self.lm.vocab_size}")
        p = request.params
        stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seeds))
        for i in range(p.n):
            gen = None if p.greedy else torch.Generator().manual_seed(sample_seed(seed, i))
            self._waiting.append(_Sequence(request, i, stop, gen))

    @torch.inference_mode()
    def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        """Remove these requests' samples; results with finish_reason "abort" (tokens so far)."""
        ids = set(request_ids)
        results = [s.result("abort") for s in self._waiting if s.request.request_id in ids]
        self._waiting = collections.deque(s for s in self._waiting if s.request.request_id not in ids)
        keep = [i for i, s in enumerate(self._running) if s.request.request_id not in ids]
        results += [s.result("abort") for s in self._running if s.request.request_id in ids]
        self._select(keep)
        return results

    # --- steps ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[GenerateResult]:
        """One prefill (if requests wait and there is room) or one decode step; finished samples."""
        finished: list[GenerateResult] = []
        if self._waiting and len(self._running) < self.max_batch_size:
            admitted = self._admit()
            logits_BV, kv, mask_BL = self._prefill([s.request.prompt_ids for s in admitted])
            self._keep_routes(admitted, mask_BL, replace=False)
            keep = self._sample(admitted, logits_BV, finished)
            self._merge(admitted, kv, mask_BL, keep)
        elif self._running:
            logits_BV = self._decode()
            self._keep_routes(self._running, None, replace=False)
            self._select(self._sample(self._running, logits_BV, finished))
        self.steps += 1
        return finished

    @torch.inference_mode()
    def recompute_cache(self) -> None:
        """Rebuild the KV cache of every running row with the current weights."""
        if self._running:
            _, self._kv, self._mask = self._prefill([s.request.prompt_ids + s.output_ids[:-1] for s in self._running])
            self._keep_routes(self._running, self._mask, replace=True)

    def _keep_routes(self, rows: list[_Sequence], mask_BL: torch.Tensor | None, replace: bool) -> None:
        """Append (or, `replace`, set) each row's routes of the forward just run: the real
        (unpadded) positions of a prefill (`mask_BL`), the one fed token of a decode step."""
        routes_BSLK = self.lm.last_routes
        if routes_BSLK is None:
            return
        for i, s in enumerate(rows):
            mine = routes_BSLK[i] if mask_BL is None else routes_BSLK[i][mask_BL[i]]
            if replace:
                s.routes.clear()
            s.routes.append(mine.to("cpu", copy=True))  # results leave the process: host memory

    def _admit(self) -> list[_Sequence]:
        """Waiting samples for one prefill: up to the free rows and the padded-token budget."""
        admitted: list[_Sequence] = []
        longest = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
            n = len(self._waiting[0].request.prompt_ids)
            if admitted and max(longest, n) * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            longest = max(longest, n)
            admitted.append(self._waiting.popleft())
        return admitted

    def _prefill(self, token_lists: list[list[int]]) -> tuple[torch.Tensor, KV, torch.Tensor]:
        """Left-padded batched forward over whole sequences: (last logits [b, V], cache, mask [b, P])."""
        width = max(len(t) for t in token_lists)
        ids_BP = torch.zeros(len(token_lists), width, dtype=torch.long)
        mask_BP = torch.zeros(len(token_lists), width, dtype=torch.bool)
        for i, tokens in enumerate(token_lists):
            ids_BP[i, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask_BP[i, width - len(tokens):] = True
        ids_BP, mask_BP = ids_BP.to(self.device), mask_BP.to(self.device)
        pos_BP = (mask_BP.long().cumsum(-1) - 1).clamp(min=0)
        logits_BV, kv = self.lm.forward(ids_BP, mask_BP, pos_BP, None)
        return logits_BV, kv, mask_BP

    def _decode(self) -> torch.Tensor:
        """Feed every running row's last sampled token; logits [B, V]."""
        assert self._mask is not None and self._kv is not None
        ids_B1 = torch.tensor([[s.output_ids[-1]] for s in self._running], dtype=torch.long, device=self.device)
        pos_B1 = self._mask.sum(-1, keepdim=True)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._running), 1)], dim=-1)
        logits_BV, self._kv = self.lm.forward(ids_B1, self._mask, pos_B1, self._kv)
        return logits_BV

    def _sample(self, rows: list[_Sequence], logits_BV: torch.Tensor, finished: list[GenerateResult]) -> list[int]:
        """Sample one token per row, record it, move finished rows to `finished`; the rows that go on."""
        temperature_B, top_p_B, top_k_B = (t.to(self.device) for t in row_params([s.params for s in rows]))
        out = sample_tokens(
            logits_BV, temperature_B, top_p_B, top_k_B, [s.generator for s in rows],
            raw_logprobs=any(s.params.return_raw_logprobs for s in rows),
        )
        tokens, logprobs, entropy = out.tokens_B.tolist(), out.logprobs_B.tolist(), out.entropy_B.tolist()
        raw = out.raw_logprobs_B.tolist() if out.raw_logprobs_B is not None else None
        keep: list[int] = []
        for i, s in enumerate(rows):
            s.output_ids.append(tokens[i])
            s.logprobs.append(logprobs[i])
            s.entropy.append(entropy[i])
            s.versions.append(self.version)
            if raw is not None:
                s.raw_logprobs.append(raw[i])
            reason = self._finish_reason(s)
            if reason is None:
                keep.append(i)
            else:
                finished.append(s.result(reason))
        self.generated_tokens += len(rows)
        return keep

    def _finish_reason(self, s: _Sequence) -> str | None:
        if s.output_ids[-1] in s.stop_ids:
            return "stop"
        if len(s.output_ids) >= s.params.max_new_tokens:
            return "length"
        if self.max_model_len is not None and len(s.request.prompt_ids) + len(s.output_ids) >= self.max_model_len:
            return "length"
        return None

    # --- cache rows ----------------------------------------------------------------------

    def _select(self, rows: list[int]) -> None:
        """Keep these running rows (in this order); trim leading columns that are padding in every row."""
        if len(rows) == len(self._running):
            return
        self._running = [self._running[i] for i in rows]
        if not rows:
            self._kv, self._mask = None, None
            return
        assert self._mask is not None and self._kv is not None
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask_BL = self._mask[idx]
        first = int(mask_BL.any(0).nonzero()[0])
        self._mask = mask_BL[:, first:]
        self._kv = [(k[idx, :, first:], v[idx, :, first:]) for k, v in self._kv]

    def _merge(self, admitted: list[_Sequence], kv: KV, mask_BL: torch.Tensor, rows: list[int]) -> None:
        """Append the still-running admitted rows (and their cache) to the running batch."""
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        new = [admitted[i] for i in rows]
        kv = [(k[idx], v[idx]) for k, v in kv]
        mask_BL = mask_BL[idx]
        if self._kv is None:
            self._running, self._kv, self._mask = new, kv, mask_BL
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], mask_BL.shape[1])

        def left_pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            return F.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0)) if missing else t

        self._kv = [
            (torch.cat([left_pad(k0, 2), left_pad(k1, 2)]), torch.cat([left_pad(v0, 2), left_pad(v1, 2)]))
            for (k0, v0), (k1, v1) in zip(self._kv, kv)
        ]
        self._mask = torch.cat([left_pad(self._mask, 1), left_pad(mask_BL, 1)])
        self._running = self._running + new


def decode_all(model: CausalLM, prompts: list[list[int]], params: SamplingParams, max_batch_size: int,
               eos_token_ids: Iterable[int]) -> list[GenerateResult]:
    """Every sample of every prompt, decoded in this process (no engine around the decoder), in
    prompt order then sample index: what the measuring tools compare with a learner's scores.
    A seeded `params` seeds prompt i with mix_seed(seed, i), as the evaluation does: one seed for
    every prompt would give sample k of each prompt the same random stream, so a rare token drawn
    at one prompt's sure position would be drawn at every prompt's alike position, and counts of
    rare tokens would rest on n streams, not on every sample."""
    dec = BatchDecoder(model, max_batch_size=max_batch_size, eos_token_ids=eos_token_ids)
    for i, ids in enumerate(prompts):
        own = params if params.seed is None else replace(params, seed=mix_seed(params.seed, i))
        dec.add(GenerateRequest(ids, own, request_id=str(i)))
    results = []
    while dec.has_work():
        results.extend(dec.step())
    results.sort(key=lambda r: (int(r.request_id), r.sample_index))
    return results

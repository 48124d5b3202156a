"""The `RolloutEngine` interface and the records that cross it.

An engine takes generation requests (prompt token ids + `SamplingParams`), and
hands back finished `GenerateResult`s with everything ENTR needs per response
token: the behaviour log-prob under the distribution the token was actually
sampled from, the policy (weight) version that produced it, and the entropy of
that distribution. Weights arrive as complete sets of HF-named tensors with a new
version; an engine swaps them in between two decode steps, never mid-step.

    engine.submit([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, n=8), group_id=g)])
    results = engine.poll(timeout=1.0)           # finished samples, any order
    samples = [r.to_sample() for r in results]   # -> entr_megatron.types.Sample
    report = engine.update_weights(hf_state_dict, version=engine.weight_version + 1)

Implementations: `EmbeddedEngine` (HF transformers in its own process; stages
weights while decoding continues) and `SGLangEngine` (HTTP client of SGLang
servers, `rollout/sglang/`; SGLang pauses generation for a weight update).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

import torch

from entr_megatron.types import Sample

if TYPE_CHECKING:
    from entr_megatron.config.rollout import SamplingConfig
    from entr_megatron.rollout.weights import WeightStage

__all__ = [
    "FINISH_REASONS",
    "CancellableUpdates",
    "EngineError",
    "EngineHealth",
    "GenerateRequest",
    "GenerateResult",
    "RolloutEngine",
    "SamplingParams",
    "WeightReceiver",
    "WeightSource",
    "WeightUpdateReport",
    "generate",
]

FINISH_REASONS = ("stop", "length", "abort")
"""stop: a stop token (included in the output) was sampled; length: max_new_tokens or
the engine's context length was reached; abort: `abort()` ended the request early."""


class EngineError(RuntimeError):
    """The engine failed (its process died, or it answered with an error); the message
    carries the engine's own account (traceback or server answer)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's response (the distribution q every log-prob refers to)."""

    temperature: float = 1.0
    """Logits are divided by it. 0 means greedy: the token is the argmax, and its log-prob
    (and the entropy, where the engine reports one) is that of the T = 1 softmax over the whole
    vocabulary, top-p and top-k ignored, as SGLang reports it (see `sampling.py`)."""
    top_p: float = 1.0
    """Nucleus truncation after temperature and top-k: keep the fewest most likely tokens
    whose probability reaches top_p, then renormalise. 1.0 keeps everything."""
    top_k: int = -1
    """Keep the k largest logits (ties with the k-th kept). -1 or 0: no top-k."""
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the response with finish_reason "stop" (the token is kept)."""
    ignore_eos: bool = False
    """Without it the model's EOS token id(s) (generation config) are stop tokens too."""
    n: int = 1
    """Independent samples of the prompt (a GRPO group); each is its own result."""
    seed: int | None = None
    """Per-request seed: sample i draws from a generator seeded by (seed, i), so a request's
    tokens do not depend on what else is in the batch. None: the engine picks one."""
    return_raw_logprobs: bool = False
    """Also return log softmax(logits) at temperature 1 without truncation: for mismatch
    diagnosis and greedy evaluation, never for the ENTR ratio. (SGLang reports
    temperature-scaled log-probs; they are these only at temperature 1.)"""

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 or 0 (off) or a positive int, got {self.top_k!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be a positive int, got {self.n!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_config(cls, sampling: SamplingConfig, **overrides: Any) -> SamplingParams:
        """The request parameters of the run's `rollout.sampling` section (overrides on top, e.g. n=1)."""
        fields = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                      max_new_tokens=sampling.max_new_tokens, n=sampling.n)
        return cls(**{**fields, **overrides})


@dataclass
class GenerateRequest:
    """One prompt to complete `params.n` times."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    group_id: int = 0
    """Copied to every result and Sample (GRPO groups)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Opaque to the engine (must pickle); copied to every result (e.g. the reference answer)."""
    request_id: str | None = None
    """Set by `submit` when None; must be unique among the engine's live requests."""

    def __post_init__(self):
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError("GenerateRequest.prompt_ids is empty: the engine needs at least one prompt token")
        if any(t < 0 for t in self.prompt_ids):
            raise ValueError("GenerateRequest.prompt_ids must be token ids >= 0")


@dataclass
class GenerateResult:
    """One finished sample: per-token data aligned with `output_ids`."""

    request_id: str
    sample_index: int
    """Which of the request's n samples (0 .. n - 1)."""
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob log q(y_t) under the exact distribution y_t was sampled from."""
    versions: list[int]
    """Weight version of the forward pass that produced each token's distribution."""
    finish_reason: str
    entropy: list[float] | None = None
    """H(q) of each token's sampling distribution (None if the engine cannot compute it)."""
    raw_logprobs: list[float] | None = None
    """Only with `SamplingParams.return_raw_logprobs`: untruncated temperature-1 log-probs."""
    group_id: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None
    """MoE models with route recording on: uint8/int16 ``[P + R - 1, moe_layers, k]``, the experts each
    MoE layer sent each fed token to (prompt tokens, then every output token but the last, which is
    never fed: its route affects no log-prob). None for dense models, when off, or when aborted
    before the prompt was prefilled."""
    loss_mask: list[bool] | None = None
    """Multi-turn episodes (`rollout.episodes`): False on observation (tool output) tokens. None: all True."""
    episode: dict[str, Any] | None = None
    """Multi-turn episodes: turns, tool calls and errors per tool, whether it ended (see `rollout.episodes`)."""

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"GenerateResult.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )

    def to_sample(self, reward: float = 0.0) -> Sample:
        """The learner's record of this sample (behaviour log-probs, versions, rollout entropy)."""
        return Sample(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.output_ids),
            behaviour_logprobs=list(self.logprobs),
            versions=list(self.versions),
            reward=reward,
            group_id=self.group_id,
            rollout_entropy=None if self.entropy is None else list(self.entropy),
            finish_reason=self.finish_reason,
            routed_experts=self.routed_experts,
            loss_mask=None if self.loss_mask is None else list(self.loss_mask),
            episode=self.episode,
        )


@dataclass
class WeightUpdateReport:
    """What one weight update cost. Generation stalls only for `swap_s`."""

    version: int
    num_tensors: int
    num_bytes: int
    transfer_s: float
    """From the `update_weights` call until the engine's staging copy was complete."""
    swap_s: float
    """How long decoding was blocked: swapping the staged weights in between two steps
    (plus re-prefilling running requests when the engine recomputes its KV cache)."""
    wait_s: float
    """Staged weights waiting for the decode step in progress to end (not a stall)."""
    total_s: float
    """Wall time of the `update_weights` call."""
    decode_steps_during_transfer: int
    """Decode/prefill steps the engine ran while the weights were in transit."""
    running_at_swap: int
    """Requests in flight when the weights changed (their later tokens carry `version`)."""


@dataclass
class EngineHealth:
    """A snapshot of an engine."""

    alive: bool
    weight_version: int
    paused: bool = False
    num_running: int = 0
    num_waiting: int = 0
    steps: int = 0
    generated_tokens: int = 0
    last_update: WeightUpdateReport | None = None
    cache_frees: int = 0
    """Times an embedded engine on a GPU emptied its CUDA cache on going idle (free_cache_engine)."""
    error: str | None = None
    """Why the engine is not alive (the worker's traceback), if known."""


class WeightReceiver(abc.ABC):
    """A transport that fills an engine's weight staging area (runs inside the engine).

    Pass one to `update_weights` to plug in another transport than the engine's own
    (e.g. a bucketed gloo/NCCL broadcast from the learner): the engine calls
    `receive(stage)` on a background thread while it keeps decoding, then swaps the
    staged weights in atomically. Must pickle (it travels to the engine process).
    """

    @abc.abstractmethod
    def receive(self, stage: WeightStage) -> None:
        """Write every tensor of the new version into `stage` (`write`, `load_bucket` or
        `buffer`); the engine validates completeness afterwards."""

    def cancel(self) -> None:
        """Called from another thread of the engine while `receive` runs: make it raise soon
        (the version will not arrive, e.g. another member of its group died). Default: nothing,
        for receivers that cannot wait on anyone but their sender."""


WeightSource = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]], WeightReceiver]
"""Full set of HF-named tensors ("transformers" in-memory layout: `model.state_dict()`
names; tied `lm_head.weight` optional), or a `WeightReceiver`."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the controller needs from an inference engine."""

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Queue requests (non-blocking); returns their request ids."""
        ...

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        """Finished samples so far; waits up to `timeout` s (None: forever) for at least one."""
        ...

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests; their samples come back with finish_reason "abort" and
        the tokens generated so far."""
        ...

    def pause(self) -> None:
        """Stop decoding (requests and KV cache stay); returns once no step runs."""
        ...

    def resume(self) -> None:
        """Continue decoding after `pause`."""
        ...

    def health(self) -> EngineHealth:
        """Liveness and counters; never raises for a dead engine (alive=False)."""
        ...

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine samples from now."""
        ...

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        """Install a complete new set of weights as `version`; returns once tokens are
        sampled from it. Whether generation continues during the transfer depends on
        the engine: the embedded engine stages and swaps between two decode steps,
        SGLang pauses for the whole update (see the report's `swap_s`)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and free its resources (idempotent)."""
        ...



@runtime_checkable
class CancellableUpdates(Protocol):
    """An engine whose weight update in progress can be told to give up: the embedded engine, local
    or in a Ray actor, whose broadcast receive would otherwise wait out its timeout for a member of
    its group that died (weight_sync/receiver.py `BroadcastReceiver.cancel`)."""

    def cancel_weight_update(self) -> None:
        """The update in progress will not complete: its `update_weights` raises soon and the engine
        keeps the weights it holds. Nothing in progress: no effect. Never raises."""
        ...


@runtime_checkable
class EngineGroup(RolloutEngine, Protocol):
    """The engines a controller drives: a `RolloutEngine` (an `EngineSet` of engines, or a view or
    episode driver over one) that also says which of its requests still run, so that the requests
    lost with a replaced engine are found and generated again."""

    def is_live(self, request_id: str) -> bool:
        """Whether a request submitted here is unfinished and still runs (False once its last
        sample was polled, and for a request lost with a failed or replaced engine)."""
        ...


def generate(
    engine: RolloutEngine, requests: Sequence[GenerateRequest], timeout_s: float = 600.0,
    idle_timeout_s: float | None = None, on_silence: Callable[[], None] | None = None,
) -> list[GenerateResult]:
    """Submit and wait for every sample; results in request order, then sample index.

    `timeout_s` bounds the whole wait. With `idle_timeout_s`, every time no sample has come for
    that long the engine is health-checked: a dead or stopped engine (alive=False) raises
    EngineError with its error; one that answers keeps generating (slow, not hung).
    `on_silence()`, when given, is called instead of that health check (it may raise).

    For an engine with nothing else in flight: results of other requests polled
    meanwhile are dropped.
    """
    ids = engine.submit(requests)
    expected = sum(r.params.n for r in requests)
    done: dict[tuple[str, int], GenerateResult] = {}
    deadline = time.monotonic() + timeout_s
    last_sample = time.monotonic()
    wanted = set(ids)
    while len(done) < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{expected - len(done)} of {expected} samples not finished after {timeout_s:.0f} s")
        results = engine.poll(timeout=min(left, 1.0, idle_timeout_s or 1.0))
        for r in results:
            if r.request_id in wanted:
                done[(r.request_id, r.sample_index)] = r
        if results:
            last_sample = time.monotonic()
        elif idle_timeout_s is not None and time.monotonic() - last_sample > idle_timeout_s:
            if on_silence is not None:
                on_silence()
                last_sample = time.monotonic()
                continue
            health = engine.health()
            if not health.alive:
                raise EngineError(f"no sample for {idle_timeout_s:.0f} s ({len(done)} of {expected} done) and the "
                                  f"engine does not answer: {health.error or 'not alive'}")
            last_sample = time.monotonic()  # alive: slow, not hung
    order = {rid: i for i, rid in enumerate(ids)}
    return sorted(done.values(), key=lambda r: (order[r.request_id], r.sample_index))

"""Multi-turn episodes behind the `RolloutEngine` interface: what `train` drives for tool tasks.

    engine = EpisodeEngine(engine, task.new_environment, EpisodeBudgets(max_turns=6, max_response_tokens=400))
    ids = engine.submit([GenerateRequest(prompt_ids, SamplingParams(n=8, max_new_tokens=160))])
    results = engine.poll(timeout=1.0)    # finished EPISODES: one GenerateResult per sample index

Each of a request's n samples is one episode with its own environment: the inner engine
generates a turn (n=1, the request's sampling, a seed per episode and turn), the environment
reacts to it (`Environment.step`: runs the tool calls, on a pool of `tool_workers` threads so
the controller thread never waits on a tool), the observation is appended and the next turn is
submitted with the whole history as its prompt (SGLang reuses the prefix from its radix cache;
the embedded engine prefills it again). A result holds the whole episode: `output_ids` the
response (policy turns and observations interleaved), `loss_mask` False on observations,
behaviour log-prob 0.0 and entropy 0.0 there, and at an observation the version of the policy
token just before it (an observation never makes an episode look older or newer than its
policy tokens; the lag bound reads the oldest policy token). Episodes keep running while
weights change (partial rollouts): each turn's tokens carry the versions that sampled them.

Budgets (`EpisodeBudgets`; the request's `max_new_tokens` is the call's budget of policy
tokens, over all turns):
- `max_turns` policy turns: a last allowed turn that still calls a tool ends the episode there
  (finish_reason "length", the call not run);
- `max_turn_tokens` per turn (None: only the other limits);
- `max_response_tokens` policy + observation tokens; an observation that does not fit ends the
  episode ("length").
When the call's policy-token budget runs out before the episode ended, the result is a paused
episode (`episode["ended"]` False): `controller.mode: fixed_lag` continues it in its next
segment by submitting a request whose metadata[RESUME] holds the paused Sample (n=1); a turn
cut by the budget continues as the same turn. Every other mode trains it as it is, like a
single-turn response cut at max_new_tokens.

`Sample.episode` / `GenerateResult.episode`: {"turns", "tool_calls" {tool: n}, "tool_errors"
{tool: n}, "env_reward" (sum of the steps' rewards), "ended", "turn_tokens" (tokens of the
open turn, when paused mid-turn)}.

MoE routes: each position's route comes from the turn that first fed it (a turn's prefill
recomputes the history; only the rows from where the previous turn stopped are kept), so the
rows of a turn's own tokens are those of the forward that sampled them.

Abort, loss and `is_live`: an aborted episode comes back with finish_reason "abort" and what it
had. A request is live while every unfinished episode of it is (a turn on the inner engine or a
tool call running); one with an episode lost with a replaced inner engine is dropped as a whole
(its other episodes aborted, their results never returned): the caller submits it again.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from entr_megatron.rollout.engine import (
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    EngineGroup,
    RolloutEngine,
    WeightSource,
    WeightUpdateReport,
)
from entr_megatron.tasks.environment import OBSERVATION_LOGPROB, Environment, Step
from entr_megatron.types import Sample
from entr_megatron.utils.seeding import mix_seed

__all__ = ["ENVIRONMENT", "RESUME", "EpisodeBudgets", "EpisodeEngine", "episode_metrics"]

RESUME = "resume_episode"
"""GenerateRequest.metadata key: the paused `Sample` an n=1 request continues (fixed_lag)."""
ENVIRONMENT = "environment"
"""GenerateRequest.metadata key: the environment object of an n=1 request (else one is made)."""
TURN_SEED_STRIDE = 1_009
"""Turn seeds: mix_seed(request seed, sample index * stride + turn of this call)."""
TOOL_POLL_S = 0.02
"""Longest wait on the inner engine while tool calls run (their results are picked up between)."""


@dataclass(frozen=True)
class EpisodeBudgets:
    max_turns: int = 4
    max_turn_tokens: int | None = None
    max_response_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_response_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EpisodeBudgets.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.max_turn_tokens is not None and (not isinstance(self.max_turn_tokens, int) or self.max_turn_tokens < 1):
            raise ValueError(f"EpisodeBudgets.max_turn_tokens must be None or an int >= 1, got {self.max_turn_tokens!r}")


@dataclass
class _Episode:
    outer: str
    index: int
    request: GenerateRequest
    env: Environment
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropy: list[float] | None = field(default_factory=list)
    raw: list[float] | None = None
    mask: list[bool] = field(default_factory=list)
    routes: list[torch.Tensor] | None = field(default_factory=list)
    route_rows: int = 0
    turns: int = 0
    turn_tokens: int = 0
    """Tokens of the turn in progress (a turn cut by the call budget continues after a resume)."""
    call_tokens: int = 0
    """Policy tokens generated by this call (against request.params.max_new_tokens)."""
    call_turns: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_errors: dict[str, int] = field(default_factory=dict)
    env_reward: float = 0.0
    inner: str | None = None
    tool: Future | None = None
    turn_finish: str = "stop"
    """finish_reason of the last turn (the episode's when the environment ends it)."""
    env_error: str | None = None
    aborted: bool = False


def _resume(ep: _Episode, sample: Sample) -> None:
    ep.response, ep.logprobs, ep.versions = list(sample.response_ids), list(sample.behaviour_logprobs), list(sample.versions)
    ep.entropy = None if sample.rollout_entropy is None else list(sample.rollout_entropy)
    ep.mask = list(sample.loss_mask) if sample.loss_mask is not None else [True] * len(sample.response_ids)
    ep.routes = None if sample.routed_experts is None else [sample.routed_experts]
    ep.route_rows = 0 if sample.routed_experts is None else sample.routed_experts.shape[0]
    info = sample.episode or {}
    ep.turns, ep.turn_tokens = int(info.get("turns", 0)), int(info.get("turn_tokens", 0))
    ep.tool_calls, ep.tool_errors = dict(info.get("tool_calls", {})), dict(info.get("tool_errors", {}))
    ep.env_reward = float(info.get("env_reward", 0.0))


class EpisodeEngine:
    """A `RolloutEngine` whose samples are multi-turn episodes (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, new_environment: Callable[[], Environment],
                 budgets: EpisodeBudgets = EpisodeBudgets(), tool_workers: int = 4) -> None:
        if tool_workers < 1:
            raise ValueError(f"tool_workers must be >= 1, got {tool_workers!r}")
        self.engine, self.new_environment, self.budgets = engine, new_environment, budgets
        self._inner_live: Callable[[str], bool] | None = engine.is_live if isinstance(engine, EngineGroup) else None
        """The inner engine's own `is_live` where it tracks its requests (an `EngineSet`: a request
        lost with a replaced engine); a single engine's requests run until their samples come."""
        self._pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="entr-tool")
        self._episodes: dict[str, list[_Episode | None]] = {}  # outer id -> episodes (None: returned)
        self._by_inner: dict[str, _Episode] = {}
        self._tooling: list[_Episode] = []
        self._ignored: set[str] = set()  # inner ids whose results are thrown away
        self._finished: list[GenerateResult] = []

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        ids, ready = [], []
        for r in requests:
            outer = r.request_id or uuid.uuid4().hex
            if outer in self._episodes or outer in ids:
                raise ValueError(f"request id {outer!r} is already in flight")
            r.request_id = outer
            resume, env = r.metadata.get(RESUME), r.metadata.get(ENVIRONMENT)
            if (resume is not None or env is not None) and r.params.n != 1:
                raise ValueError(f"a request with metadata[{RESUME!r}] or [{ENVIRONMENT!r}] must have n=1, got {r.params.n}")
            episodes = []
            for i in range(r.params.n):
                ep = _Episode(outer, i, r, env or self.new_environment(), list(r.prompt_ids))
                ep.prompt = list(ep.env.reset(list(r.prompt_ids), r.metadata.get("reference")))
                if resume is not None:
                    ep.prompt = list(resume.prompt_ids)
                    _resume(ep, resume)
                episodes.append(ep)
            self._episodes[outer] = episodes
            ids.append(outer)
            for ep in episodes:
                if not self._end_if_over_budget(ep):
                    ready.append(ep)
        self._submit_turns(ready)
        return ids

    def _turn_request(self, ep: _Episode) -> GenerateRequest:
        p, b = ep.request.params, self.budgets
        room = min(p.max_new_tokens - ep.call_tokens, b.max_response_tokens - len(ep.response))
        if b.max_turn_tokens is not None:
            room = min(room, b.max_turn_tokens - ep.turn_tokens)
        seed = None if p.seed is None else mix_seed(p.seed, ep.index * TURN_SEED_STRIDE + ep.call_turns)
        stops = tuple(dict.fromkeys(p.stop_token_ids + tuple(ep.env.stop_token_ids)))
        params = dataclasses.replace(p, n=1, max_new_tokens=room, stop_token_ids=stops, seed=seed)
        return GenerateRequest(ep.prompt + ep.response, params, group_id=ep.request.group_id,
                               request_id=f"{ep.outer}.{ep.index}.{len(ep.response)}")

    def _submit_turns(self, episodes: list[_Episode]) -> None:
        if not episodes:
            return
        requests = [self._turn_request(ep) for ep in episodes]
        for ep, request in zip(episodes, requests):
            ep.inner = request.request_id
            self._by_inner[request.request_id] = ep
        inner_ids = self.engine.submit(requests)
        for ep, rid, request in zip(episodes, inner_ids, requests):
            if rid != request.request_id:  # an engine that numbers requests itself
                del self._by_inner[request.request_id]
                ep.inner, self._by_inner[rid] = rid, ep

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        ready = self._tools_done()
        wait = 0.0 if ready or self._finished else timeout
        if self._tooling and (wait is None or wait > TOOL_POLL_S):
            wait = TOOL_POLL_S
        results = self.engine.poll(timeout=wait) if self._by_inner or not self._tooling else []
        for r in results:
            if r.request_id in self._ignored:
                self._ignored.discard(r.request_id)
                continue
            ep = self._by_inner.pop(r.request_id, None)
            if ep is None:
                continue
            ep.inner = None
            self._append_turn(ep, r)
            if ep.aborted or r.finish_reason == "abort":
                self._finish(ep, "abort")
            elif self._paused_mid_turn(ep, r):
                self._finish(ep, "length", ended=False)
            else:
                self._start_step(ep, r)
        self._submit_turns(ready + self._tools_done())
        out, self._finished = self._finished, []
        return out

    def _paused_mid_turn(self, ep: _Episode, r: GenerateResult) -> bool:
        """The call's token budget ended the turn, which could go on (no stop token, no other limit)."""
        b = self.budgets
        return (r.finish_reason == "length" and ep.call_tokens >= ep.request.params.max_new_tokens
                and not self._stopped(ep, r) and len(ep.response) < b.max_response_tokens
                and (b.max_turn_tokens is None or ep.turn_tokens < b.max_turn_tokens))

    def _stopped(self, ep: _Episode, r: GenerateResult) -> bool:
        return bool(r.output_ids) and r.output_ids[-1] in ep.env.stop_token_ids

    def _append_turn(self, ep: _Episode, r: GenerateResult) -> None:
        ep.response += r.output_ids
        ep.logprobs += r.logprobs
        ep.versions += r.versions
        ep.mask += [True] * len(r.output_ids)
        ep.call_tokens += len(r.output_ids)
        ep.turn_tokens += len(r.output_ids)
        if ep.entropy is not None:
            ep.entropy = None if r.entropy is None else ep.entropy + list(r.entropy)
        if r.raw_logprobs is not None:
            ep.raw = ([0.0] * (len(ep.response) - len(r.output_ids)) if ep.raw is None else ep.raw) + list(r.raw_logprobs)
        if ep.routes is not None:
            if r.routed_experts is None:
                ep.routes = None
            else:
                ep.routes.append(r.routed_experts[ep.route_rows:])
                ep.route_rows = r.routed_experts.shape[0]

    def _start_step(self, ep: _Episode, r: GenerateResult) -> None:
        """The turn ended: count it, and let the environment react on the tool pool."""
        ep.turns += 1
        ep.call_turns += 1
        ep.turn_tokens = 0
        if self._stopped(ep, r) and ep.turns >= self.budgets.max_turns:
            return self._finish(ep, "length")  # a tool call on the last allowed turn: not run
        ep.turn_finish = r.finish_reason
        ep.tool = self._pool.submit(ep.env.step, list(r.output_ids))
        self._tooling.append(ep)

    def _tools_done(self) -> list[_Episode]:
        """Episodes whose environment step finished: observation appended, next turn ready."""
        ready, still = [], []
        for ep in self._tooling:
            if not ep.tool.done():
                still.append(ep)
                continue
            future, ep.tool = ep.tool, None
            try:
                step: Step = future.result()
            except Exception as e:  # an environment bug must not end the run: the episode ends
                step = Step([], True, 0.0, ())
                ep.tool_errors["environment"] = ep.tool_errors.get("environment", 0) + 1
                ep.env_error = f"{type(e).__name__}: {e}"
            self._count_tools(ep, step)
            ep.env_reward += float(step.reward)
            if ep.aborted:
                self._finish(ep, "abort")
            elif step.done:
                self._finish(ep, ep.turn_finish)
            elif len(ep.response) + len(step.observation_ids) >= self.budgets.max_response_tokens:
                self._finish(ep, "length")  # no room for the observation and a turn after it
            else:
                self._append_observation(ep, list(step.observation_ids))
                if not self._end_if_over_budget(ep):
                    ready.append(ep)
        self._tooling = still
        return ready

    @staticmethod
    def _count_tools(ep: _Episode, step: Step) -> None:
        for outcome in step.tool_outcomes:
            ep.tool_calls[outcome.name] = ep.tool_calls.get(outcome.name, 0) + 1
            if outcome.error is not None:
                ep.tool_errors[outcome.name] = ep.tool_errors.get(outcome.name, 0) + 1

    def _append_observation(self, ep: _Episode, obs: list[int]) -> None:
        version = ep.versions[-1] if ep.versions else 0
        ep.response += obs
        ep.logprobs += [OBSERVATION_LOGPROB] * len(obs)
        ep.versions += [version] * len(obs)
        ep.mask += [False] * len(obs)
        if ep.entropy is not None:
            ep.entropy += [0.0] * len(obs)
        if ep.raw is not None:
            ep.raw += [0.0] * len(obs)

    def _end_if_over_budget(self, ep: _Episode) -> bool:
        """Ends (or pauses) an episode that has no token left to generate; True if it did."""
        if ep.turns >= self.budgets.max_turns or len(ep.response) >= self.budgets.max_response_tokens:
            self._finish(ep, "length")
        elif ep.call_tokens >= ep.request.params.max_new_tokens:
            self._finish(ep, "length", ended=False)
        else:
            return False
        return True

    def _finish(self, ep: _Episode, reason: str, ended: bool = True) -> None:
        routes = None
        if ep.routes:
            routes = torch.cat(ep.routes)
        info = {"turns": ep.turns, "tool_calls": dict(ep.tool_calls), "tool_errors": dict(ep.tool_errors),
                "env_reward": ep.env_reward, "ended": ended, "turn_tokens": 0 if ended else ep.turn_tokens}
        if ep.env_error is not None:
            info["env_error"] = ep.env_error
        self._finished.append(GenerateResult(
            request_id=ep.outer, sample_index=ep.index, prompt_ids=list(ep.prompt), output_ids=ep.response,
            logprobs=ep.logprobs, versions=ep.versions, finish_reason=reason, entropy=ep.entropy,
            raw_logprobs=ep.raw, group_id=ep.request.group_id,
            metadata={k: v for k, v in ep.request.metadata.items() if k not in (RESUME, ENVIRONMENT)},
            routed_experts=routes, loss_mask=ep.mask, episode=info))
        episodes = self._episodes[ep.outer]
        episodes[ep.index] = None
        if all(e is None for e in episodes):
            del self._episodes[ep.outer]

    # ---- abort, liveness -----------------------------------------------------------------------
    def abort(self, request_ids: Iterable[str]) -> None:
        inner = []
        for outer in request_ids:
            for ep in self._episodes.get(outer, []):
                if ep is None:
                    continue
                ep.aborted = True
                if ep.inner is not None:
                    inner.append(ep.inner)
        if inner:
            self.engine.abort(inner)

    def is_live(self, request_id: str) -> bool:
        """Whether every unfinished episode of the request still runs; a request with a lost
        episode is dropped as a whole (see the module docstring)."""
        episodes = self._episodes.get(request_id)
        if episodes is None:
            return False
        inner_live = self._inner_live
        if inner_live is None or all(ep is None or ep.inner is None or inner_live(ep.inner) for ep in episodes):
            return True
        self._drop(request_id)
        return False

    def _drop(self, outer: str) -> None:
        live = []
        for ep in self._episodes.pop(outer, []):
            if ep is None:
                continue
            if ep.inner is not None:
                self._by_inner.pop(ep.inner, None)
                self._ignored.add(ep.inner)
                live.append(ep.inner)
            if ep in self._tooling:
                self._tooling.remove(ep)
        if self._inner_live is not None:
            live = [rid for rid in live if self._inner_live(rid)]
            self._ignored = {rid for rid in self._ignored if self._inner_live(rid)}
        if live:
            self.engine.abort(live)

    # ---- the rest is the inner engine's --------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def health(self) -> EngineHealth:
        return self.engine.health()

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        return self.engine.update_weights(weights, version)

    def close(self) -> None:
        """Stops the tool pool; the inner engine stays up (`shutdown` stops both)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        self.close()
        self.engine.shutdown()


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-step agent metrics of the samples that are episodes (empty when none is): turns per
    episode, tool calls and errors per tool (per episode), the observation share of response
    tokens, the policy versions an episode's generated tokens span (distinct versions), and the share
    of episodes the policy-token budget (rollout.sampling.max_new_tokens) cut before they ended."""
    episodes = [s for s in samples if s.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    out = {"agent/turns_mean": sum(s.episode["turns"] for s in episodes) / n}
    tools = sorted({t for s in episodes for t in (*s.episode["tool_calls"], *s.episode["tool_errors"])})
    for tool in tools:
        out[f"agent/tool_calls/{tool}"] = sum(s.episode["tool_calls"].get(tool, 0) for s in episodes) / n
        out[f"agent/tool_errors/{tool}"] = sum(s.episode["tool_errors"].get(tool, 0) for s in episodes) / n
    tokens = sum(len(s.response_ids) for s in episodes)
    observed = sum(len(s.response_ids) - sum(s.loss_mask) for s in episodes if s.loss_mask is not None)
    out["agent/observation_token_frac"] = observed / tokens if tokens else 0.0
    spans = [len({v for v, m in zip(s.versions, s.loss_mask or [True] * len(s.versions)) if m}) for s in episodes]
    out["agent/versions_spanned_mean"] = sum(spans) / n
    out["agent/versions_spanned_max"] = float(max(spans))
    out["agent/budget_cut_frac"] = sum(not s.episode["ended"] for s in episodes) / n
    return out

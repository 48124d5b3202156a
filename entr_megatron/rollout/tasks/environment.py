"""Multi-turn environments and the agent loop that drives a `RolloutEngine` through them.

    episodes = [Episode(task.new_environment(), prompt_ids, ref, group_id=g) for ...]
    samples = run_episodes(engine, episodes, SamplingParams(temperature=1.0, max_new_tokens=32), max_turns=4)

One episode: `env.reset` gives the initial observation (the prompt ids), then per
turn the engine generates until EOS, one of `env.stop_token_ids` (e.g. the id of
"</calc>") or the token budget; `env.step(turn ids)` runs the tool and returns
the observation to append (e.g. "<result>84</result>"), whether the episode is
done and a reward. The episode becomes ONE `Sample`: prompt = initial
observation, response = policy turns and observations interleaved.

Per response token of the Sample:
- policy tokens: loss_mask True, the engine's behaviour log-prob, weight version
  and entropy, exactly as generated;
- observation (tool output) tokens: loss_mask False, behaviour log-prob 0.0,
  entropy 0.0, and the version of the policy token just before them (the turn
  that made the call), so an observation never makes a sample look older or
  newer than the policy tokens around it. The learner ignores these positions
  (mask False); they only keep arrays aligned.

Every turn is its own request whose prompt is the whole history (the engine
re-prefills it; KV reuse across turns is the engine's business). Episodes run
concurrently: the loop submits every ready turn and polls for whichever finishes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from entr_megatron.rollout.engine import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from entr_megatron.types import Sample
from entr_megatron.utils.seeding import mix_seed

__all__ = ["OBSERVATION_LOGPROB", "Environment", "Episode", "Step", "run_episodes"]

OBSERVATION_LOGPROB = 0.0
"""Behaviour log-prob stored at tool-output positions (masked out; log 1 = "not sampled")."""


class Step(NamedTuple):
    """What an environment answers to one policy turn."""

    observation_ids: list[int]
    """Tokens to append after the turn (tool output); empty when done."""
    done: bool
    reward: float
    """Added to the episode's reward (usually all of it comes at the last step)."""


@runtime_checkable
class Environment(Protocol):
    """One multi-turn episode's world (a fresh object per episode)."""

    stop_token_ids: tuple[int, ...]
    """Token ids that end a policy turn besides EOS (e.g. the tool-call end marker)."""

    def reset(self, prompt_ids: list[int], reference: Any) -> list[int]:
        """Start the episode; returns the initial observation ids (normally `prompt_ids`)."""
        ...

    def step(self, generated_ids: list[int]) -> Step:
        """React to one policy turn (its generated ids, stop token included)."""
        ...


@dataclass
class Episode:
    env: Environment
    prompt_ids: list[int]
    reference: Any = None
    group_id: int = 0


@dataclass
class _State:
    prompt: list[int]
    group_id: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropy: list[float] | None = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish_reason: str = "length"


def _turn_params(params: SamplingParams, stop_ids: tuple[int, ...], budget: int, seed: int | None) -> SamplingParams:
    return dataclasses.replace(
        params, n=1, max_new_tokens=min(params.max_new_tokens, budget),
        stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + tuple(stop_ids))), seed=seed,
    )


def _append_turn(s: _State, r: GenerateResult) -> None:
    s.response += r.output_ids
    s.logprobs += r.logprobs
    s.versions += r.versions
    s.mask += [True] * len(r.output_ids)
    if s.entropy is not None:
        s.entropy = None if r.entropy is None else s.entropy + list(r.entropy)
    s.turns += 1
    s.finish_reason = r.finish_reason


def _append_observation(s: _State, obs: list[int]) -> None:
    version = s.versions[-1] if s.versions else 0
    s.response += obs
    s.logprobs += [OBSERVATION_LOGPROB] * len(obs)
    s.versions += [version] * len(obs)
    s.mask += [False] * len(obs)
    if s.entropy is not None:
        s.entropy += [0.0] * len(obs)


def run_episodes(
    engine: RolloutEngine,
    episodes: Sequence[Episode],
    params: SamplingParams,
    *,
    max_turns: int = 4,
    max_response_tokens: int = 256,
    timeout_s: float = 600.0,
) -> list[Sample]:
    """Runs every episode to the end; one `Sample` per episode, in order (see module docstring).

    params: sampling of every turn (`n` must be 1: one episode per group member;
    `max_new_tokens` caps each turn). max_turns: policy turns per episode; when the last
    allowed turn still calls a tool, the episode ends there (finish_reason "length", the
    call not executed). max_response_tokens: policy + observation tokens per episode.
    Sample.reward is the sum of the step rewards; finish_reason is the last turn's
    ("abort" when the engine aborted it).
    """
    if params.n != 1:
        raise ValueError(f"run_episodes needs SamplingParams.n == 1 (one Episode per group member), got {params.n}")
    if max_turns < 1 or max_response_tokens < 1:
        raise ValueError(f"max_turns and max_response_tokens must be >= 1, got {max_turns}, {max_response_tokens}")
    states = [
        _State(prompt=list(ep.env.reset(list(ep.prompt_ids), ep.reference)), group_id=ep.group_id)
        for ep in episodes
    ]
    pending: dict[str, int] = {}

    def submit(i: int) -> None:
        s = states[i]
        seed = None if params.seed is None else mix_seed(params.seed, i * 1_009 + s.turns)
        p = _turn_params(params, episodes[i].env.stop_token_ids, max_response_tokens - len(s.response), seed)
        (rid,) = engine.submit([GenerateRequest(s.prompt + s.response, p, group_id=s.group_id)])
        pending[rid] = i

    for i in range(len(states)):
        submit(i)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(pending)} of {len(states)} episodes unfinished after {timeout_s:.0f} s")
        for r in engine.poll(timeout=min(left, 1.0)):
            i = pending.pop(r.request_id, None)
            if i is None:
                continue
            s = states[i]
            _append_turn(s, r)
            if r.finish_reason == "abort":
                continue
            step = episodes[i].env.step(list(r.output_ids))
            s.reward += float(step.reward)
            room = max_response_tokens - len(s.response) - len(step.observation_ids)
            if step.done or s.turns >= max_turns or room <= 0:
                if not step.done:
                    s.finish_reason = "length"
                continue
            _append_observation(s, list(step.observation_ids))
            submit(i)
    return [
        Sample(
            prompt_ids=s.prompt, response_ids=s.response, behaviour_logprobs=s.logprobs, versions=s.versions,
            reward=s.reward, group_id=s.group_id, rollout_entropy=s.entropy, loss_mask=s.mask,
            finish_reason=s.finish_reason,
        )
        for s in states
    ]

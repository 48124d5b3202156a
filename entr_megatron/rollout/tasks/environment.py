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
concurrently. `run_episodes` is a batch call over `rollout.episodes.EpisodeEngine`, the
engine wrapper `train` drives episodes through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from entr_megatron.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams, generate
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
    tool_outcomes: tuple = ()
    """The tool calls this step ran (`rollout.tools.ToolOutcome`: name, text, error, seconds), for
    the per-tool call and error metrics; empty when the turn called no tool."""


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
    from entr_megatron.rollout.episodes import ENVIRONMENT, EpisodeBudgets, EpisodeEngine

    if params.n != 1:
        raise ValueError(f"run_episodes needs SamplingParams.n == 1 (one Episode per group member), got {params.n}")
    budgets = EpisodeBudgets(max_turns=max_turns, max_turn_tokens=params.max_new_tokens,
                             max_response_tokens=max_response_tokens)
    driver = EpisodeEngine(engine, _no_environment, budgets, tool_workers=1)
    requests = [
        GenerateRequest(ep.prompt_ids, dataclasses.replace(
            params, max_new_tokens=max_response_tokens, seed=None if params.seed is None else mix_seed(params.seed, i)),
            group_id=ep.group_id, metadata={ENVIRONMENT: ep.env, "reference": ep.reference})
        for i, ep in enumerate(episodes)
    ]
    try:
        results = generate(driver, requests, timeout_s=timeout_s)
    finally:
        driver.close()
    return [r.to_sample(reward=r.episode["env_reward"]) for r in results]


def _no_environment() -> Environment:
    raise ValueError("run_episodes gives every request its own environment")

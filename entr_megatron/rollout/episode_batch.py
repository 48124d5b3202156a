"""A batch of multi-turn episodes through an engine, each with its own environment, to the end.

    episodes = [Episode(task.new_environment(), prompt_ids, ref, group_id=g) for ...]
    samples = run_episodes(engine, episodes, SamplingParams(temperature=1.0, max_new_tokens=32), max_turns=4)

A batch call over `episodes.EpisodeEngine` (what `train` drives for tool tasks, one environment
factory per task); here every episode brings its own environment. One episode becomes ONE `Sample`
(tasks/environment.py: what its positions hold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from entr_megatron.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams, generate
from entr_megatron.rollout.episodes import ENVIRONMENT, EpisodeBudgets, EpisodeEngine
from entr_megatron.tasks.environment import Environment
from entr_megatron.types import Sample
from entr_megatron.utils.seeding import mix_seed

__all__ = ["Episode", "run_episodes"]


@dataclass
class Episode:
    """One episode to run: its own environment, the prompt, the reward's reference, its GRPO group."""

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

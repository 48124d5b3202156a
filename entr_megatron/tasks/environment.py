"""Multi-turn environments: what a tool task's world answers to each policy turn.

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
re-prefills it; KV reuse across turns is the engine's business). `rollout.episodes.EpisodeEngine`
drives episodes (what `train` runs); `rollout.episode_batch.run_episodes` is a batch call over it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["OBSERVATION_LOGPROB", "Environment", "Step"]

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
    """The tool calls this step ran (`tasks.tools.ToolOutcome`: name, text, error, seconds), for
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

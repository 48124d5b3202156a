"""Per-episode worlds of the search task (`task.search.world: per_episode`): each question has its own.

    entities = world_entities(tag=4821, num_entities=8, seed=0)     # world w4821: 8 entities and their links
    "w4821 q: home of founder of velora?"                           # a question of that world
    tag_of("w4821 q: home of founder of velora?")                   # 4821
    env = WorldEnv(tokenizer, runner_of)                            # reset(prompt) takes w4821's tools

Why: on one fixed corpus a tiny model memorises the facts behind its training questions instead
of learning to read the documents (docs/DEMOS.md, "The CPU agent demo": 97% of training questions, 6% of
held-out ones). Here each question is asked of a world drawn from its tag alone (one of
`WORLD_TAGS`): the entities, their kinds and every link, so no fact carries over from one question
to the next. The only way to answer is the procedure: search the name in the question, read the
field it names, search the entity read, read the next field, answer.

Names: fresh syllable names in every world, or (`pool`) a fixed vocabulary of invented names that
every world draws its entities from. With a pool a name becomes a familiar word that a tiny
character-level model completes after its first letters, so it learns to read far sooner (copying
six letters through attention is slow to learn); the links, and so every answer, stay per world.

The prompt carries the tag ("w4821 q: ..."): the environment needs nothing but the prompt (the
controller hands it no reference), an episode resumed after a pause finds the same world, and the
splits, drawn by tag (`base.split_of`), never share a world.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from entr_megatron.tasks.environment import Step
from entr_megatron.tasks.search_corpus import Entity, draw_entities, draw_names
from entr_megatron.tasks.tool_env import ToolEnv
from entr_megatron.tasks.tools.calls import ToolRunner

__all__ = ["WORLD_TAGS", "WorldEnv", "pool_names", "tag_of", "world_prefix", "world_entities"]

WORLD_TAGS = 100_000
"""Worlds per corpus_seed, tagged w0 .. w99999 (a 2-hop world of 8 entities holds ~13 questions)."""
_TAG = re.compile(r"w(\d+) q: ")


def world_prefix(tag: int) -> str:
    """What a question of world `tag` starts with: "w4821 "."""
    return f"w{tag} "


def tag_of(text: str) -> int:
    """The world tag of a question ("w4821 q: ..." -> 4821); ValueError for any other text."""
    m = _TAG.match(text)
    if m is None or int(m.group(1)) >= WORLD_TAGS:
        raise ValueError(f"not a question of a per-episode world (w0 .. w{WORLD_TAGS - 1}, then 'q: '): {text!r}")
    return int(m.group(1))


def pool_names(size: int, seed: int) -> list[str]:
    """The vocabulary of `size` invented names the worlds of `seed` draw from (`draw_names`)."""
    return draw_names(size, random.Random(f"search-names:{seed}"))


def world_entities(tag: int, num_entities: int, seed: int, pool: list[str] | None = None) -> dict[str, Entity]:
    """The entities of world `tag` (`draw_entities`: kinds in equal shares, links uniform over the
    target kind), named from `pool` or freshly. A pure function of the arguments."""
    return draw_entities(num_entities, random.Random(f"search-world:{seed}:{tag}"), pool)


class WorldEnv:
    """One episode in its question's world (implements `environment.Environment`): `reset` reads the
    question from the prompt and takes that world's tools (`runner_of(question text)`); each turn is
    then a `ToolEnv`'s. A fresh one per episode (`SearchTask.new_environment`)."""

    def __init__(self, tokenizer: Any, runner_of: Callable[[str], ToolRunner]):
        self._env = ToolEnv(tokenizer, ToolRunner(()))  # no tools until reset names the world
        self._runner_of = runner_of
        self._reset = False
        self.stop_token_ids = self._env.stop_token_ids

    def reset(self, prompt_ids: list[int], reference: Any) -> list[int]:
        """The prompt is the initial observation; its question picks the world."""
        self._env.runner = self._runner_of(self._env.tokenizer.decode(prompt_ids, skip_special_tokens=True))
        self._reset = True
        return list(prompt_ids)

    def step(self, generated_ids: list[int]) -> Step:
        """A `ToolEnv` step with the tools of this episode's world."""
        assert self._reset, "WorldEnv.step before reset: the world is the prompt's"
        return self._env.step(generated_ids)

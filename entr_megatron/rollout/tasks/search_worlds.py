"""Per-episode worlds of the search task (`task.search.world: per_episode`): each question has its own.

    start, relations = draw_question(rng, hops=2)             # ("kesa", ("founder", "home"))
    text = question_text(start, relations)                   # "q: home of founder of kesa?"
    entities = world_entities(text, num_entities=8, seed=0)  # the world of that question (pure)
    chain = follow(entities, start, relations)              # ["kesa", "voru", "dalin"]: the answer is dalin
    env = WorldEnv(tokenizer, runner_of)                     # reset(prompt) takes the question's world tools

Why: on one fixed corpus a tiny model memorises the facts behind its training questions instead
of learning to read the documents (README, "The CPU agent demo": 97% of training questions, 6% of
held-out ones). Here a question's start entity is a fresh name and the world around it (the other
names, their kinds, every link) is drawn from the question text, so no fact carries over from one
question to the next: the only way to answer is the procedure, search the name in the question,
read the field it names, search the entity read, read the next field, answer.

A world is a pure function of (seed, question text): the environment needs nothing but the prompt
(the controller hands it no reference), an episode resumed after a pause finds the same world, and
splits disjoint by question text (`base.split_of`) never share a world.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from entr_megatron.rollout.tasks.environment import Step
from entr_megatron.rollout.tasks.search_corpus import (
    RELATION_BY_NAME, RELATIONS, Entity, draw_entities, draw_name,
)
from entr_megatron.rollout.tasks.tool_env import ToolEnv
from entr_megatron.rollout.tools.calls import ToolRunner

__all__ = ["WorldEnv", "draw_question", "follow", "parse_question", "question_text", "world_entities"]

_QUESTION = re.compile(r"q: ((?:[a-z]+ of )+)([a-z]+)\?")


def question_text(start: str, relations: tuple[str, ...]) -> str:
    """ "q: home of founder of velora?" for relations ("founder", "home") from "velora"."""
    return "q: " + " of ".join(reversed(relations)) + f" of {start}?"


def parse_question(text: str) -> tuple[str, tuple[str, ...]]:
    """(start, relations in the order followed) of a question `question_text` wrote; ValueError for any
    other text, an unknown relation, or relations that do not chain (a founder has no country)."""
    m = _QUESTION.fullmatch(text)
    if m is None:
        raise ValueError(f"not a search question: {text!r}")
    relations = tuple(m.group(1).split(" of ")[-2::-1])
    for name in relations:
        if name not in RELATION_BY_NAME:
            raise ValueError(f"unknown relation {name!r} in {text!r}")
    for a, b in zip(relations, relations[1:]):
        if RELATION_BY_NAME[a].target != RELATION_BY_NAME[b].source:
            raise ValueError(f"{b!r} of a {RELATION_BY_NAME[a].target} does not exist: {text!r}")
    return m.group(2), relations


def draw_question(rng: random.Random, hops: int) -> tuple[str, tuple[str, ...]]:
    """A fresh start name and `hops` chained relations, the first uniform over RELATIONS, each next
    uniform over those leaving the previous one's target kind."""
    relations = [rng.choice(RELATIONS)]
    while len(relations) < hops:
        relations.append(rng.choice([r for r in RELATIONS if r.source == relations[-1].target]))
    return draw_name(rng), tuple(r.name for r in relations)


def follow(entities: dict[str, Entity], start: str, relations: tuple[str, ...]) -> list[str]:
    """The entities from `start` along `relations` (len(relations) + 1 names; the last is the answer)."""
    chain = [start]
    for r in relations:
        chain.append(entities[chain[-1]].links[r])
    return chain


def world_entities(text: str, num_entities: int, seed: int) -> dict[str, Entity]:
    """The world of question `text`: `num_entities` entities (`draw_entities`, at least two of each
    kind) holding its start entity, with links drawn until the question's chain visits no entity
    twice (so the answer is never the start). A pure function of the arguments."""
    start, relations = parse_question(text)
    rng = random.Random(f"search-world:{seed}:{text}")
    while True:  # a redraw happens with probability <= 1/2 per hop that can return (two per kind)
        entities = draw_entities(num_entities, rng, anchor=(start, RELATION_BY_NAME[relations[0]].source))
        chain = follow(entities, start, relations)
        if len(set(chain)) == len(chain):
            return entities


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

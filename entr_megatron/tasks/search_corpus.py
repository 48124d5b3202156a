"""The invented world of the search task: entities, one short document each, a BM25 index, two tools.

    corpus = Corpus(num_entities=48, seed=0)
    corpus.entities["velora"]            # Entity(name="velora", kind="company", doc_id="d0",
                                         #        links={"founder": "marek", "base": "dunmore"})
    corpus.search("velora", k=1)         # [Document("d0", "velora", "velora: founder marek, base dunmore.")]
    Corpus.of_entities(draw_entities(8, rng))   # a small world (the search task's per-episode worlds)
    SearchTool(corpus, top_k=1)(query="velora")   # "d0 velora: founder marek, base dunmore."
    OpenTool(corpus)(doc_id="d0")                 # "velora: founder marek, base dunmore."

Entities are companies, people, cities and countries with invented names (syllables,
lowercase, at most 6 characters, unique, never a word of the documents), linked by the
relations of `RELATIONS` (a company's founder is a person, a person lives in a city, ...).
Everything is drawn from `seed` alone (`draw_entities`, which also draws the search task's
per-episode worlds: `search_worlds.py`). Documents stay under ~55 characters: the task's
sequences are tokenized by character for a tiny model.

Retrieval is BM25 (`bm25s`, no stemming, no stopwords). A document is indexed with its
title in front of its text, so the name counts twice there and once in any document that
merely mentions it: a query that is just a name ranks that entity's own document first.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "RELATIONS", "Corpus", "Document", "Entity", "OpenTool", "Relation", "SearchTool", "draw_entities",
           "draw_names"]

KINDS = ("company", "person", "city", "country")


@dataclass(frozen=True)
class Relation:
    """A link from an entity of kind `source` to one of kind `target`."""

    name: str
    """How a question names it: "home of marek"."""
    source: str
    target: str


RELATIONS = (
    Relation("founder", "company", "person"),
    Relation("base", "company", "city"),
    Relation("home", "person", "city"),
    Relation("employer", "person", "company"),
    Relation("country", "city", "country"),
    Relation("leader", "country", "person"),
)
RELATION_BY_NAME = {r.name: r for r in RELATIONS}

DOCUMENT_TEMPLATES = {
    "company": "{name}: founder {founder}, base {base}.",
    "person": "{name}: home {home}, employer {employer}.",
    "city": "{name}: country {country}.",
    "country": "{name}: leader {leader}.",
}
"""The facts of each kind: every outgoing relation, under the name questions use for it (terse on
purpose: each character is a token of the policy's context)."""

_ONSETS, _VOWELS, _CODAS = "bdfgklmnprstvz", "aeiou", "lnrs"
_TEMPLATE_WORDS = frozenset(
    w.strip("{}:,.") for t in DOCUMENT_TEMPLATES.values() for w in t.split()
) | {"no", "results", "of", "q"}
MAX_NAME_CHARS = 6
MIN_ENTITIES, MAX_ENTITIES = 8, 2000
"""At least two entities of each kind (so a chain need not revisit one); the name space holds thousands."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    """The entity's name."""
    text: str


@dataclass
class Entity:
    name: str
    kind: str
    doc_id: str
    links: dict[str, str] = field(default_factory=dict)
    """Relation name -> the linked entity's name (every relation whose source is `kind`)."""


def _name(rng: random.Random) -> str:
    syllables = rng.choice((2, 2, 3))
    name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
    if len(name) < MAX_NAME_CHARS and rng.random() < 0.5:
        name += rng.choice(_CODAS)
    return name


def draw_names(n: int, rng: random.Random) -> list[str]:
    """`n` distinct syllable names (4-6 lowercase letters), none a word of the document templates."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        name = _name(rng)
        if name not in seen and name not in _TEMPLATE_WORDS:
            seen.add(name)
            names.append(name)
    return names


def draw_entities(num_entities: int, rng: random.Random, pool: list[str] | None = None) -> dict[str, Entity]:
    """`num_entities` entities (kinds in equal shares, shuffled; doc ids d0, d1, ... in order) and
    their links, each drawn uniformly among the entities of the target kind. Names: `draw_names`,
    or `num_entities` distinct ones of `pool` (a vocabulary of names that many worlds share)."""
    names = draw_names(num_entities, rng) if pool is None else rng.sample(pool, num_entities)
    kinds = [KINDS[i % len(KINDS)] for i in range(num_entities)]
    rng.shuffle(kinds)
    entities = {name: Entity(name, kind, f"d{i}") for i, (name, kind) in enumerate(zip(names, kinds))}
    by_kind = {k: [e.name for e in entities.values() if e.kind == k] for k in KINDS}
    for entity in entities.values():
        for r in RELATIONS:
            if r.source == entity.kind:
                entity.links[r.name] = rng.choice(by_kind[r.target])
    return entities


class Corpus:
    """The entities, their documents and the BM25 index over them (all a function of the arguments)."""

    def __init__(self, num_entities: int = 48, seed: int = 0, fuzzy: bool = False):
        """fuzzy: documents and queries are also indexed by the character trigrams of their words
        (`index_terms`), so a misspelt name ("tebus" for "tebusu") still finds its document."""
        if not isinstance(num_entities, int) or isinstance(num_entities, bool) or not (
            MIN_ENTITIES <= num_entities <= MAX_ENTITIES
        ):
            raise ValueError(f"num_entities must be an int in [{MIN_ENTITIES}, {MAX_ENTITIES}], got {num_entities!r}")
        self._index(draw_entities(num_entities, random.Random(f"search-corpus:{seed}")), fuzzy)

    @classmethod
    def of_entities(cls, entities: dict[str, Entity], fuzzy: bool = False) -> Corpus:
        """The corpus of given entities (`draw_entities`; a per-episode world of the search task)."""
        corpus = cls.__new__(cls)
        corpus._index(entities, fuzzy)
        return corpus

    def _index(self, entities: dict[str, Entity], fuzzy: bool) -> None:
        self.entities = entities
        self.documents = [
            Document(e.doc_id, e.name, DOCUMENT_TEMPLATES[e.kind].format(name=e.name, **e.links))
            for e in self.entities.values()
        ]
        self.by_id = {d.doc_id: d for d in self.documents}
        self.fuzzy = fuzzy
        self._bm25 = _build_index([index_terms(f"{d.title} {d.text}", fuzzy) for d in self.documents])

    def follow(self, name: str, relation: str) -> str:
        """The entity `relation` links `name` to (KeyError when it has no such link)."""
        return self.entities[name].links[relation]

    def document_of(self, name: str) -> Document:
        return self.by_id[self.entities[name].doc_id]

    def search(self, query: str, k: int) -> list[Document]:
        """The `k` best documents for `query` by BM25, best first; only those sharing a word with it."""
        terms = index_terms(query, self.fuzzy)
        if not terms:
            return []
        k = min(k, len(self.documents))
        indices, scores = self._bm25.retrieve([terms], k=k, show_progress=False, n_threads=0)
        return [self.documents[int(i)] for i, s in zip(indices[0], scores[0]) if s > 0]


WORD = re.compile(r"(?u)\b\w\w+\b")
"""What a term is: a word of two or more word characters, lowercased (as `bm25s.tokenize` splits)."""


def index_terms(text: str, fuzzy: bool = False) -> list[str]:
    """The BM25 terms of `text`: its words, and with `fuzzy` the character trigrams of every word of
    three or more letters, marked `#tri` (they never equal a word)."""
    words = WORD.findall(text.lower())
    if not fuzzy:
        return words
    return words + [f"#{w[i:i + 3]}" for w in words if len(w) >= 3 for i in range(len(w) - 2)]


def _build_index(terms: list[list[str]]) -> Any:
    import bm25s

    index = bm25s.BM25()
    index.index(terms, show_progress=False)
    return index


class SearchTool:
    """`search(query)`: the top-k documents as "d17 velora: ..." lines (implements `tasks.tools.Tool`)."""

    name = "search"
    description = "Search the corpus; returns the best matching documents, one per line: id, then text."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "words to look for, e.g. a name"}},
        "required": ["query"],
    }

    def __init__(self, corpus: Corpus, top_k: int = 1):
        self.corpus, self.top_k = corpus, top_k

    def __call__(self, query: str) -> str:
        hits = self.corpus.search(query, self.top_k)
        return "\n".join(f"{d.doc_id} {d.text}" for d in hits) if hits else "no results"


class OpenTool:
    """`open(doc_id)`: one document's full text; an unknown id raises (the runner reports it)."""

    name = "open"
    description = "Open a document by its id (as search lists it, e.g. d17); returns its full text."
    parameters = {
        "type": "object",
        "properties": {"doc_id": {"type": "string", "description": "a document id such as d17"}},
        "required": ["doc_id"],
    }

    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def __call__(self, doc_id: str) -> str:
        doc = self.corpus.by_id.get(doc_id)
        if doc is None:
            raise LookupError(f"no document {doc_id!r} (ids are d0 to d{len(self.corpus.documents) - 1})")
        return doc.text

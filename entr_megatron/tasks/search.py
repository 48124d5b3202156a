"""Multi-hop questions over an invented corpus, answered with a BM25 `search` tool (BrowseComp-Plus style).

    task = SearchTask(num_entities=48, hops=2)          # corpus, index and character tokenizer, from seeds
    task.prompts("train", 4, seed=0)                    # [([<s> q : ...], "dunmore"), ...]
    env = task.new_environment()                        # ToolEnv with `search` and `open`
    task.sft_examples("train", 64, seed=0)              # expert traces for a warm-up
    SearchTask(num_entities=8, world="per_episode", name_pool=48)   # every question in its own world

A question composes `hops` relations from a start entity ("q: home of founder of velora?":
the founder of the company velora, then where that person lives). Each document states only
its own entity's links, so the expert searches the start, reads the next entity in its
document, searches that one, and so on (`hops` searches), then writes the answer:

    q: home of founder of velora?<tool_call>{"name":"search","arguments":{"query":"velora"}}</tool_call>
    <tool_response>d0 velora: founder marek, base tarnis.</tool_response>
    <tool_call>{"name":"search","arguments":{"query":"marek"}}</tool_call>
    <tool_response>d5 marek: home dunmore, employer velora.</tool_response>dunmore</s>

(one line in the sequence; broken here for reading). At the defaults a 2-hop trace is ~30
prompt + ~104 policy + ~70 observation tokens (~205 in all), a 3-hop one ~41 + ~153 + ~104.
Reward: 1.0 iff the text after the last `</tool_response>`, up to EOS, is the answer and EOS
was written; the env gives none.

Worlds (`world`): "fixed", one corpus of `num_entities` entities that every question is asked
of; "per_episode", every question asked of its own world of `num_entities` entities, named by a
tag in the question ("w4821 q: home of founder of velora?"; `search_worlds.py`: new links, so
nothing to memorise), with names from a shared vocabulary of `name_pool` names or fresh ones;
a world is indexed by BM25 on first use and kept in a cache of `WORLD_CACHE` worlds.

Splits: each question belongs to train or test by a hash of its text (`base.split_of`), so the
splits never share a question. On the fixed corpus they share documents and sub-chains (what
should transfer is the skill of following links by search, though a tiny model memorises the
training chains instead); per-episode worlds are split by tag, so the splits share no world.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any, get_args

from entr_megatron.config.task import SearchWorld
from entr_megatron.tasks.base import answer_after, check_fractions, check_split, final_answer_reward, split_of
from entr_megatron.tasks.char_tokenizer import CHARS, build_char_tokenizer
from entr_megatron.tasks.search_corpus import (
    MAX_ENTITIES, MIN_ENTITIES, RELATIONS, Corpus, OpenTool, SearchTool,
)
from entr_megatron.tasks.search_worlds import (
    WORLD_TAGS, WorldEnv, pool_names, tag_of, world_entities, world_prefix,
)
from entr_megatron.tasks.tool_env import ToolEnv
from entr_megatron.tasks.tools.calls import (
    TOOL_RESPONSE_CLOSE, TOOL_TOKENS, Tool, ToolCall, ToolRunner, format_tool_call,
)
from entr_megatron.tasks.tools.sandbox import PythonTool, SandboxLimits
from entr_megatron.types import Sample

__all__ = ["EXTRA_CHARS", "HOPS", "MAX_TOP_K", "WORLDS", "WORLD_CACHE", "SearchProblem", "SearchTask",
           "final_answer", "search_tokenizer"]

HOPS = (2, 3)
MAX_TOP_K = 10
WORLDS: tuple[str, ...] = get_args(SearchWorld)
WORLD_CACHE = 4096
"""Per-episode worlds kept built (index and tools): a training step asks for a few, an evaluation for
task.eval_size; one costs ~5 ms to build at 8 entities."""
EXTRA_CHARS = '{}"_[]\'\n' + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Characters beyond the base character set: JSON of the calls, the truncation mark, newlines between
search results, and the capitals and quotes of error messages ("LookupError: no document 'd99'")."""


def search_tokenizer() -> Any:
    """The character tokenizer of the search task: the base characters + `EXTRA_CHARS`, and the
    Hermes markers (`tasks.tools.TOOL_TOKENS`) as single tokens."""
    return build_char_tokenizer(chars=CHARS + EXTRA_CHARS, tool_tokens=TOOL_TOKENS)


@dataclass(frozen=True)
class SearchProblem:
    text: str
    """The prompt text, e.g. "q: home of founder of velora?" (per-episode worlds: "w4821 q: ...")."""
    answer: str
    chain: tuple[str, ...]
    """The entities from the start to the answer (hops + 1 names): the expert searches all but the last."""
    relations: tuple[str, ...]
    """The relation followed at each hop."""


def question_text(start: str, relations: tuple[str, ...]) -> str:
    """ "q: home of founder of velora?" for relations ("founder", "home") from "velora"."""
    return "q: " + " of ".join(reversed(relations)) + f" of {start}?"


def all_problems(corpus: Corpus, hops: int, prefix: str = "") -> list[SearchProblem]:
    """Every chain of `hops` relations from every entity that visits no entity twice, in corpus order;
    `prefix` goes in front of each question (a per-episode world's tag)."""
    out: list[SearchProblem] = []

    def extend(chain: tuple[str, ...], relations: tuple[str, ...]) -> None:
        if len(relations) == hops:
            out.append(SearchProblem(prefix + question_text(chain[0], relations), chain[-1], chain, relations))
            return
        kind = corpus.entities[chain[-1]].kind
        for r in RELATIONS:
            if r.source == kind:
                nxt = corpus.follow(chain[-1], r.name)
                if nxt not in chain:
                    extend(chain + (nxt,), relations + (r.name,))

    for name in corpus.entities:
        extend((name,), ())
    return out


def final_answer(text: str) -> str:
    """What follows the last tool response (the whole text when no tool was used), stripped."""
    return answer_after(text, TOOL_RESPONSE_CLOSE)


def _check_int(name: str, value: Any, lo: int, hi: float) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def _sandbox_limits(tool_timeout_s: float) -> Any:
    """The python tool's sandbox ends its process before the runner gives up on the call."""
    wall = min(0.8 * tool_timeout_s, SandboxLimits.wall_s)
    return SandboxLimits(wall_s=wall, cpu_s=min(SandboxLimits.cpu_s, wall))


class SearchTask:
    """Multi-hop questions over a generated corpus with `search` and `open` tools (see module docstring)."""

    name = "search"

    def __init__(
        self,
        num_entities: int = 48,
        hops: int = 2,
        top_k: int = 1,
        corpus_seed: int = 0,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        tool_timeout_s: float = 5.0,
        max_tool_output_chars: int = 400,
        python_tool: bool = False,
        python_tool_allow_weak_containment: bool = False,
        sft_questions: int | None = None,
        fuzzy_search: bool = False,
        tokenizer: Any = None,
        world: str = "fixed",
        name_pool: int | None = None,
    ):
        """num_entities: corpus size (a quarter each companies, people, cities, countries; per_episode:
        the size of each question's world); hops: searches a question needs (2 or 3); top_k: documents
        per search answer; corpus_seed: which world (per_episode: which family of worlds and questions);
        test_fraction / split_seed: which questions are held out;
        tool_timeout_s / max_tool_output_chars: the `ToolRunner` limits of each call;
        python_tool: also offer `python` (tasks.tools.sandbox.PythonTool: code in a sandboxed process);
        python_tool_allow_weak_containment: run it even where the kernel cannot confine its reads
        (default: SandboxUnavailable there);
        sft_questions: demonstrations (`sft_examples`) exist for only this many training questions (a
        fixed subset); RL still draws from all of them. None: every training question has one (the
        only choice with per_episode worlds);
        fuzzy_search: BM25 over words and their character trigrams (a misspelt name still finds its
        document; `search_corpus.index_terms`);
        tokenizer: an HF tokenizer with the Hermes markers as single tokens (default `search_tokenizer()`);
        world: "fixed" (one corpus) or "per_episode" (one world per question: module docstring);
        name_pool: per_episode: every world's names come from one vocabulary of this many names (a
        function of corpus_seed; >= num_entities). None: fresh names in every world."""
        _check_int("num_entities", num_entities, MIN_ENTITIES, MAX_ENTITIES)
        if hops not in HOPS or isinstance(hops, bool):
            raise ValueError(f"hops must be one of {HOPS}, got {hops!r}")
        _check_int("top_k", top_k, 1, min(MAX_TOP_K, num_entities))
        _check_int("corpus_seed", corpus_seed, 0, math.inf)
        _check_int("split_seed", split_seed, 0, math.inf)
        check_fractions(test_fraction)
        if world not in WORLDS:
            raise ValueError(f"world must be one of {WORLDS}, got {world!r}")
        if world == "per_episode" and sft_questions is not None:
            raise ValueError(f"sft_questions must be None with world='per_episode' (every question is new), "
                             f"got {sft_questions!r}")
        if name_pool is not None:
            if world != "per_episode":
                raise ValueError(f"name_pool needs world='per_episode', got name_pool={name_pool!r}")
            _check_int("name_pool", name_pool, num_entities, MAX_ENTITIES)
        self.num_entities, self.hops, self.top_k, self.corpus_seed = num_entities, hops, top_k, corpus_seed
        self.test_fraction, self.split_seed, self.world_kind = float(test_fraction), split_seed, world
        self.fuzzy_search, self.python_tool = bool(fuzzy_search), bool(python_tool)
        self.python_tool_allow_weak_containment = bool(python_tool_allow_weak_containment)
        self.tokenizer = search_tokenizer() if tokenizer is None else tokenizer
        ToolEnv(self.tokenizer, ToolRunner(()))  # the markers must be single tokens: fail here, not mid-run
        self.corpus = None if world == "per_episode" else Corpus(num_entities, corpus_seed, fuzzy=self.fuzzy_search)
        self.name_pool = name_pool
        self._names = None if name_pool is None else pool_names(name_pool, corpus_seed)
        self.set_tool_limits(tool_timeout_s, max_tool_output_chars)  # validates them
        self.sft_questions = sft_questions
        if self.corpus is None:
            return
        pool = all_problems(self.corpus, hops)
        self._pools = {s: [p for p in pool if split_of(p.text, self.test_fraction, split_seed) == s]
                       for s in ("train", "test")}
        if sft_questions is not None:
            _check_int("sft_questions", sft_questions, 1, len(self._pools["train"]))
        self._demonstrated = self._pools["train"] if sft_questions is None else random.Random(
            f"search-sft:{corpus_seed}").sample(self._pools["train"], sft_questions)

    def set_tool_limits(self, timeout_s: float, max_output_chars: int) -> None:
        """The `ToolRunner` limits of every call from now on (`train` sets rollout.agent's); the python
        tool's sandbox ends its process at the same wall-clock limit."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"tool_timeout_s must be a finite number > 0, got {timeout_s!r}")
        _check_int("max_tool_output_chars", max_output_chars, 1, math.inf)
        self._timeout_s, self._max_output_chars = float(timeout_s), max_output_chars
        self._python: Tool | None = None
        if self.python_tool:
            self._python = PythonTool(_sandbox_limits(timeout_s),
                                      allow_weak_containment=self.python_tool_allow_weak_containment)
        if self.corpus is not None:
            self._runner = self._runner_of_corpus(self.corpus)
        # per-episode worlds are built on use, with the limits of that moment: none is kept from before
        self._world = functools.lru_cache(maxsize=WORLD_CACHE)(self._build_world)

    def _runner_of_corpus(self, corpus: Corpus) -> ToolRunner:
        tools: tuple[Tool, ...] = (SearchTool(corpus, self.top_k), OpenTool(corpus))
        if self._python is not None:
            tools += (self._python,)
        return ToolRunner(tools, timeout_s=self._timeout_s, max_output_chars=self._max_output_chars)

    def _build_world(self, tag: int) -> tuple[Corpus, ToolRunner, list[SearchProblem]]:
        """World `tag`: its corpus, its tools, and its questions."""
        entities = world_entities(tag, self.num_entities, self.corpus_seed, self._names)
        corpus = Corpus.of_entities(entities, self.fuzzy_search)
        return corpus, self._runner_of_corpus(corpus), all_problems(corpus, self.hops, world_prefix(tag))

    def world(self, text: str) -> Corpus:
        """The corpus question `text` is asked of: the fixed corpus, or (per_episode) its world's."""
        return self.corpus if self.corpus is not None else self._world(tag_of(text))[0]

    def _runner_of_question(self, text: str) -> ToolRunner:
        return self._runner if self.corpus is not None else self._world(tag_of(text))[1]

    @property
    def documents(self) -> list:
        """The corpus's documents (`search_corpus.Document`: doc_id, title, text), by doc id order;
        per_episode: those of the first training question's world."""
        return self.world(self._first_question()).documents

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The `search` and `open` tools (for `tasks.tools.tool_schema`, or a chat template); per_episode:
        those of the first training question's world (every world's have the same names and schemas)."""
        return tuple(self._runner_of_question(self._first_question()).tools.values())

    def _first_question(self) -> str:
        return "" if self.corpus is not None else self.problems("train", 1, 0)[0].text

    def problems(self, split: str, n: int, seed: int, *, demonstrated: bool = False) -> list[SearchProblem]:
        """`n` questions of `split` (distinct when the split holds `n`), a pure function of the arguments;
        `demonstrated`: of the training questions that have demonstrations (`sft_questions`)."""
        check_split(split)
        _check_int("n", n, 0, math.inf)
        if self.corpus is None:
            return self._fresh_problems(split, n, seed)
        pool = self._demonstrated if demonstrated and split == "train" else self._pools[split]
        if not pool:
            raise ValueError(f"the {split!r} split has no questions (num_entities={self.num_entities}, "
                             f"test_fraction={self.test_fraction})")
        rng = random.Random(f"search:{split}:{seed}")
        return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)

    def _fresh_problems(self, split: str, n: int, seed: int) -> list[SearchProblem]:
        """per_episode: `n` distinct questions of `split`, each from a world drawn uniformly among the
        split's (a world's split is its tag's, `base.split_of`), then uniformly among its questions."""
        rng = random.Random(f"search-worlds:{split}:{seed}")
        out: list[SearchProblem] = []
        seen: set[str] = set()
        while len(out) < n:
            tag = rng.randrange(WORLD_TAGS)
            if split_of(world_prefix(tag), self.test_fraction, self.split_seed) != split:
                continue
            problem = rng.choice(self._world(tag)[2])
            if problem.text not in seen:
                seen.add(problem.text)
                out.append(problem)
        return out

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], str]]:
        """(prompt ids = BOS + question, answer) pairs."""
        return [(self.tokenizer.encode(p.text), p.answer) for p in self.problems(split, n, seed)]

    def answer_reward(self, response_ids: list[int], reference: str) -> float:
        """1.0 iff the text after the last tool response, up to EOS, is the reference and EOS was written."""
        return final_answer_reward(self.tokenizer, response_ids, reference, TOOL_RESPONSE_CLOSE)

    def reward(self, sample: Sample, reference: str) -> float:
        """Exact match of the final answer (tool calls and responses before it are skipped)."""
        return self.answer_reward(sample.response_ids, reference)

    def new_environment(self) -> ToolEnv | WorldEnv:
        """The environment of one episode: a `ToolEnv` with the corpus's tools (stateless: any episode
        may use any one), or per_episode a `WorldEnv` that takes its question's world at reset."""
        if self.corpus is None:
            return WorldEnv(self.tokenizer, self._runner_of_question)
        return ToolEnv(self.tokenizer, self._runner)

    def expert_trace(self, problem: SearchProblem, env: ToolEnv | WorldEnv | None = None) -> tuple[list[int], list[bool]]:
        """(response ids, loss mask) of the expert on `problem`: a search per hop, run through a real
        environment (reset with the problem's prompt, so the observations are what the env returns),
        then answer + EOS. Mask False on observation tokens."""
        env = env or self.new_environment()
        enc = self.tokenizer.encode
        env.reset(enc(problem.text), problem.answer)
        world = self.world(problem.text)
        response: list[int] = []
        mask: list[bool] = []
        for query, nxt in zip(problem.chain[:-1], problem.chain[1:]):
            turn = enc(format_tool_call(ToolCall("search", {"query": query})), add_special_tokens=False)
            step = env.step(turn)
            doc = world.document_of(query)
            seen = step.tool_outcomes[0].text if len(step.tool_outcomes) == 1 else ""
            if step.done or not seen.startswith(f"{doc.doc_id} {doc.text}"):
                raise ValueError(f"the expert's search for {query!r} did not rank its document first ({seen!r}); "
                                 f"is max_tool_output_chars={self._max_output_chars} too small?")
            response += turn + step.observation_ids
            mask += [True] * len(turn) + [False] * len(step.observation_ids)
        final = enc(problem.answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        if not env.step(final).done:
            raise AssertionError("the answer turn did not end the episode")
        return response + final, mask + [True] * len(final)

    def sft_examples(self, split: str, n: int, seed: int) -> list[tuple[list[int], list[int], list[bool]]]:
        """(prompt ids, target ids, target mask) of expert traces (`expert_trace`) on `n` questions of
        `split` (of training, only those with demonstrations: `sft_questions`)."""
        out = []
        for p in self.problems(split, n, seed, demonstrated=True):
            target, mask = self.expert_trace(p)
            out.append((self.tokenizer.encode(p.text), target, mask))
        return out

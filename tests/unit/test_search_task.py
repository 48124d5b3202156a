"""The search task: its invented corpus, BM25 retrieval, questions, expert traces, reward and ToolEnv;
per-episode worlds (`task.search.world: per_episode`, tasks/search_worlds.py)."""

import itertools
import re

import pytest

pytest.importorskip("bm25s")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from entr_megatron.rollout.engine import EngineHealth, GenerateResult, SamplingParams  # noqa: E402
from entr_megatron.rollout.episode_batch import Episode, run_episodes  # noqa: E402
from entr_megatron.tasks.char_tokenizer import build_char_tokenizer  # noqa: E402
from entr_megatron.tasks.environment import Environment  # noqa: E402
from entr_megatron.tasks.search import SearchTask, search_tokenizer  # noqa: E402
from entr_megatron.tasks.search import all_problems  # noqa: E402
from entr_megatron.tasks.search_corpus import KINDS, Corpus  # noqa: E402
from entr_megatron.tasks.search_worlds import (  # noqa: E402
    WORLD_TAGS, WorldEnv, pool_names, tag_of, world_entities, world_prefix,
)
from entr_megatron.tasks.tool_env import ToolEnv  # noqa: E402
from entr_megatron.tasks.tools import (  # noqa: E402
    TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, ToolCall, ToolRunner, format_tool_call, parse_tool_calls,
)
from entr_megatron.types import Sample  # noqa: E402


@pytest.fixture(scope="module")
def task():
    return SearchTask()


@pytest.fixture(scope="module")
def task3():
    return SearchTask(hops=3, corpus_seed=3)


@pytest.fixture(scope="module")
def worlds():
    """Every question in its own world of 8 entities with fresh names."""
    return SearchTask(num_entities=8, world="per_episode")


@pytest.fixture(scope="module")
def pooled():
    """Per-episode worlds of 8 entities named from a vocabulary of 24 (the CPU agent demo's kind)."""
    return SearchTask(num_entities=8, world="per_episode", name_pool=24)


@pytest.fixture(scope="module")
def worlds3():
    return SearchTask(num_entities=12, hops=3, corpus_seed=5, world="per_episode")


def sample_of(prompt_ids, response_ids):
    n = len(response_ids)
    return Sample(prompt_ids=prompt_ids, response_ids=response_ids, behaviour_logprobs=[0.0] * n, versions=[0] * n)


def ids_of(task, text):
    return task.tokenizer.encode(text, add_special_tokens=False)


# --- corpus -----------------------------------------------------------------------------------

def test_corpus_is_a_function_of_its_seed():
    docs = lambda c: [(d.doc_id, d.title, d.text) for d in c.documents]  # noqa: E731
    assert docs(Corpus(48, seed=0)) == docs(Corpus(48, seed=0))
    assert docs(Corpus(48, seed=0)) != docs(Corpus(48, seed=1))
    assert {d.title for d in Corpus(48, seed=0).documents} != {d.title for d in Corpus(48, seed=1).documents}


@pytest.mark.parametrize("num_entities, seed", [(48, 0), (48, 1), (400, 2)])
def test_names_are_unique_short_lowercase_and_documents_short(num_entities, seed):
    corpus = Corpus(num_entities, seed)
    names = [d.title for d in corpus.documents]
    assert len(names) == len(set(names)) == num_entities
    assert all(re.fullmatch(r"[a-z]{2,6}", n) for n in names)
    assert len({d.doc_id for d in corpus.documents}) == num_entities
    assert max(len(f"{d.doc_id} {d.text}") for d in corpus.documents) <= 60
    template_words = {"founder", "base", "home", "employer", "country", "leader"}
    assert not template_words & set(names)
    # Each document states exactly its entity's links.
    for e in corpus.entities.values():
        doc = corpus.document_of(e.name)
        assert doc.text.startswith(f"{e.name}: ")
        assert set(re.findall(r"[a-z]+", doc.text)) - template_words == {e.name, *e.links.values()}


def test_bm25_ranks_the_named_document_first(task):
    corpus = task.corpus
    for e in corpus.entities.values():
        hits = corpus.search(e.name, k=3)
        assert hits[0].doc_id == e.doc_id, (e.name, hits)
        assert all(e.name in re.findall(r"[a-z]+", h.text) for h in hits)  # only documents sharing the word
    assert corpus.search("nothingmatches", k=1) == []


def test_search_and_open_tools(task):
    search, open_doc = task.tools
    name = next(iter(task.corpus.entities))
    doc = task.corpus.document_of(name)
    assert search(query=name) == f"{doc.doc_id} {doc.text}"
    assert search(query="zzzz qqqq") == "no results"
    assert open_doc(doc_id=doc.doc_id) == doc.text
    wide = SearchTask(top_k=3).tools[0](query=name).split("\n")
    assert wide[0] == f"{doc.doc_id} {doc.text}" and 1 <= len(wide) <= 3


# --- questions --------------------------------------------------------------------------------

def follow_question(corpus, text):
    """The chain a question asks for, read from its text and the entity graph alone."""
    m = re.fullmatch(r"(?:w\d+ )?q: (.+) of ([a-z]+)\?", text)  # per-episode worlds: a tag in front
    relations = m.group(1).split(" of ")[::-1]
    chain = [m.group(2)]
    for r in relations:
        chain.append(corpus.entities[chain[-1]].links[r])
    return relations, chain


@pytest.mark.parametrize("which", ["task", "task3", "worlds", "worlds3", "pooled"])
def test_every_gold_chain_is_answerable_by_its_searches(which, request):
    task = request.getfixturevalue(which)
    tok = task.tokenizer
    for split in ("train", "test"):
        for (prompt, target, mask), p in zip(task.sft_examples(split, 40, seed=1), task.problems(split, 40, seed=1)):
            question = tok.decode(prompt, skip_special_tokens=True)
            corpus = task.world(question)  # the fixed corpus, or the question's own world
            relations, chain = follow_question(corpus, question)
            assert len(relations) == task.hops and p.answer == chain[-1] and len(set(chain)) == len(chain)
            text = tok.decode(target, skip_special_tokens=False)
            calls = parse_tool_calls(text)
            responses = re.findall(f"{TOOL_RESPONSE_OPEN}(.*?){TOOL_RESPONSE_CLOSE}", text, flags=re.S)
            assert [c.arguments["query"] for c in calls] == chain[:-1] and len(responses) == task.hops
            for query, response, nxt in zip(chain[:-1], responses, chain[1:]):
                top_id, top_text = response.split(" ", 1)
                assert top_id == corpus.entities[query].doc_id  # BM25 top-1 is the hop's document
                assert nxt in re.findall(r"[a-z]+", top_text)  # ... and it names the next hop
            assert text.endswith(f"{TOOL_RESPONSE_CLOSE}{chain[-1]}{tok.eos_token}")


def test_train_and_test_questions_are_disjoint_and_prompts_pure(task):
    train = {p.text for p in task.problems("train", 10_000, seed=0)}
    test = {p.text for p in task.problems("test", 10_000, seed=0)}
    assert train and test and not train & test
    assert task.prompts("train", 8, seed=5) == task.prompts("train", 8, seed=5)
    assert task.prompts("train", 8, seed=5) != task.prompts("train", 8, seed=6)
    prompt, answer = task.prompts("test", 1, seed=0)[0]
    assert prompt[0] == task.tokenizer.bos_token_id and answer in task.corpus.entities
    with pytest.raises(ValueError, match="split"):
        task.problems("dev", 1, seed=0)


# --- reward and sft ---------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["task", "worlds"])
def test_reward_of_gold_wrong_and_unended_traces(which, request):
    task = request.getfixturevalue(which)
    (prompt, target, _), = task.sft_examples("train", 1, seed=2)
    (_, answer), = task.prompts("train", 1, seed=2)
    eos = task.tokenizer.eos_token_id
    assert task.reward(sample_of(prompt, target), answer) == 1.0
    assert task.reward(sample_of(prompt, target + ids_of(task, "junk")), answer) == 1.0  # after EOS: ignored
    body = target[:-1 - len(ids_of(task, answer))]
    world = task.world(task.tokenizer.decode(prompt, skip_special_tokens=True))
    wrong = next(n for n in world.entities if n != answer)
    assert task.reward(sample_of(prompt, body + ids_of(task, wrong) + [eos]), answer) == 0.0
    assert task.reward(sample_of(prompt, target[:-1]), answer) == 0.0  # no EOS
    assert task.reward(sample_of(prompt, body + ids_of(task, answer + "x") + [eos]), answer) == 0.0
    assert task.reward(sample_of(prompt, ids_of(task, f" {answer} ") + [eos]), answer) == 1.0  # no tool needed


@pytest.mark.parametrize("which", ["task3", "worlds"])
def test_sft_masks_exactly_the_observation_tokens(which, request):
    task = request.getfixturevalue(which)
    tok = task.tokenizer
    open_id, close_id = (tok.convert_tokens_to_ids(t) for t in (TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE))
    for _, target, mask in task.sft_examples("train", 20, seed=0):
        assert len(mask) == len(target)
        inside, expected = False, []
        for t in target:
            inside = inside or t == open_id
            expected.append(not inside)
            inside = inside and t != close_id
        assert mask == expected and mask.count(False) > 0 and mask[-1] is True


@pytest.mark.parametrize("which", ["task", "worlds"])
def test_run_episodes_reproduces_the_expert_trace(which, request):
    """An engine that plays the expert's turns through the real agent loop gets the same sample."""
    task = request.getfixturevalue(which)
    examples = task.sft_examples("test", 3, seed=0)
    answers = [a for _, a in task.prompts("test", 3, seed=0)]

    class Replay:
        def __init__(self):
            self.results, self.ids = [], itertools.count()

        def submit(self, requests):
            rids = []
            for req in requests:
                full = next(p + t for p, t, _ in examples if req.prompt_ids == (p + t)[: len(req.prompt_ids)])
                out = full[len(req.prompt_ids):]
                stops = set(req.params.stop_token_ids) | {task.tokenizer.eos_token_id}
                out = out[: next(i + 1 for i, t in enumerate(out) if t in stops)]
                rid = f"r{next(self.ids)}"
                self.results.append(GenerateResult(
                    request_id=rid, sample_index=0, prompt_ids=req.prompt_ids, output_ids=out,
                    logprobs=[-0.1] * len(out), versions=[0] * len(out), finish_reason="stop",
                    entropy=[0.5] * len(out), group_id=req.group_id))
                rids.append(rid)
            return rids

        def poll(self, timeout=0.0):
            out, self.results = self.results, []
            return out

        def health(self):
            return EngineHealth(alive=True, weight_version=0)

    if task.corpus is not None:
        env = task.new_environment()
        assert isinstance(env, Environment)
        episodes = [Episode(env, p, a) for (p, _, _), a in zip(examples, answers)]  # one env, shared: stateless
    else:  # per_episode: an environment per episode, which takes the world of its prompt's question
        episodes = [Episode(task.new_environment(), p, a) for (p, _, _), a in zip(examples, answers)]
        assert all(isinstance(ep.env, WorldEnv) and isinstance(ep.env, Environment) for ep in episodes)
    samples = run_episodes(Replay(), episodes, SamplingParams(max_new_tokens=200), max_turns=4,
                           max_response_tokens=400)
    for s, (_, target, mask), a in zip(samples, examples, answers):
        assert s.response_ids == target and s.loss_mask == mask
        assert task.reward(s, a) == 1.0


# --- ToolEnv ----------------------------------------------------------------------------------

def test_tool_env_shows_a_malformed_call_as_an_error_and_goes_on(task):
    env = task.new_environment()
    assert env.stop_token_ids == (task.tokenizer.convert_tokens_to_ids("</tool_call>"),)
    prompt = task.prompts("train", 1, seed=0)[0][0]
    assert env.reset(prompt, "x") == prompt
    bad = env.step(ids_of(task, '<tool_call>{"name": "search", "arguments": {"query": </tool_call>'))
    text = task.tokenizer.decode(bad.observation_ids)
    assert not bad.done and bad.reward == 0.0
    assert text.startswith(f"{TOOL_RESPONSE_OPEN}error: tool call is not valid JSON") and text.endswith(
        TOOL_RESPONSE_CLOSE)
    assert [o.name for o in bad.tool_outcomes] == ["invalid"]
    no_open = env.step(ids_of(task, "search velora</tool_call>"))
    assert not no_open.done and no_open.tool_outcomes[0].error is not None
    name = next(iter(task.corpus.entities))
    good = env.step(ids_of(task, format_tool_call(ToolCall("search", {"query": name}))))
    doc = task.corpus.document_of(name)
    expected = f"{TOOL_RESPONSE_OPEN}{doc.doc_id} {doc.text}{TOOL_RESPONSE_CLOSE}"
    assert task.tokenizer.decode(good.observation_ids) == expected
    assert good.tool_outcomes[0].error is None and not good.done
    end = env.step(ids_of(task, name) + [task.tokenizer.eos_token_id])
    assert end == (([], True, 0.0, ()))


def test_open_with_an_unknown_id_is_an_error_observation(task):
    env = task.new_environment()
    step = env.step(ids_of(task, format_tool_call(ToolCall("open", {"doc_id": "d999"}))))
    text = task.tokenizer.decode(step.observation_ids)
    assert text == (f"{TOOL_RESPONSE_OPEN}error: LookupError: no document 'd999' (ids are d0 to d47)"
                    f"{TOOL_RESPONSE_CLOSE}")
    assert task.tokenizer.unk_token_id not in step.observation_ids and not step.done
    ok = env.step(ids_of(task, format_tool_call(ToolCall("open", {"doc_id": "d3"}))))
    expected = f"{TOOL_RESPONSE_OPEN}{task.corpus.by_id['d3'].text}{TOOL_RESPONSE_CLOSE}"
    assert task.tokenizer.decode(ok.observation_ids) == expected


def test_tool_env_never_emits_a_special_token_a_tool_spelled(task):
    class Spell:
        name, description, parameters = "spell", "", {"type": "object", "properties": {}}

        def __call__(self):
            return "a</s>b"

    env = ToolEnv(task.tokenizer, ToolRunner([Spell()]))
    step = env.step(ids_of(task, format_tool_call(ToolCall("spell", {}))))
    assert task.tokenizer.eos_token_id not in step.observation_ids
    assert task.tokenizer.unk_token_id in step.observation_ids


def test_tool_env_needs_the_markers_as_single_tokens():
    with pytest.raises(ValueError, match="</tool_call>"):
        ToolEnv(build_char_tokenizer(), ToolRunner([]))  # the calculator's markers only
    with pytest.raises(ValueError, match="</tool_call>"):
        SearchTask(tokenizer=build_char_tokenizer())


def test_search_tokenizer_spells_whole_traces(task):
    tok = search_tokenizer()
    assert len(tok) == len(task.tokenizer)
    for prompt, target, _ in task.sft_examples("train", 10, seed=0):
        assert tok.unk_token_id not in prompt + target


@pytest.mark.parametrize("kwargs, field", [
    ({"num_entities": 4}, "num_entities"), ({"num_entities": 48.0}, "num_entities"), ({"hops": 1}, "hops"),
    ({"hops": 4}, "hops"), ({"top_k": 0}, "top_k"), ({"top_k": 11}, "top_k"), ({"corpus_seed": -1}, "corpus_seed"),
    ({"test_fraction": 0.0}, "test_fraction"), ({"test_fraction": 1.0}, "test_fraction"),
    ({"split_seed": "a"}, "split_seed"), ({"tool_timeout_s": 0}, "tool_timeout_s"),
    ({"max_tool_output_chars": 0}, "max_tool_output_chars"),
])
def test_constructor_validates_each_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SearchTask(**kwargs)


def test_demonstrations_cover_only_sft_questions_while_rl_draws_every_training_question():
    t = SearchTask(num_entities=48, sft_questions=10)
    demonstrated = {tuple(p) for p, _, _ in t.sft_examples("train", 300, seed=1)}
    assert len(demonstrated) == 10
    assert demonstrated == {tuple(p) for p, _, _ in t.sft_examples("train", 300, seed=2)}  # a fixed subset
    train = {tuple(p) for p, _ in t.prompts("train", 300, seed=1)}
    assert demonstrated < train and len(train) > 40
    assert {tuple(p) for p, _, _ in t.sft_examples("test", 50, seed=0)} == {tuple(p) for p, _ in t.prompts("test", 50, 0)}
    with pytest.raises(ValueError, match="sft_questions"):
        SearchTask(num_entities=48, sft_questions=10_000)


@pytest.mark.parametrize("world", ["fixed", "per_episode"])
def test_train_sets_the_tool_limits_of_rollout_agent(world):
    from entr_megatron.config import load_config
    from entr_megatron.controller.job.model_init import build_task

    cfg = load_config(None, ["task.name=search", "task.search.num_entities=16", "task.search.python_tool=true",
                             f"task.search.world={world}",
                             "rollout.agent.tool_timeout_s=2.5", "rollout.agent.max_tool_output_chars=7"])
    t = build_task(cfg, search_tokenizer())
    assert t.world_kind == world
    assert [tool.name for tool in t.tools] == ["search", "open", "python"]
    assert t.tools[-1].sandbox.limits.wall_s == pytest.approx(2.0)  # the sandbox stops before the runner gives up
    env = t.new_environment()
    env.reset(t.tokenizer.encode(t.problems("train", 1, 0)[0].text), None)  # the world t.documents come from
    step = env.step(ids_of(t, format_tool_call(ToolCall("search", {"query": t.documents[0].title}))))
    response = t.tokenizer.decode(step.observation_ids)
    assert response == f"{TOOL_RESPONSE_OPEN}{t.documents[0].doc_id} {t.documents[0].text}"[:len(TOOL_RESPONSE_OPEN) + 7] \
        + " ...[truncated]" + TOOL_RESPONSE_CLOSE


def test_fuzzy_search_finds_a_misspelt_name_and_exact_search_does_not():
    from entr_megatron.tasks.search_corpus import index_terms

    assert index_terms("Velora: founder marek.") == ["velora", "founder", "marek"]
    assert index_terms("marek", fuzzy=True) == ["marek", "#mar", "#are", "#rek"]
    exact, fuzzy = SearchTask(num_entities=48), SearchTask(num_entities=48, fuzzy_search=True)
    hits = 0
    for doc in exact.documents:
        misspelt = doc.title[:-1]  # the name without its last letter: never a name itself
        assert all(d.title != misspelt for d in exact.documents)
        assert exact.corpus.search(misspelt, 1) == []
        found = fuzzy.corpus.search(misspelt, 1)
        hits += bool(found) and found[0].doc_id == doc.doc_id
        assert fuzzy.corpus.search(doc.title, 1)[0].doc_id == doc.doc_id  # exact names still rank first
    assert hits >= 0.8 * len(exact.documents), hits


# --- per-episode worlds -----------------------------------------------------------------------

def test_a_question_names_its_world_by_tag():
    assert world_prefix(4821) == "w4821 " and tag_of("w4821 q: home of founder of velora?") == 4821
    for bad in ("q: home of founder of velora?", "w q: x?", "4821 q: x?", f"w{WORLD_TAGS} q: x?", "w12q: x?"):
        with pytest.raises(ValueError, match="not a question of a per-episode world"):
            tag_of(bad)


# Hand-checked: the documents of these worlds were read and each chain followed by eye.
HAND_CHECKED = {
    (4821, None): (
        ["d0 tezer: country fidami.", "d1 kigis: founder rezuru, base tezer.", "d2 fidami: leader rezuru.",
         "d3 rezuru: home gelufa, employer mevel.", "d4 tafote: home tezer, employer kigis.",
         "d5 gelufa: country nolir.", "d6 mevel: founder rezuru, base tezer.", "d7 nolir: leader rezuru."],
        {"w4821 q: leader of country of tezer?": ["tezer", "fidami", "rezuru"],
         "w4821 q: employer of leader of fidami?": ["fidami", "rezuru", "mevel"]}),
    (77, 24): (
        ["d0 moni: founder tuzis, base beve.", "d1 tuzis: home beve, employer mafal.",
         "d2 serofo: home beve, employer mafal.", "d3 mafal: founder serofo, base beve.", "d4 buvon: country kafe.",
         "d5 soge: leader tuzis.", "d6 kafe: leader tuzis.", "d7 beve: country soge."],
        {"w77 q: home of founder of moni?": ["moni", "tuzis", "beve"],
         "w77 q: base of employer of tuzis?": ["tuzis", "mafal", "beve"]}),
}


@pytest.mark.parametrize("tag, pool", sorted(HAND_CHECKED, key=str))
def test_a_world_is_drawn_from_its_tag_and_answered_through_the_real_bm25_tool(tag, pool):
    documents, questions = HAND_CHECKED[tag, pool]
    task = SearchTask(num_entities=8, world="per_episode", name_pool=pool)
    names = None if pool is None else pool_names(pool, 0)
    assert [f"{d.doc_id} {d.text}" for d in Corpus.of_entities(world_entities(tag, 8, 0, names)).documents] == documents
    for text, chain in questions.items():
        corpus = task.world(text)
        assert [f"{d.doc_id} {d.text}" for d in corpus.documents] == documents
        problem = next(p for p in all_problems(corpus, 2, world_prefix(tag)) if p.text == text)
        assert problem.answer == chain[-1] and list(problem.chain) == chain
        # The expert's trace through a WorldEnv, whose search tool is BM25 over these 8 documents.
        target, mask = task.expert_trace(problem)
        first, second = (next(d for d in documents if d.split(" ")[1] == f"{c}:") for c in chain[:-1])
        assert task.tokenizer.decode(target, skip_special_tokens=False) == (
            f'<tool_call>{{"name":"search","arguments":{{"query":"{chain[0]}"}}}}</tool_call>'
            f"<tool_response>{first}</tool_response>"
            f'<tool_call>{{"name":"search","arguments":{{"query":"{chain[1]}"}}}}</tool_call>'
            f"<tool_response>{second}</tool_response>{chain[2]}</s>")
        assert task.reward(sample_of(task.tokenizer.encode(text), target), chain[-1]) == 1.0


@pytest.mark.parametrize("which", ["worlds", "worlds3", "pooled"])
def test_worlds_have_two_of_each_kind_and_names_fresh_or_from_the_pool(which, request):
    task = request.getfixturevalue(which)
    pool = None if task.name_pool is None else set(pool_names(task.name_pool, task.corpus_seed))
    for p in task.problems("train", 50, seed=3):
        corpus = task.world(p.text)
        kinds = [e.kind for e in corpus.entities.values()]
        assert len(corpus.entities) == task.num_entities and all(kinds.count(k) >= 2 for k in KINDS)
        assert p.text.startswith(f"w{tag_of(p.text)} q: ") and len(set(p.chain)) == len(p.chain)
        assert pool is None or set(corpus.entities) <= pool
        other = Corpus.of_entities(world_entities(tag_of(p.text), task.num_entities, task.corpus_seed + 1))
        assert [d.text for d in other.documents] != [d.text for d in corpus.documents]


def test_per_episode_splits_share_no_world_and_prompts_are_pure(pooled):
    train = pooled.problems("train", 3000, seed=0)
    test = pooled.problems("test", 1000, seed=0)
    assert len({p.text for p in train}) == 3000 and len({p.text for p in test}) == 1000  # distinct per call
    train_tags, test_tags = {tag_of(p.text) for p in train}, {tag_of(p.text) for p in test}
    assert len(train_tags) > 2500 and len(test_tags) > 900 and not train_tags & test_tags
    # The same names, new facts: a held-out answer cannot be recalled from training worlds, where the
    # same question (without its tag) mostly has other answers.
    answers: dict[str, set[str]] = {}
    for p in train:
        answers.setdefault(p.text.split(" ", 1)[1], set()).add(p.answer)
    repeated = [p for p in test if p.text.split(" ", 1)[1] in answers]
    assert len(repeated) > 100 and sum(p.answer in answers[p.text.split(" ", 1)[1]] for p in repeated) < 0.6 * len(
        repeated)
    assert pooled.prompts("train", 8, seed=5) == pooled.prompts("train", 8, seed=5)
    assert pooled.prompts("train", 8, seed=5) != pooled.prompts("train", 8, seed=6)
    again = SearchTask(num_entities=8, world="per_episode", name_pool=24)
    assert again.prompts("test", 8, seed=0) == pooled.prompts("test", 8, 0)
    other = SearchTask(num_entities=8, world="per_episode", name_pool=24, corpus_seed=1)
    assert [a for _, a in other.prompts("test", 50, 0)] != [a for _, a in pooled.prompts("test", 50, 0)]


def test_world_env_takes_the_world_of_its_prompt_and_a_fresh_one_resumes_the_same(pooled):
    (p1, a1), (p2, a2) = pooled.prompts("train", 2, seed=7)
    env1, env2 = pooled.new_environment(), pooled.new_environment()
    assert env1 is not env2 and env1.stop_token_ids == (pooled.tokenizer.convert_tokens_to_ids("</tool_call>"),)
    with pytest.raises(AssertionError, match="before reset"):
        env1.step(ids_of(pooled, "x</tool_call>"))
    assert env1.reset(p1, None) == p1 and env2.reset(p2, None) == p2  # the controller passes no reference
    q1, q2 = (pooled.tokenizer.decode(p, skip_special_tokens=True) for p in (p1, p2))
    w1, w2 = pooled.world(q1), pooled.world(q2)
    name = next(n for n in w1.entities if n not in w2.entities)
    turn = ids_of(pooled, format_tool_call(ToolCall("search", {"query": name})))
    doc = w1.document_of(name)
    seen1 = pooled.tokenizer.decode(env1.step(turn).observation_ids)
    assert seen1 == f"{TOOL_RESPONSE_OPEN}{doc.doc_id} {doc.text}{TOOL_RESPONSE_CLOSE}"
    # the other episode searches its own world, which has no such entity
    assert pooled.tokenizer.decode(env2.step(turn).observation_ids) != seen1
    resumed = pooled.new_environment()  # an episode paused and continued gets a new env, reset with its prompt
    resumed.reset(p1, None)
    assert resumed.step(turn).observation_ids == env1.step(turn).observation_ids
    with pytest.raises(ValueError, match="not a question of a per-episode world"):
        pooled.new_environment().reset(ids_of(pooled, "q: home of founder of velora?"), None)


def test_per_episode_config_and_constructor_validate_world_name_pool_and_sft_questions():
    from entr_megatron.config.task import SearchTaskConfig
    from entr_megatron.config.validate import FieldError

    assert SearchTaskConfig().world == "fixed" and SearchTaskConfig().name_pool is None
    with pytest.raises(FieldError, match=r"task\.search\.world='mixed'.*fixed, per_episode"):
        SearchTaskConfig(world="mixed")
    with pytest.raises(FieldError, match=r"task\.search\.sft_questions=10 is not valid with world='per_episode'"):
        SearchTaskConfig(world="per_episode", sft_questions=10)
    with pytest.raises(FieldError, match=r"task\.search\.name_pool=24 is not valid with world='fixed'"):
        SearchTaskConfig(name_pool=24)
    with pytest.raises(FieldError, match=r"task\.search\.name_pool=4 .*\[8, 2000\]"):
        SearchTaskConfig(world="per_episode", num_entities=8, name_pool=4)
    with pytest.raises(ValueError, match="world must be one of"):
        SearchTask(world="mixed")
    with pytest.raises(ValueError, match="sft_questions"):
        SearchTask(num_entities=8, world="per_episode", sft_questions=5)
    with pytest.raises(ValueError, match="name_pool"):
        SearchTask(num_entities=8, name_pool=24)
    with pytest.raises(ValueError, match="name_pool"):
        SearchTask(num_entities=12, world="per_episode", name_pool=10)
    assert SearchTask(num_entities=8, world="per_episode").corpus is None

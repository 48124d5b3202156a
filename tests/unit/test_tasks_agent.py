"""Calculator tool and the multi-turn agent loop, driven by a scripted fake RolloutEngine."""

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from entr_megatron.rollout.engine import RolloutEngine, SamplingParams  # noqa: E402
from entr_megatron.rollout.episode_batch import Episode, run_episodes  # noqa: E402
from entr_megatron.tasks import (  # noqa: E402
    OBSERVATION_LOGPROB, CalculatorError, CalculatorTask, Environment, safe_eval,
)

from controller_fakes import ScriptedEngine  # noqa: E402


@pytest.mark.parametrize("expr, value", [
    ("12*7", "84"), ("7/2", "3.5"), ("8/2", "4"), ("2**10", "1024"), ("2^10", "1024"), ("-(3+4)*2", "-14"),
    ("17//5", "3"), ("17%5", "2"), ("0.1+0.2", "0.3"), ("1/3", "0.3333333333"), (" ( 1 + 2 ) ", "3"),
    ("2**-2", "0.25"),
])
def test_safe_eval_values(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "Call"), ("x+1", "Name"), ("abs(-3)", "Call"), ("(1).real", "Attribute"),
    ("'a'*3", "Constant"), ("[1, 2]", "List"), ("1 if 1 else 2", "IfExp"), ("1 < 2", "Compare"),
    ("lambda: 1", "Lambda"), ("True+1", "Constant"), ("2**10000", "digits"), ("9**9**9", "digits"),
    ("10**99*10**99", "digits"), ("1/0", "division by zero"), ("0**-1", "division by zero"), ("2**0.5", "integer"),
    ("1+", "not an arithmetic"), ("1" * 300, "longer"), ("1e400", "non-finite"),
])
def test_safe_eval_refuses(expr, why):
    with pytest.raises(CalculatorError, match=why):
        safe_eval(expr)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_agent_loop_masks_tool_output_and_aligns_logprobs_and_versions(tok):
    task = CalculatorTask(digits=2, tokenizer=tok)
    eos = tok.eos_token_id
    p1, p2 = tok.encode("12*7+3="), tok.encode("5*5+1=")
    scripts = [
        # Episode 1: a call, then the answer (and junk the engine must cut at EOS).
        (p1, [enc(tok, "<calc>12*7+3</calc>99"), enc(tok, "87") + [eos] + enc(tok, "11")]),
        # Episode 2: a bad call, a good call, then a wrong answer.
        (p2, [enc(tok, "<calc>5*x</calc>"), enc(tok, "<calc>5*5+1</calc>"), enc(tok, "25") + [eos]]),
    ]
    engine = ScriptedEngine(scripts, eos)
    assert isinstance(engine, RolloutEngine)
    env = task.new_environment()
    assert isinstance(env, Environment)
    episodes = [Episode(task.new_environment(), p1, "87", group_id=3), Episode(task.new_environment(), p2, "26")]
    s1, s2 = run_episodes(engine, episodes, SamplingParams(temperature=1.0, max_new_tokens=16), max_turns=4)

    obs1 = enc(tok, "<result>87</result>")
    turn1, turn2 = enc(tok, "<calc>12*7+3</calc>"), enc(tok, "87") + [eos]
    assert s1.prompt_ids == p1 and s1.response_ids == turn1 + obs1 + turn2
    assert s1.loss_mask == [True] * len(turn1) + [False] * len(obs1) + [True] * len(turn2)
    assert s1.reward == 1.0 and task.reward(s1, "87") == 1.0 and s1.group_id == 3 and s1.finish_reason == "stop"
    # Policy positions carry the engine's numbers verbatim; observation positions the documented fillers.
    policy_lp = [lp for lp, m in zip(s1.behaviour_logprobs, s1.loss_mask) if m]
    assert all(lp < 0 for lp in policy_lp) and len(set(policy_lp)) == len(policy_lp)
    for lp, v, h, m in zip(s1.behaviour_logprobs, s1.versions, s1.rollout_entropy, s1.loss_mask):
        if not m:
            assert lp == OBSERVATION_LOGPROB and h == 0.0
    first_v, second_v = s1.versions[0], s1.versions[-1]
    assert s1.versions == [first_v] * (len(turn1) + len(obs1)) + [second_v] * len(turn2) and second_v > first_v

    obs_err, obs_ok = enc(tok, "<result>error</result>"), enc(tok, "<result>26</result>")
    t1, t2, t3 = enc(tok, "<calc>5*x</calc>"), enc(tok, "<calc>5*5+1</calc>"), enc(tok, "25") + [eos]
    assert s2.response_ids == t1 + obs_err + t2 + obs_ok + t3
    assert s2.loss_mask == [True] * len(t1) + [False] * len(obs_err) + [True] * len(t2) + [False] * len(obs_ok) + [
        True] * len(t3)
    assert s2.reward == 0.0 and task.reward(s2, "26") == 0.0 and task.reward(s2, "25") == 1.0

    # Every turn's request: the whole history as prompt, the tool-call end as a stop token.
    close = enc(tok, "</calc>")[0]
    assert all(close in r.params.stop_token_ids and r.params.n == 1 for r in engine.requests)
    last = [r for r in engine.requests if r.prompt_ids[: len(p2)] == p2][-1]
    assert last.prompt_ids == p2 + t1 + obs_err + t2 + obs_ok


def test_agent_loop_stops_at_max_turns_and_token_budget(tok):
    task = CalculatorTask(digits=2, tokenizer=tok)
    eos = tok.eos_token_id
    p = tok.encode("1*1+1=")
    call = enc(tok, "<calc>1*1+1</calc>")
    engine = ScriptedEngine([(p, [call, call, call])], eos)
    (s,) = run_episodes(engine, [Episode(task.new_environment(), p, "2")], SamplingParams(), max_turns=2)
    obs = enc(tok, "<result>2</result>")
    assert s.response_ids == call + obs + call  # the last call is not executed
    assert s.finish_reason == "length" and s.reward == 0.0 and sum(not m for m in s.loss_mask) == len(obs)

    engine = ScriptedEngine([(p, [call, call])], eos)
    budget = len(call) + 3  # no room for the observation
    (s,) = run_episodes(engine, [Episode(task.new_environment(), p, "2")], SamplingParams(),
                        max_turns=4, max_response_tokens=budget)
    assert s.response_ids == call and s.finish_reason == "length" and all(s.loss_mask)

    with pytest.raises(ValueError, match="n == 1"):
        run_episodes(engine, [], SamplingParams(n=2))


def test_calculator_needs_single_token_markers():
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<unk>", "</s>", "<", ">", "/", "c", "a", "l"])}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    plain = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    with pytest.raises(ValueError, match="add_tokens"):
        CalculatorTask(tokenizer=plain)


def test_calculator_task_prompts(tok):
    task = CalculatorTask(digits=3, tokenizer=tok)
    train = {t for s in range(3) for t, _ in task.problems("train", 200, s)}
    test = {t for s in range(3) for t, _ in task.problems("test", 200, s)}
    assert not train & test and task.prompts("test", 5, 1) == task.prompts("test", 5, 1)
    for text, answer in task.problems("train", 20, 0):
        assert safe_eval(text[:-1]) == answer
    with pytest.raises(ValueError, match="too few"):
        CalculatorTask(digits=1, tokenizer=tok).problems("test", 900, 0)

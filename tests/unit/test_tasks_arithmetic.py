"""Synthetic arithmetic task: character tokenizer, model config, splits, exact-match reward, registry."""

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from entr_megatron.tasks import (  # noqa: E402
    TASKS, ArithmeticTask, CalculatorTask, CopyTask, CountdownTask, MathTask, make_task, write_tiny_model_config,
)
from entr_megatron.types import Sample  # noqa: E402


@pytest.fixture(scope="module")
def task(tok):
    return ArithmeticTask(digits=2, tokenizer=tok)


def test_tokenizer_round_trip_and_autotokenizer_load(tok, tmp_path):
    text = "12+34=<calc>3*4</calc><result>12</result> ok"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok.encode("<calc>", add_special_tokens=False)) == 1
    write_tiny_model_config(str(tmp_path), tok, hidden_size=64, num_layers=2)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        assert (tmp_path / f).exists(), f
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.encode(text) == ids and len(loaded) == len(tok)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert config.model_type == "qwen3" and config.vocab_size == len(tok) and config.eos_token_id == tok.eos_token_id


def test_model_config_is_readable_by_the_model_registry(tok, tmp_path):
    from entr_megatron.models import model_spec

    for model_type in ("qwen3", "llama"):
        write_tiny_model_config(str(tmp_path / model_type), tok, model_type=model_type, hidden_size=64)
        spec = model_spec(transformers.AutoConfig.from_pretrained(str(tmp_path / model_type)))
        assert spec.vocab_size == len(tok) and spec.hidden_size == 64
    with pytest.raises(ValueError, match="model_type"):
        write_tiny_model_config(str(tmp_path / "x"), tok, model_type="gpt2")


def test_splits_are_disjoint_and_deterministic(tok):
    for digits in (2, 4):  # 4 digits: the rejection-sampling path
        t = ArithmeticTask(digits=digits, ops=("+", "-", "*"), tokenizer=tok)
        train = {p.text for s in range(3) for p in t.problems("train", 300, seed=s)}
        test = {p.text for s in range(3) for p in t.problems("test", 300, seed=s)}
        assert not train & test
        assert t.problems("train", 50, seed=7) == t.problems("train", 50, seed=7)
        assert t.problems("train", 50, seed=7) != t.problems("train", 50, seed=8)
        assert len({p.text for p in t.problems("test", 100, seed=0)}) == 100  # distinct within a draw
    assert all(eval(p.text[:-1]) == int(p.answer) for p in t.problems("train", 100, 0))  # noqa: S307 (test oracle)
    other = ArithmeticTask(digits=2, split_seed=1, tokenizer=tok)
    assert {p.text for p in other.problems("test", 200, 0)} != {p.text for p in ArithmeticTask(
        digits=2, tokenizer=tok).problems("test", 200, 0)}
    with pytest.raises(ValueError, match="split"):
        t.prompts("valid", 1, 0)


def test_prompt_ids_and_sft_targets(task, tok):
    (ids, ref), = task.prompts("train", 1, seed=3)
    text = tok.decode(ids, skip_special_tokens=True)
    assert ids[0] == tok.bos_token_id and text.endswith("=") and str(eval(text[:-1])) == ref  # noqa: S307
    (p, target), = task.sft_examples("train", 1, seed=3)
    assert p == ids and target[-1] == tok.eos_token_id and tok.decode(target[:-1]) == ref


def _sample(tok, prompt, response_text, eos=True, junk=""):
    ids = tok.encode(response_text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    ids += tok.encode(junk, add_special_tokens=False)
    return Sample(prompt_ids=prompt, response_ids=ids, behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids))


def test_reward_exact_match_robust_to_junk_after_eos(task, tok):
    prompt = tok.encode("12+34=")
    assert task.reward(_sample(tok, prompt, "46"), "46") == 1.0
    assert task.reward(_sample(tok, prompt, "46", junk="99+1=<calc>"), "46") == 1.0
    assert task.reward(_sample(tok, prompt, " 46 "), "46") == 1.0
    assert task.reward(_sample(tok, prompt, "47"), "46") == 0.0
    assert task.reward(_sample(tok, prompt, "460"), "46") == 0.0
    assert task.reward(_sample(tok, prompt, "46", eos=False), "46") == 0.0  # never finished
    assert task.reward(_sample(tok, prompt, "4x6"), "46") == 0.0
    assert task.reward(_sample(tok, prompt, "", eos=True), "46") == 0.0
    fmt = ArithmeticTask(digits=2, format_reward=0.1, tokenizer=tok)
    assert fmt.reward(_sample(tok, prompt, "47"), "46") == 0.1
    assert fmt.reward(_sample(tok, prompt, "4x"), "46") == 0.0
    assert fmt.reward(_sample(tok, prompt, "46"), "46") == 1.0


def test_reverse_answer_and_validation(tok):
    t = ArithmeticTask(digits=2, reverse_answer=True, tokenizer=tok)
    for p in t.problems("train", 20, 0):
        assert int(p.answer[::-1]) == eval(p.text[:-1])  # noqa: S307
    for kwargs, field in [({"digits": 0}, "digits"), ({"ops": ("/",)}, "ops"), ({"test_fraction": 1.0}, "test_fraction")]:
        with pytest.raises(ValueError, match=field):
            ArithmeticTask(tokenizer=tok, **kwargs)


def test_registry(tok):
    assert TASKS == {"arithmetic": ArithmeticTask, "math": MathTask, "calculator": CalculatorTask,
                     "countdown": CountdownTask, "copy": CopyTask}
    t = make_task("arithmetic", digits=1, tokenizer=tok)
    assert isinstance(t, ArithmeticTask) and t.new_environment() is None
    assert len(t.prompts("train", 5, 0)) == 5
    with pytest.raises(ValueError, match="arithmetic"):
        make_task("chess")


def test_pad_operands_fixes_digit_positions(tok):
    t = ArithmeticTask(digits=3, ops=("+",), reverse_answer=True, pad_operands=True, tokenizer=tok)
    problems = t.problems("train", 300, seed=0)
    assert all(len(p.text) == 8 and p.text[3] == "+" and p.text.endswith("=") for p in problems)
    for p in problems:  # "007+450=" -> 457 reversed
        a, b = int(p.text[:3]), int(p.text[4:7])
        assert p.answer == str(a + b)[::-1]
    assert any(p.text.startswith("0") for p in problems)


@pytest.mark.parametrize("kwargs, message", [
    ({"test_fraction": 0.0}, "test_fraction must be in (0, 1), got 0.0"),
    ({"test_fraction": True}, "test_fraction must be in (0, 1), got True"),
    ({"format_reward": 1.0}, "format_reward must be in [0, 1), got 1.0"),
])
def test_every_task_checks_its_fractions_alike(kwargs, message):
    """tasks.base.check_fractions: arithmetic, countdown, calculator (no format reward) and search."""
    from entr_megatron.tasks.arithmetic import ArithmeticTask
    from entr_megatron.tasks.calculator import CalculatorTask
    from entr_megatron.tasks.countdown import CountdownTask
    from entr_megatron.tasks.search import SearchTask

    classes = [ArithmeticTask, CountdownTask] + ([] if "format_reward" in kwargs else [CalculatorTask, SearchTask])
    for cls in classes:
        with pytest.raises(ValueError) as e:
            cls(**kwargs)
        assert str(e.value) == message, (cls.__name__, e.value)

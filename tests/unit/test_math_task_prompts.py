"""The math task's prompts: model.max_prompt_len applied (long problems skipped and counted), the
held-out split cut from the training files, and a config derived from the CPU demo that fits.

Lengths are counted by hand: the character tokenizer gives one token per character (unknown
ones become <unk>, still one token) plus <s> in front."""

import dataclasses
import json
import logging
import random
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from entr_megatron.config.loader import load_config  # noqa: E402
from entr_megatron.controller.job.model_init import build_task, tokenizer_for  # noqa: E402
from entr_megatron.tasks import MathTask, build_char_tokenizer, save_char_tokenizer  # noqa: E402
from entr_megatron.tasks.base import stable_hash  # noqa: E402
from entr_megatron.tasks.math_data import BOXED_TEMPLATE, DEFAULT_TEMPLATE  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
BOXED_OVERHEAD = 1 + len("\n") + len("Put your final answer within ") + len("\\boxed{}") + len(".")
"""<s> + 1 + 29 + 8 + 1 = 40 tokens of BOXED_TEMPLATE around the problem."""


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _jsonl(path, problems):
    path.write_text("".join(json.dumps({"problem": p, "answer": str(len(p))}) + "\n" for p in problems))
    return str(path)


def _demo_math(tmp_path, problems, *extra):
    tok_dir = tmp_path / "tok"
    save_char_tokenizer(build_char_tokenizer(), str(tok_dir))
    train = _jsonl(tmp_path / "train.jsonl", problems)
    cfg = load_config(DEMO, ["task.name=math", f"task.math.train_files=[{train}]", f"model.tokenizer={tok_dir}",
                             *extra])
    return cfg, build_task(cfg, tokenizer_for(cfg))


def test_long_prompts_are_skipped_counted_and_reported_once(tmp_path, tok, caplog):
    # problem k is k ones: its prompt is k + 1 tokens; limit 10 keeps k = 1..9 and skips 10..30
    train = _jsonl(tmp_path / "t.jsonl", ["1" * k for k in range(1, 31)])
    test = _jsonl(tmp_path / "e.jsonl", ["2" * k for k in (3, 12, 14)])
    with caplog.at_level(logging.WARNING, logger="entr_megatron.tasks.math_data"):
        task = MathTask(tok, {"train": train, "test": test}, max_prompt_len=10, reward_backend="normalise")
    assert task.skipped_too_long == 21 + 2
    assert [r.getMessage() for r in caplog.records] == [
        "math task: skipped 23 of 33 problems whose prompt is longer than model.max_prompt_len=10 tokens "
        "(the longest: 31 tokens)"]
    assert sorted(p.problem for p in task.problems_by_split["train"]) == ["1" * k for k in range(1, 10)]
    assert [p.problem for p in task.problems_by_split["test"]] == ["222"]
    for ids, ref in task.prompts("train", 50, seed=3):
        assert len(ids) == int(ref) + 1 <= 10


def test_no_limit_keeps_everything_silently(tmp_path, tok, caplog):
    train = _jsonl(tmp_path / "t.jsonl", ["1" * k for k in range(1, 31)])
    with caplog.at_level(logging.WARNING):
        task = MathTask(tok, {"train": train}, reward_backend="normalise")
    assert task.skipped_too_long == 0 and len(task.problems_by_split["train"]) == 30 and not caplog.records


def test_every_prompt_too_long_names_the_limit_and_the_shortest(tmp_path, tok):
    train = _jsonl(tmp_path / "t.jsonl", ["1" * k for k in (12, 9, 30)])
    with pytest.raises(ValueError) as e:
        MathTask(tok, {"train": train}, max_prompt_len=8, reward_backend="normalise")
    assert str(e.value) == (
        f"model.max_prompt_len=8: every one of the 3 problems of {train} has a longer prompt; the shortest is "
        f"10 tokens (problem and prompt template): raise model.max_prompt_len (and model.max_seq_len to cover it "
        f"plus rollout.sampling.max_new_tokens) or use shorter problems")


def test_prompts_are_the_documented_draws_and_batched_encoding_is_encode(tmp_path, tok):
    problems = [f"{i}*{i % 7}" for i in range(40)]
    task = MathTask(tok, {"train": _jsonl(tmp_path / "t.jsonl", problems)}, prompt_template="q {problem}=",
                    reward_backend="normalise")
    assert task.encode_prompts(problems[:5]) == [tok.encode(f"q {p}=") for p in problems[:5]]
    # the same draws as before the prompt ids were cached: random.Random("train:seed") over the file order
    expected = random.Random("train:7").sample(problems, 6)
    assert task.prompts("train", 6, seed=7) == [(tok.encode(f"q {p}="), str(len(p))) for p in expected]


def test_held_out_split_from_the_training_files(tmp_path, tok):
    problems = [f"{i}+{i % 5}" for i in range(50)] + ["3+3", "3+3"]
    n = 8
    salted = sorted(set(problems), key=lambda t: (stable_hash(f"math-held-out:{t}"), t))  # the documented rule
    held = set(salted[:n])
    path = _jsonl(tmp_path / "a.jsonl", problems)
    task = MathTask(tok, {"train": path}, held_out=n, reward_backend="normalise")
    test = [p.problem for p in task.problems_by_split["test"]]
    train = [p.problem for p in task.problems_by_split["train"]]
    assert set(test) == held and len(test) == n
    assert not set(train) & held and set(train) | held == set(problems)
    assert len(train) == len(problems) - sum(p in held for p in problems)  # every copy of a held-out one left
    shuffled = random.Random(0).sample(problems, len(problems))
    again = MathTask(tok, {"train": _jsonl(tmp_path / "b.jsonl", shuffled)}, held_out=n, reward_backend="normalise")
    assert {p.problem for p in again.problems_by_split["test"]} == held  # independent of the file order
    assert {tok.decode(ids, skip_special_tokens=True) for ids, _ in task.prompts("test", n, seed=0)} == held


def test_held_out_problems_all_fit_after_skipping(tmp_path, tok):
    problems = ["1" * k for k in range(1, 41)]
    task = MathTask(tok, {"train": _jsonl(tmp_path / "a.jsonl", problems)}, held_out=5, max_prompt_len=20,
                    reward_backend="normalise")
    assert task.skipped_too_long == 21 and len(task.problems_by_split["test"]) == 5
    assert len(task.problems_by_split["train"]) == 19 - 5
    assert all(len(ids) <= 20 for ids, _ in task.prompts("test", 5, seed=0))
    with pytest.raises(ValueError, match=r"task\.eval_size=19 problems cannot be held out of task\.math\.train_files "
                                         r"\(.*a\.jsonl\) after skipping long prompts: they hold 19 distinct"):
        MathTask(tok, {"train": str(tmp_path / "a.jsonl")}, held_out=19, max_prompt_len=20)


def test_math_from_the_demo_config_fits_and_needs_no_eval_files(tmp_path):
    problems = [f"{a}+{b}" for a in range(40) for b in range(0, 100, 9)]  # 480 problems of 3-5 characters
    cfg, task = _demo_math(tmp_path, problems)
    assert DEFAULT_TEMPLATE == "{problem}" == cfg.task.math.prompt_template
    assert cfg.task.eval_size == 200 and not cfg.task.math.eval_files  # the demo's held-out size, no eval files
    assert task.skipped_too_long == 0 and len(task.problems_by_split["test"]) == 200
    budget = cfg.model.max_seq_len - cfg.rollout.sampling.max_new_tokens
    for split, n in (("train", 240), ("test", 200)):
        for ids, ref in task.prompts(split, n, seed=1):
            text = task.tokenizer.decode(ids, skip_special_tokens=True)
            assert len(ids) == 1 + len(text) <= cfg.model.max_prompt_len <= budget
            assert ref == str(len(text))


def test_demo_config_with_eval_size_zero_has_no_test_split(tmp_path):
    cfg, task = _demo_math(tmp_path, ["1+1", "2+2", "3+3"], "task.eval_size=0")
    assert sorted(task.problems_by_split) == ["train"] and len(task.problems_by_split["train"]) == 3
    with pytest.raises(ValueError, match=r"no 'test' split: set task\.math\.eval_files, or a task\.eval_size > 0"):
        task.prompts("test", 1, seed=0)


def test_boxed_template_does_not_fit_the_demo(tmp_path):
    assert BOXED_OVERHEAD == 40
    cfg, _ = _demo_math(tmp_path, ["1+1"], "task.eval_size=0")
    math = dataclasses.replace(cfg.task.math, prompt_template=BOXED_TEMPLATE)
    long_cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, math=math))
    with pytest.raises(ValueError, match=rf"model\.max_prompt_len=24: every one of the 1 problems of .* the "
                                         rf"shortest is {BOXED_OVERHEAD + 3} tokens"):
        build_task(long_cfg, tokenizer_for(long_cfg))


def test_arithmetic_refuses_a_limit_its_prompts_exceed(tok):
    # "99+99=" is 6 characters, 7 tokens with <s>
    cfg = load_config(None, ["model.max_prompt_len=6", "task.arithmetic.digits=2"])
    with pytest.raises(ValueError) as e:
        build_task(cfg, tok)
    assert str(e.value) == ("model.max_prompt_len=6 is shorter than the longest arithmetic prompt (7 tokens "
                            "with task.arithmetic.digits=2); raise it")
    assert build_task(load_config(None, ["model.max_prompt_len=7"]), tok).digits == 2

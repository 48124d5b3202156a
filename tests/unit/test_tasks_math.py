"""Math problems from JSONL/Parquet: loader errors, math-verify and fallback rewards."""

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from entr_megatron.tasks import MathTask, build_char_tokenizer, load_problems  # noqa: E402
from entr_megatron.tasks.math_reward import (  # noqa: E402
    extract_boxed, math_verify_available, math_verify_reward, normalised_match_reward,
)
from entr_megatron.types import Sample  # noqa: E402


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_loader_reads_both_field_names(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [
        {"prompt": "1+1?", "answer": "2"}, "", {"problem": "half?", "solution": "It is $\\boxed{\\frac12}$."},
        {"problem": "n?", "answer": 7},
    ])
    problems = load_problems(path)
    assert [(p.problem, p.answer) for p in problems] == [
        ("1+1?", "2"), ("half?", "It is $\\boxed{\\frac12}$."), ("n?", "7")]
    assert problems[1].source == f"{path}:3"


@pytest.mark.parametrize("rows, expected", [
    ([{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}], r"b\.jsonl:2: missing field 'prompt' \(or 'problem'\)"),
    ([{"prompt": "a"}], r"b\.jsonl:1: missing field 'answer' \(or 'solution'\); fields present: \['prompt'\]"),
    ([{"prompt": "a", "answer": "1"}, "{not json"], r"b\.jsonl:2: not valid JSON"),
    (["[1, 2]"], r"b\.jsonl:1: expected a JSON object"),
    ([{"prompt": "a", "answer": ["1"]}], r"b\.jsonl:1: field for the answer must be a string or number"),
])
def test_jsonl_loader_errors_name_file_line_and_field(tmp_path, rows, expected):
    with pytest.raises(ValueError, match=expected):
        load_problems(_jsonl(tmp_path / "b.jsonl", rows))


def test_loader_rejects_missing_unknown_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_problems(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        load_problems(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="no problems"):
        load_problems(_jsonl(tmp_path / "e.jsonl", [""]))


def test_parquet_loader_and_its_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "answer": ["2", "4"]}), str(good))
    assert [p.answer for p in load_problems(str(good))] == ["2", "4"]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "answer": ["2", None]}), str(bad))
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: missing field 'answer'"):
        load_problems(str(bad))


@pytest.mark.parametrize("response, reference, expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("We get $\\boxed{2\\sqrt{2}}$.", "\\sqrt{8}", 1.0),
    ("\\boxed{x = 3}", "The solution ... $\\boxed{3}$", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("I don't know", "4", 0.0),
])
def test_math_verify_reward(response, reference, expected):
    if not math_verify_available():
        pytest.skip("math-verify is not installed (the 'math' extra)")
    assert math_verify_reward(response, reference) == expected


def test_math_verify_reward_off_the_main_thread():
    if not math_verify_available():
        pytest.skip("math-verify is not installed (the 'math' extra)")
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(math_verify_reward("\\boxed{\\frac{3}{4}}", "0.75")))
    t.start()
    t.join(timeout=30)
    assert out == [1.0]


@pytest.mark.parametrize("response, reference, expected", [
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\dfrac12}", "0.5", 1.0),
    ("the answer is 1,000.", "1000", 1.0),
    ("\\boxed{\\text{ 5 }}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 0.0),  # documented weakness: equivalent forms missed
    ("no answer", "4", 0.0),
])
def test_fallback_normaliser(response, reference, expected):
    assert normalised_match_reward(response, reference) == expected


def test_extract_boxed_nested():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{") is None and extract_boxed("none") is None


def test_math_task_prompts_and_reward(tmp_path):
    tok = build_char_tokenizer()
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(10)])
    test = _jsonl(tmp_path / "test.jsonl", [{"problem": "2*3", "answer": "6"}])
    task = MathTask(tok, {"train": train, "test": [test]}, prompt_template="{problem}=", reward_backend="normalise")
    pairs = task.prompts("train", 4, seed=1)
    assert pairs == task.prompts("train", 4, seed=1) and len({r for _, r in pairs}) == 4
    (ids, ref), = task.prompts("test", 1, seed=0)
    assert tok.decode(ids, skip_special_tokens=True) == "2*3=" and ref == "6"
    resp = tok.encode("6", add_special_tokens=False) + [tok.eos_token_id] + tok.encode("7", add_special_tokens=False)
    sample = Sample(prompt_ids=ids, response_ids=resp, behaviour_logprobs=[0.0] * 3, versions=[0] * 3)
    assert task.reward(sample, ref) == 1.0 and task.reward(sample, "7") == 0.0
    with pytest.raises(ValueError, match="train"):
        MathTask(tok, {"test": [test]})
    with pytest.raises(ValueError, match="reward_backend"):
        MathTask(tok, {"train": train}, reward_backend="sympy")
    if math_verify_available():
        assert MathTask(tok, {"train": train}).reward_backend == "math_verify"


def test_missing_math_verify_names_the_extra(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import now fails
    with pytest.raises(ImportError, match=r"entr-megatron\[math\]"):
        math_verify_reward("\\boxed{1}", "1")
    train = _jsonl(tmp_path / "t.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(ImportError, match="math-verify"):
        MathTask(build_char_tokenizer(), {"train": train}, reward_backend="math_verify")
    assert MathTask(build_char_tokenizer(), {"train": train}).reward_backend == "normalise"

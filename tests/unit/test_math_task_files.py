"""Math data files: every bad file stops the task when it is built (and `check_task_files` before),
with the file, the line/item/row and what is expected."""

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from entr_megatron.config.loader import load_config  # noqa: E402
from entr_megatron.config.task import MathTaskConfig, TaskConfig  # noqa: E402
from entr_megatron.controller.job.model_init import build_task  # noqa: E402
from entr_megatron.tasks import (  # noqa: E402
    build_char_tokenizer, check_task_files, load_problems, save_char_tokenizer,
)

EXPECTED = "records with a problem field 'prompt' (or 'problem') and an answer field 'answer' (or 'solution')"
"""What the loader's messages say a file must hold, with the default field names."""


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _message(fn, *args, **kwargs):
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def _math_cfg(train, eval_files=(), eval_size=0):
    return TaskConfig(name="math", eval_size=eval_size,
                      math=MathTaskConfig(train_files=tuple(train), eval_files=tuple(eval_files)))


def test_non_utf8_line_names_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"problem": "1+1", "answer": "2"}).encode()
    bad = '{"problem": "caf\u00e9", "answer": "1"}'.encode("latin-1")  # é is byte 0xe9, the 17th
    path.write_bytes(good + b"\n" + bad + b"\n")
    assert bad.index(b"\xe9") == 16
    assert _message(load_problems, str(path)) == (
        f"{path}:2: not UTF-8 text (byte 0xe9 at column 17); math data files must be UTF-8 JSONL/JSON "
        f"({EXPECTED}) or Parquet")


def test_utf8_with_bom_and_non_ascii_text_load(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"problem": "\u03c0 r^2?", "answer": "x"}, ensure_ascii=False)
                     .encode() + b"\n")
    [p] = load_problems(str(path))
    assert (p.problem, p.answer, p.source) == ("\u03c0 r^2?", "x", f"{path}:1")


def test_missing_directory_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert _message(load_problems, str(missing)) == (
        f"math data file {str(missing)!r} does not exist; expected a .jsonl, .json or .parquet file of {EXPECTED}")
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    assert _message(load_problems, str(folder)) == (
        f"math data file {str(folder)!r} is a directory; expected a .jsonl, .json or .parquet file")
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n"), ("empty.json", "")):
        path = tmp_path / name
        path.write_text(text)
        assert _message(load_problems, str(path)) == (
            f"{path}: no problems in the file (it is empty or blank); expected {EXPECTED}")
    array = tmp_path / "array.json"
    array.write_text("[]")
    assert _message(load_problems, str(array)) == (
        f"{array}: no problems in the file (it is empty or blank); expected {EXPECTED}")


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, "", '{"problem": "b", "answer": 2'])
    # json: "Expecting ',' delimiter" at the end of the 28-character line 3 (column 29)
    assert _message(load_problems, path) == (
        f"{path}:3: not valid JSON (Expecting ',' delimiter at column 29); expected one JSON object a line, "
        f"{EXPECTED}")


def test_json_array_file_and_its_errors(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "solution": "\\boxed{4}"}],
                               indent=2))
    assert [(p.problem, p.answer, p.source) for p in load_problems(str(path))] == [
        ("1+1", "2", f"{path}: item 0"), ("2+2", "\\boxed{4}", f"{path}: item 1")]
    path.write_text('[\n  {"problem": "1+1", "answer": "2"},\n  {"problem": "x"}\n]\n')
    assert _message(load_problems, str(path)) == (
        f"{path}: item 1: missing field 'answer' (or 'solution'); fields present: ['problem']")
    path.write_text('[\n  {"problem": "1+1", "answer": "2"}\n  {"problem": "x"}\n]\n')
    assert _message(load_problems, str(path)) == (
        f"{path}:3: not valid JSON (Expecting ',' delimiter at column 3); expected a JSON array of objects "
        f"or one object a line, {EXPECTED}")
    lines = tmp_path / "lines.json"  # .json holding JSON lines is read as JSONL
    lines.write_text('{"problem": "1", "answer": "1"}\n{"problem": "2", "answer": "2"}\n')
    assert [p.source for p in load_problems(str(lines))] == [f"{lines}:1", f"{lines}:2"]


def test_configured_keys_are_tried_first_and_named_in_errors(tmp_path):
    path = _write(tmp_path / "q.jsonl", [{"question": "1+1", "problem": "ignored", "final": "2", "answer": "no"}])
    [p] = load_problems(path, prompt_key="question", answer_key="final")
    assert (p.problem, p.answer) == ("1+1", "2")
    path = _write(tmp_path / "q2.jsonl", [{"problem": "1+1", "answer": "2"}, {"prompt": "x", "answer": "1"}])
    assert [p.problem for p in load_problems(path, prompt_key="problem")] == ["1+1", "x"]
    path = _write(tmp_path / "q3.jsonl", [{"text": "1+1", "answer": "2"}])
    assert _message(load_problems, path, prompt_key="question") == (
        f"{path}:1: missing field 'question' (or 'prompt', 'problem'); fields present: ['answer', 'text']")


def test_parquet_unreadable_and_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    message = _message(load_problems, str(junk))
    assert message.startswith(f"{junk}: not a readable Parquet file (") and message.endswith(f"); expected {EXPECTED}")
    cols = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "answer": ["2"], "extra": [1]}), str(cols))
    assert _message(load_problems, str(cols)) == (
        f"{cols}: no column 'prompt' (or 'problem'); columns: ['question', 'answer', 'extra']")
    [p] = load_problems(str(cols), prompt_key="question")  # only the needed columns are read
    assert (p.problem, p.answer, p.source) == ("1+1", "2", f"{cols}: row 0")


def test_check_task_files_before_building_and_build_task_agree(tmp_path):
    good = _write(tmp_path / "good.jsonl", [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(5)])
    bad = _write(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b"}])
    expected = f"{bad}:2: missing field 'answer' (or 'solution'); fields present: ['problem']"
    check_task_files(_math_cfg([good]))
    check_task_files(TaskConfig())  # arithmetic: no files
    assert _message(check_task_files, _math_cfg([good], [bad])) == expected
    assert _message(check_task_files, _math_cfg([good, bad])) == expected
    tok_dir = tmp_path / "tok"
    save_char_tokenizer(build_char_tokenizer(), str(tok_dir))
    cfg = load_config(None, ["task.name=math", f"task.math.train_files=[{good}]", f"task.math.eval_files=[{bad}]",
                             f"model.tokenizer={tok_dir}"])
    assert _message(build_task, cfg, build_char_tokenizer()) == expected


def test_check_task_files_refuses_a_held_out_split_the_files_cannot_give(tmp_path):
    rows = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(5)] + [{"problem": "0+1", "answer": "1"}]
    path = _write(tmp_path / "few.jsonl", rows)  # 5 distinct problems (one twice)
    check_task_files(_math_cfg([path], eval_size=0))
    check_task_files(_math_cfg([path], eval_size=4))
    assert _message(check_task_files, _math_cfg([path], eval_size=5)) == (
        f"task.eval_size=5 problems cannot be held out of task.math.train_files ({path}): they hold 5 distinct "
        f"problems and at least one must stay for training; set task.eval_files (a held-out file), or "
        f"task.eval_size below 5 (0: no evaluation)")


def test_config_refuses_a_template_without_problem():
    for template in ("no field", "{question}", "{problem} {}", "{problem"):
        with pytest.raises(ValueError, match=r"task\.math\.prompt_template.*must contain \{problem\}"):
            MathTaskConfig(prompt_template=template)
    assert MathTaskConfig(prompt_template="Q: {problem} \\boxed{{}}").prompt_template == "Q: {problem} \\boxed{{}}"

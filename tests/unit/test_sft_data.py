"""SFT examples from JSONL: both line formats, errors naming file and line, deterministic epochs."""

import json

import pytest

from entr_megatron.controller.job.sft_data import load_sft_file_examples, read_sft_file


def write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_text_and_id_lines(tmp_path, tok):
    path = write(tmp_path / "a.jsonl", [{"prompt": "1+2=", "response": "3"}, "", {"input_ids": [1, 5], "output_ids": [7]}])
    (p0, r0), (p1, r1) = read_sft_file(path, tok)
    assert tok.decode(p0, skip_special_tokens=True) == "1+2=" and p0[0] == tok.bos_token_id
    assert r0 == [tok.convert_tokens_to_ids("3"), tok.eos_token_id]
    assert (p1, r1) == ([1, 5], [7])


@pytest.mark.parametrize("line, message", [
    ("{not json", r"a.jsonl:2: not valid JSON"),
    ('[1, 2]', r"a.jsonl:2: expected a JSON object"),
    ('{"prompt": "1+2="}', r"a.jsonl:2: needs string 'prompt' and 'response'.*got keys \['prompt'\]"),
    ('{"input_ids": [], "output_ids": [3]}', r'a.jsonl:2: "input_ids" must be a non-empty list of token ids'),
    ('{"input_ids": [1], "output_ids": [-3]}', r"a.jsonl:2: output_ids\[0\]=-3 is outside the model's vocabulary"),
])
def test_bad_lines_name_file_and_line(tmp_path, tok, line, message):
    path = write(tmp_path / "a.jsonl", [{"prompt": "1+1=", "response": "2"}, line])
    with pytest.raises(ValueError, match=message):
        read_sft_file(path, tok)


def test_missing_and_empty_files(tmp_path, tok):
    with pytest.raises(ValueError, match="cannot read"):
        read_sft_file(str(tmp_path / "nope.jsonl"), tok)
    with pytest.raises(ValueError, match="holds no examples"):
        read_sft_file(write(tmp_path / "e.jsonl", [""]), tok)


def test_batches_walk_each_epoch_once_and_repeat_exactly(tmp_path, tok):
    rows = [{"input_ids": [1, i], "output_ids": [i]} for i in range(10)]
    path = write(tmp_path / "b.jsonl", rows)
    epoch0 = [load_sft_file_examples([path], tok, 5, step, seed=3) for step in (0, 1)]
    seen = sorted(r[0] for batch in epoch0 for _, r in batch)
    assert seen == list(range(10))  # steps 0 and 1 cover the 10 examples exactly once
    assert load_sft_file_examples([path], tok, 5, 1, seed=3) == epoch0[1]  # same step, same examples
    epoch1 = [load_sft_file_examples([path], tok, 5, step, seed=3) for step in (2, 3)]
    assert sorted(r[0] for batch in epoch1 for _, r in batch) == list(range(10))
    assert epoch1 != epoch0  # a new permutation each epoch

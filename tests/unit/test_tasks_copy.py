"""The copy task: lines from the standard library's test suites only, prompts and SFT targets that
decode to the line, an exact-copy reward, disjoint splits, and refusals that name the field."""

from __future__ import annotations

import dataclasses

import pytest

from entr_megatron.config.task import CopyTaskConfig, TaskConfig
from entr_megatron.tasks import TASK_BUILDERS, CopyTask
from entr_megatron.tasks.bpe_tokenizer import stdlib_corpus_files, train_bpe_tokenizer
from entr_megatron.tasks.copy_lines import copy_source_lines
from entr_megatron.types import Sample


@pytest.fixture(scope="module")
def tok():
    picked = [f for f in stdlib_corpus_files() if f.name in ("textwrap.py", "shlex.py", "fractions.py")]
    return train_bpe_tokenizer(picked, vocab_size=1000)


LINES = [f"self.assertEqual(f({i}), {i * 7})" for i in range(40)] + [
    f"x_{i} = compute_value(alpha, beta)  # step {i}" for i in range(40)]


def test_source_lines_come_from_test_folders_only_stripped_deduplicated_and_ascii(tmp_path):
    (tmp_path / "test").mkdir()
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "test" / "test_a.py").write_text("    x = 1\n\nx = 1\n  print('caf\u00e9')\nassert f(2) == 3\n")
    (tmp_path / "pkg" / "tests" / "t.py").write_text("import os\n")
    (tmp_path / "pkg" / "tests" / "notes.txt").write_text("not python\n")
    (tmp_path / "mod.py").write_text("only in the pretraining corpus\n")
    assert copy_source_lines(tmp_path) == ["assert f(2) == 3", "import os", "x = 1"]
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "mod.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="no test-suite .py lines"):
        copy_source_lines(tmp_path / "bare")
    with pytest.raises(ValueError, match="is not a directory"):
        copy_source_lines(tmp_path / "missing")


def test_the_real_source_is_the_stdlib_test_suites():
    lines = copy_source_lines()
    assert len(lines) > 10_000 and lines == sorted(set(lines))
    assert all(line == line.strip() and line.isascii() for line in lines[:2000])


def test_prompt_and_target_decode_to_the_line(tok):
    task = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES)
    for (prompt, line), (sft_prompt, target) in zip(task.prompts("train", 8, 3), task.sft_examples("train", 8, 3)):
        assert prompt == sft_prompt and prompt[0] == tok.bos_token_id
        assert tok.decode(prompt, skip_special_tokens=True) == line + "\n"
        assert target[-1] == tok.eos_token_id and tok.decode(target[:-1]) == line
        assert target[:-1] == tok.encode(line, add_special_tokens=False)


def test_reward_is_one_for_an_exact_copy_ended_by_eos_only(tok):
    task = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES)
    (prompt, line), = task.prompts("test", 1, 0)
    ids = tok.encode(line, add_special_tokens=False)

    def reward(resp):
        return task.reward(Sample(prompt, resp, [0.0] * len(resp), [0] * len(resp)), line)

    eos = tok.eos_token_id
    assert reward(ids + [eos]) == 1.0
    assert reward(ids + [eos, ids[0]]) == 1.0                  # what follows EOS never counts
    assert reward(ids) == 0.0                                  # no EOS
    assert reward(ids[:-1] + [eos]) == 0.0                     # a token short
    other = next(t for t in range(4, len(tok)) if t != ids[2] and tok.decode([t]) != tok.decode([ids[2]]))
    assert reward(ids[:2] + [other] + ids[3:] + [eos]) == 0.0   # one token changed


def test_splits_are_disjoint_by_text_and_draws_are_pure(tok):
    task = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES)
    train = {line for _, line in task.prompts("train", 200, 0)}
    test = {line for _, line in task.prompts("test", 200, 0)}
    assert train and test and not train & test and train | test == set(LINES)
    assert task.prompts("test", 5, 7) == task.prompts("test", 5, 7)
    assert task.lines("train", 5, 1) != task.lines("train", 5, 2)
    drawn = task.lines("test", 3, 0)
    assert len(set(drawn)) == 3


def test_lines_are_kept_by_their_length_in_tokens(tok):
    lengths = {line: len(tok.encode(line, add_special_tokens=False)) for line in LINES}
    lo, hi = sorted(lengths.values())[len(LINES) // 4], sorted(lengths.values())[3 * len(LINES) // 4]
    task = CopyTask(tok, min_tokens=lo, max_tokens=hi, lines=LINES)
    kept = {line for split in ("train", "test") for line in task.lines(split, 500, 0)}
    assert kept == {line for line, n in lengths.items() if lo <= n <= hi}


def test_bad_arguments_and_configs_are_refused_naming_the_field(tok):
    with pytest.raises(ValueError, match="min_tokens"):
        CopyTask(tok, min_tokens=0, lines=LINES)
    with pytest.raises(ValueError, match=r"min_tokens \(30\) must be <= max_tokens \(20\)"):
        CopyTask(tok, min_tokens=30, max_tokens=20, lines=LINES)
    with pytest.raises(ValueError, match="widen task.copy.min_tokens/max_tokens"):
        CopyTask(tok, min_tokens=200, max_tokens=300, lines=LINES)
    with pytest.raises(ValueError, match="task.copy.max_tokens"):
        CopyTaskConfig(min_tokens=20, max_tokens=10)
    cfg = dataclasses.replace(TaskConfig(name="copy"), copy=CopyTaskConfig(min_tokens=4, max_tokens=30))
    with pytest.raises(ValueError, match="model.max_prompt_len=24 .* raise it to 32"):
        TASK_BUILDERS["copy"](cfg, tok, 24)


def _boundaries(tok, ids):
    """The character offsets where the tokens of `ids` end (ASCII lines: one character per byte)."""
    ends, at = set(), 0
    for t in ids:
        at += len(tok.decode([t]))
        ends.add(at)
    return ends


def test_sampled_tokenizations_cut_each_long_token_with_the_given_probability(tok):
    p = 0.3
    task = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES, sft_split_prob=p)
    canonical = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES)
    examples = task.sft_examples("train", 400, 5)
    assert examples == task.sft_examples("train", 400, 5) and examples != task.sft_examples("train", 400, 6)
    long_tokens = cut = 0
    for (prompt, target), (ref_prompt, ref_target) in zip(examples, canonical.sft_examples("train", 400, 5)):
        line = tok.decode(ref_target[:-1])
        assert prompt == ref_prompt and target[-1] == tok.eos_token_id and tok.decode(target[:-1]) == line
        ref_ends, ends = _boundaries(tok, ref_target[:-1]), _boundaries(tok, target[:-1])
        assert ref_ends <= ends                      # a cut falls inside a token, never across one
        start = 0
        for end in sorted(ref_ends):
            if end - start >= 2:                     # a token of two or more characters
                long_tokens += 1
                cut += any(start < b < end for b in ends)
            else:
                assert not any(start < b < end for b in ends)
            start = end
    assert long_tokens > 1000 and abs(cut / long_tokens - p) < 0.05   # binomial sd ~0.013
    # held-out answers and p = 0 keep the BPE's tokenization
    assert task.sft_examples("test", 50, 0) == canonical.sft_examples("test", 50, 0)
    zero = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES, sft_split_prob=0.0)
    assert zero.sft_examples("train", 50, 5) == canonical.sft_examples("train", 50, 5)


def test_sampled_tokenizations_score_as_the_line_and_are_configured(tok):
    task = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES, sft_split_prob=0.5)
    (prompt, target), = task.sft_examples("train", 1, 3)
    line = tok.decode(target[:-1])
    assert target[:-1] != tok.encode(line, add_special_tokens=False)
    assert task.reward(Sample(prompt, target, [0.0] * len(target), [0] * len(target)), line) == 1.0
    with pytest.raises(ValueError, match="sft_split_prob must be a number in \\[0, 0.5\\], got 0.6"):
        CopyTask(tok, lines=LINES, sft_split_prob=0.6)
    with pytest.raises(ValueError, match="task.copy.sft_split_prob"):
        CopyTaskConfig(sft_split_prob=-0.1)
    cfg = dataclasses.replace(TaskConfig(name="copy"),
                              copy=CopyTaskConfig(min_tokens=4, max_tokens=30, sft_split_prob=0.25))
    assert TASK_BUILDERS["copy"](cfg, tok, 32).sft_split_prob == 0.25


def test_max_token_id_keeps_exactly_the_lines_of_tokens_below_it(tok):
    ids = {line: tok.encode(line, add_special_tokens=False) for line in LINES}
    cap = sorted(max(v) for v in ids.values())[len(LINES) // 2]      # about half the lines are below it
    task = CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES, max_token_id=cap)
    kept = {line for split in ("train", "test") for line in task.lines(split, 500, 0)}
    assert kept == {line for line, v in ids.items() if max(v) < cap} and 0 < len(kept) < len(LINES)
    for prompt, target in task.sft_examples("train", 20, 1):
        assert max(prompt[1:-1]) < cap
    with pytest.raises(ValueError, match="max_token_id must be None or an int >= 1, got 0"):
        CopyTask(tok, lines=LINES, max_token_id=0)
    with pytest.raises(ValueError, match="with token ids below 5 .* raise task.copy.max_token_id"):
        CopyTask(tok, min_tokens=4, max_tokens=40, lines=LINES, max_token_id=5)
    with pytest.raises(ValueError, match="task.copy.max_token_id"):
        CopyTaskConfig(max_token_id=0)
    cfg = dataclasses.replace(TaskConfig(name="copy"),
                              copy=CopyTaskConfig(min_tokens=4, max_tokens=30, max_token_id=cap))
    assert TASK_BUILDERS["copy"](cfg, tok, 32).max_token_id == cap

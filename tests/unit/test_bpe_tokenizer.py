"""The long-tail testbed's byte-level BPE: exact size, specials where the character tokenizer has
them, lossless on any text, digits one by one, and a corpus that names what it was trained on."""

from __future__ import annotations

import pytest

from entr_megatron.tasks.bpe_tokenizer import (
    corpus_digest, stdlib_corpus_files, train_bpe_tokenizer,
)
from entr_megatron.tasks.char_tokenizer import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def small():
    files = stdlib_corpus_files()
    picked = [f for f in files if f.name in ("textwrap.py", "shlex.py", "fractions.py", "bisect.py")]
    return picked, train_bpe_tokenizer(picked, vocab_size=1200)


def test_the_stdlib_corpus_is_sorted_source_without_tests():
    files = stdlib_corpus_files()
    assert files == sorted(files) and len(files) > 300
    assert all(f.suffix == ".py" and "site-packages" not in f.parts and "test" not in f.parts for f in files)


def test_vocabulary_size_specials_and_bos(small):
    files, tok = small
    assert len(tok) == 1200
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    ids = tok.encode("x = 1")
    assert ids[0] == tok.bos_token_id and tok.eos_token_id == 2


def test_any_text_round_trips_and_numbers_go_digit_by_digit(small):
    _, tok = small
    for text in ["8+9=17:4 3 17,ans 24", "def f(self):\n    return 'é∑😀'\t\x00", "  leading and trailing  "]:
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    pieces = tok.convert_ids_to_tokens(tok.encode("1234", add_special_tokens=False))
    assert pieces == ["1", "2", "3", "4"]


def test_a_corpus_too_small_for_the_vocabulary_is_refused(small):
    files, _ = small
    with pytest.raises(ValueError, match="fewer than vocab_size=60000"):
        train_bpe_tokenizer(files[:1], vocab_size=60000)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 512"):
        train_bpe_tokenizer(files, vocab_size=100)


def test_the_digest_changes_with_the_bytes(small, tmp_path):
    files, _ = small
    a = tmp_path / "a.py"
    a.write_text("x = 1\n")
    b = tmp_path / "b.py"
    b.write_text("y = 2\n")
    before = corpus_digest([a, b])
    assert before == corpus_digest([a, b])
    b.write_text("y = 3\n")
    assert corpus_digest([a, b]) != before
    with pytest.raises(ValueError, match="not a directory"):
        stdlib_corpus_files(tmp_path / "missing")

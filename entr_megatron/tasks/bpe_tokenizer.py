"""A byte-level BPE tokenizer of a real size, trained locally on text every machine with Python has.

    files = stdlib_corpus_files()                      # Python's standard library, tests left out
    tok = train_bpe_tokenizer(files, vocab_size=32768) # transformers.PreTrainedTokenizerFast
    tok.save_pretrained("runs/lm_testbed/tokenizer")

The character tokenizer (`char_tokenizer.py`) has 58 entries: a model on it cannot put a long tail
of mass on rare tokens, which is the case ENTR exists for (docs/ENTR.md). This one has the size of a
production vocabulary (32k, as Llama-2 and Mistral; Qwen's is 151k) and is learned from about 14 MB
of Python source, comments and docstrings: identifiers, English, numbers and punctuation, so a model
trained on that text has a natural long tail. GPT-2's byte-level scheme: every byte string encodes
(no <unk>), digits, letters and punctuation are split apart before merging, and a space before a
word becomes part of its token. The special tokens are the character tokenizer's (<pad> <s> </s>
<unk>, ids 0-3); encoding adds <s> in front, as there.

The corpus is the files of `sysconfig.get_paths()["stdlib"]` in sorted order: the same bytes on
every machine with the same Python release (3.11.7 here); `corpus_digest` names them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from entr_megatron.tasks.char_tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, UNK

__all__ = ["MIN_VOCAB", "STDLIB_TEST_DIRS", "corpus_digest", "iter_corpus_texts", "stdlib_corpus_files",
           "stdlib_test_files", "train_bpe_tokenizer"]

MIN_VOCAB = 512
"""The smallest vocabulary asked for: the 256 bytes, the specials and room for merges."""
STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
"""The standard library's test-suite folders."""
_SKIPPED_DIRS = STDLIB_TEST_DIRS | {"site-packages", "__pycache__", "lib2to3"}
"""Left out of the corpus: test suites (generated data, long literals), third-party packages (they
differ between machines), caches, and lib2to3's grammar fixtures."""
_MAX_FILE_BYTES = 1 << 20
"""Files over 1 MiB are data (Unicode tables), not text."""


def stdlib_corpus_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The `.py` files under `root` (default: this interpreter's standard library), sorted, without
    test suites, site-packages and files over `_MAX_FILE_BYTES`."""
    base = _stdlib_root(root, "corpus root")
    out = _py_files(base, _SKIPPED_DIRS, in_tests=False)
    if not out:
        raise ValueError(f"corpus root {str(base)!r} holds no .py files")
    return out


def stdlib_test_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The `.py` files of the test suites (`STDLIB_TEST_DIRS`) under `root` that `stdlib_corpus_files`
    leaves out, sorted, without site-packages and files over `_MAX_FILE_BYTES` (possibly none)."""
    return _py_files(_stdlib_root(root, "test-suite root"), {"site-packages", "__pycache__"}, in_tests=True)


def _stdlib_root(root: str | os.PathLike | None, what: str) -> Path:
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"{what} {str(base)!r} is not a directory")
    return base


def _py_files(base: Path, skipped_dirs: set[str] | frozenset[str], in_tests: bool) -> list[Path]:
    """`.py` files of at most `_MAX_FILE_BYTES` under `base`, sorted, outside `skipped_dirs`; with
    `in_tests`, only those under a `STDLIB_TEST_DIRS` folder."""
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in skipped_dirs)
        if in_tests and not STDLIB_TEST_DIRS & set(Path(dirpath).relative_to(base).parts):
            continue
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and path.stat().st_size <= _MAX_FILE_BYTES:
                out.append(path)
    return sorted(out)


def iter_corpus_texts(files: Sequence[Path]) -> Iterator[str]:
    """Each file's text (undecodable bytes replaced: the BPE is byte-level, nothing is lost to it)."""
    for path in files:
        yield path.read_bytes().decode("utf-8", errors="replace")


def corpus_digest(files: Sequence[Path]) -> str:
    """SHA-256 over the files' relative names and bytes: two machines with the same digest trained
    their tokenizer and model on the same text."""
    h = hashlib.sha256()
    common = os.path.commonpath([str(p) for p in files]) if len(files) > 1 else str(Path(files[0]).parent)
    for path in files:
        h.update(os.path.relpath(path, common).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def train_bpe_tokenizer(files: Sequence[Path], vocab_size: int = 32768, min_frequency: int = 2) -> Any:
    """A byte-level BPE with exactly `vocab_size` entries (the 4 specials first), trained on `files`,
    as a `transformers.PreTrainedTokenizerFast` that adds <s> when encoding."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB}, got {vocab_size!r}")
    tok = tokenizers.Tokenizer(models.BPE())
    # GPT-2's split: letters, digits (each run of digits split to single digits below), punctuation
    # runs and spaces apart; digits one by one, so numbers are written digit by digit (as Llama's
    # and Qwen's tokenizers do) and every number of the tasks is in the vocabulary.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(iter_corpus_texts(files), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus gave {tok.get_vocab_size()} BPE entries, fewer than vocab_size={vocab_size}: "
                         "use a larger corpus or a smaller vocabulary")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False,
    )

"""Copy a line of Python: every response token is determined by the prompt.

    task = CopyTask(tokenizer, min_tokens=12, max_tokens=24)   # a BPE tokenizer (bpe_tokenizer.py)
    task.prompts("test", 4, seed=0)      # [(ids of "<s>{line}\\n", line), ...]
    task.sft_examples("train", 64, 0)    # [(prompt ids, ids of "{line}</s>"), ...]
    CopyTask(tokenizer, sft_split_prob=0.01).sft_examples("train", 64, 0)   # sampled tokenizations

The prompt is a line of source code and a newline; the answer is the same line, then EOS (reward 1
for an exact copy ended by EOS, else 0). The lines come from the test suites of Python's standard
library (`bpe_tokenizer.stdlib_test_files`: `test`, `tests`, `idle_test`), which the long-tail
testbed's LM did not see in pretraining (`bpe_tokenizer.stdlib_corpus_files` leaves them out): text
in the language the model learned, from files held out from it (a common line, such as `import os`,
also occurs in files it saw). Each line is stripped of its indentation and
kept when it is printable ASCII and encodes to `min_tokens`..`max_tokens` BPE tokens (with
`max_token_id`, only those whose every token id is below it: lines of common tokens, as the BPE
numbers its merges most frequent first); duplicates are dropped; a line's split (train / test) is
decided by its text (`base.split_of`).

With `sft_split_prob` p > 0 the training answers are written in sampled tokenizations: each token of
two or more characters is, with probability p, cut at a uniform character boundary and each part
encoded by the BPE (a part may itself take more than one token). The text, and so the reward, is
the same. This puts mass at a sure position on a few tokens (the prefixes of the token the model is
sure of), where the LM's own tail there is spread over many tokens under 1e-3
(docs/studies/lm_tail/README.md, attempts 17-21). Held-out answers keep the BPE's tokenization, so
the warm-up's expected accuracy is the probability of that one (a lower bound on the copy accuracy).

Why this task (docs/studies/lm_tail/README.md, attempt 17): ENTR's case is a rare token sampled at a
position where the model is sure. On countdown the sure positions are a third to a half of a
response and their tail had to be planted; here every position is sure once the model copies, and
the tail is the one the LM learned from text (identifiers, words and punctuation it would write
instead), not one written into the warm-up.
"""

from __future__ import annotations

import os
import random
from typing import Any

from entr_megatron.tasks.base import check_fractions, check_split, decode_response, split_of
from entr_megatron.tasks.bpe_tokenizer import STDLIB_TEST_DIRS, iter_corpus_texts, stdlib_test_files
from entr_megatron.types import Sample

__all__ = ["CopyTask", "copy_source_lines"]

def copy_source_lines(root: str | os.PathLike | None = None) -> list[str]:
    """The distinct stripped lines of the `.py` files in the test-suite folders under `root` (default:
    this interpreter's standard library), printable ASCII, in sorted order (the same list on every
    machine with the same Python release)."""
    texts = iter_corpus_texts(stdlib_test_files(root))
    lines = {line.strip() for text in texts for line in text.splitlines()}
    lines = {line for line in lines if line and line.isascii() and line.isprintable()}
    if not lines:
        where = root if root is not None else "the standard library"
        raise ValueError(f"no test-suite .py lines under {str(where)!r} (folders named {sorted(STDLIB_TEST_DIRS)})")
    return sorted(lines)


class CopyTask:
    """Copy the prompt's line (module docstring)."""

    name = "copy"

    def __init__(self, tokenizer: Any, *, min_tokens: int = 12, max_tokens: int = 24, test_fraction: float = 0.1,
                 split_seed: int = 0, lines: list[str] | None = None, sft_split_prob: float = 0.0,
                 max_token_id: int | None = None):
        """tokenizer: an HF tokenizer that adds BOS when encoding (the long-tail testbed's BPE);
        min_tokens..max_tokens: the lines kept, by their length in tokens (without BOS/EOS);
        test_fraction, split_seed: which lines are held out; lines: the candidate lines
        (default: `copy_source_lines()`); sft_split_prob: the training answers' sampled tokenizations
        (module docstring), in [0, 0.5]; max_token_id: keep only lines whose every token id is below it
        (None: no cap; the BPE numbers merges most frequent first, so a low cap keeps common tokens)."""
        for field, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 512:
                raise ValueError(f"{field} must be an int in [1, 512], got {value!r}")
        if min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
        if max_token_id is not None and (not isinstance(max_token_id, int) or isinstance(max_token_id, bool)
                                         or max_token_id < 1):
            raise ValueError(f"max_token_id must be None or an int >= 1, got {max_token_id!r}")
        check_fractions(test_fraction)
        if not isinstance(sft_split_prob, (int, float)) or isinstance(sft_split_prob, bool) \
                or not 0 <= sft_split_prob <= 0.5:
            raise ValueError(f"sft_split_prob must be a number in [0, 0.5], got {sft_split_prob!r}")
        self.sft_split_prob = float(sft_split_prob)
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ValueError("the copy task needs a tokenizer with an EOS token (the long-tail testbed's BPE: "
                             "model.path=runs/lm_testbed/lm)")
        self.tokenizer = tokenizer
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.test_fraction, self.split_seed = test_fraction, split_seed
        self.max_token_id = max_token_id
        candidates = copy_source_lines() if lines is None else list(lines)
        encoded = tokenizer(candidates, add_special_tokens=False)["input_ids"] if candidates else []
        self._ids: dict[str, list[int]] = {}
        self._pool: dict[str, list[str]] = {s: [] for s in ("train", "test")}
        for line, ids in zip(candidates, encoded):
            if max_token_id is not None and max(ids, default=0) >= max_token_id:
                continue
            if min_tokens <= len(ids) <= max_tokens and tokenizer.decode(ids) == line and line not in self._ids:
                self._ids[line] = ids
                self._pool[split_of(line, test_fraction, split_seed)].append(line)
        for split, pool in self._pool.items():
            if not pool:
                cap = "" if max_token_id is None else f" with token ids below {max_token_id}"
                raise ValueError(f"the copy task has no {split!r} line of {min_tokens}..{max_tokens} tokens{cap} "
                                 f"among {len(candidates)} candidates: widen task.copy.min_tokens/max_tokens"
                                 + ("" if max_token_id is None else " or raise task.copy.max_token_id"))
        self._newline = tokenizer.encode("\n", add_special_tokens=False)
        self._pieces: dict[int, str] = {}

    def lines(self, split: str, n: int, seed: int) -> list[str]:
        """`n` distinct lines of `split` (all of them, shuffled, then again, when n exceeds the split),
        a pure function of the arguments."""
        check_split(split)
        pool = self._pool[split]
        rng = random.Random(f"copy:{split}:{seed}")
        out: list[str] = []
        while len(out) < n:
            out += rng.sample(pool, min(n - len(out), len(pool)))
        return out

    def _prompt(self, line: str) -> list[int]:
        return [self.tokenizer.bos_token_id] + self._ids[line] + self._newline

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], str]]:
        """(ids of BOS, the line and a newline; the line) pairs."""
        return [(self._prompt(line), line) for line in self.lines(split, n, seed)]

    def sft_examples(self, split: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, the line's ids + EOS): the BPE's tokenization, or on the train split with
        sft_split_prob > 0 a sampled one (module docstring), a pure function of the arguments."""
        lines = self.lines(split, n, seed)
        eos = self.tokenizer.eos_token_id
        if split != "train" or self.sft_split_prob == 0:
            return [(self._prompt(line), self._ids[line] + [eos]) for line in lines]
        rng = random.Random(f"copy-split:{seed}")
        return [(self._prompt(line), self.sampled_ids(line, rng) + [eos]) for line in lines]

    def sampled_ids(self, line: str, rng: random.Random) -> list[int]:
        """`line` (a line of the task) in a sampled tokenization: each BPE token of two or more
        characters cut in two with probability sft_split_prob (module docstring); decodes to `line`."""
        out: list[int] = []
        for token in self._ids[line]:
            text = self._pieces.get(token)
            if text is None:
                text = self._pieces[token] = self.tokenizer.decode([token])
            if len(text) < 2 or rng.random() >= self.sft_split_prob:
                out.append(token)
                continue
            cut = rng.randrange(1, len(text))
            out += self.tokenizer.encode(text[:cut], add_special_tokens=False)
            out += self.tokenizer.encode(text[cut:], add_special_tokens=False)
        return out

    def reward(self, sample: Sample, reference: str) -> float:
        """1.0 when the response up to its first EOS is the line and EOS was written, else 0.0."""
        if self.tokenizer.eos_token_id not in sample.response_ids:
            return 0.0
        return 1.0 if decode_response(self.tokenizer, sample.response_ids) == reference else 0.0

    def new_environment(self) -> None:
        """Single turn: no environment."""
        return None

"""SFT examples from JSONL files (`sft.data_files`).

Each line is one example, either text or token ids:

    {"prompt": "12+34=", "response": "46"}                 # tokenized; EOS appended to the response
    {"input_ids": [1, 5, 9], "output_ids": [7, 2]}          # used as given

Batches walk a seeded permutation of all examples, epoch after epoch, so step
`s` always gets the same examples (a resumed or repeated warm-up is identical).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from entr_megatron.utils.jsonl import check_token_ids, read_jsonl_objects
from entr_megatron.utils.seeding import mix_seed

__all__ = ["load_sft_file_examples", "read_sft_file"]

Example = tuple[list[int], list[int]]


def read_sft_file(path: str, tokenizer: Any) -> list[Example]:
    """All examples of one JSONL file; errors name the file and line."""
    examples = []
    for _, where, row in read_jsonl_objects(path, flag="sft.data_files"):
        if "input_ids" in row or "output_ids" in row:
            examples.append((check_token_ids(row.get("input_ids"), where, "input_ids", None),
                             check_token_ids(row.get("output_ids"), where, "output_ids", None)))
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
            prompt = tokenizer.encode(row["prompt"])
            response = tokenizer.encode(row["response"], add_special_tokens=False) + [tokenizer.eos_token_id]
            examples.append((prompt, response))
        else:
            raise ValueError(f"{where}: needs string 'prompt' and 'response', or 'input_ids' and 'output_ids' "
                             f"lists; got keys {sorted(row)}")
    if not examples:
        raise ValueError(f"sft.data_files: {path!r} holds no examples")
    return examples


@lru_cache(maxsize=4)
def _all_examples(paths: tuple[str, ...], tokenizer_key: int, tokenizer: Any) -> list[Example]:
    return [e for p in paths for e in read_sft_file(p, tokenizer)]


@lru_cache(maxsize=2)
def _order(seed: int, epoch: int, size: int) -> list[int]:
    order = list(range(size))
    random.Random(mix_seed(seed, epoch)).shuffle(order)
    return order


def load_sft_file_examples(paths: Sequence[str], tokenizer: Any, n: int, step: int, seed: int = 0) -> list[Example]:
    """The `n` examples of step `step`: positions [step * n, (step + 1) * n) of the epoch permutations."""
    examples = _all_examples(tuple(paths), id(tokenizer), tokenizer)
    out = []
    for position in range(step * n, (step + 1) * n):
        epoch, index = divmod(position, len(examples))
        out.append(examples[_order(seed, epoch, len(examples))[index]])
    return out

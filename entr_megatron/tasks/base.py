"""What every task offers the controller: prompts by split, and a reward per sample.

    task = make_task("arithmetic", digits=3)
    batch = task.prompts("train", n=64, seed=step)      # [(prompt_ids, reference), ...]
    sample.reward = task.reward(sample, reference)      # 0.0 .. 1.0

Single-turn tasks hand prompts straight to a `RolloutEngine`; multi-turn tasks
(tools) also return an `Environment` from `new_environment()`, whose episodes
`rollout.episodes.EpisodeEngine` drives (`train` wraps the engines in one). `prompts`
is a pure function of (split, n, seed), so a run that resumes at step k asks for
`seed=k` and gets the same problems.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from entr_megatron.types import Sample

if TYPE_CHECKING:
    from entr_megatron.tasks.environment import Environment

__all__ = ["SPLITS", "Task", "TokenLabeller", "answer_after", "check_split", "decode_response", "final_answer_reward",
           "no_token_labels", "single_token_id", "split_of", "stable_hash"]

SPLITS = ("train", "test")
"""Every task has a training split and a held-out split that never share a problem."""


@runtime_checkable
class Task(Protocol):
    """A source of prompts with a verifiable reward."""

    name: str
    tokenizer: Any
    """The HF tokenizer the prompt ids belong to (also what `reward` decodes with)."""

    def prompts(self, split: str, n: int, seed: int) -> list[tuple[list[int], Any]]:
        """`n` (prompt token ids, reference answer) pairs of `split`, a pure function of the arguments."""
        ...

    def reward(self, sample: Sample, reference: Any) -> float:
        """Reward of a finished sample against the reference of its prompt."""
        ...

    def new_environment(self) -> Environment | None:
        """A fresh environment for one multi-turn episode, or None for a single-turn task."""
        ...


@runtime_checkable
class TokenLabeller(Protocol):
    """A task that can say what each response token is (types.TOKEN_LABELS), for metrics split by
    label (countdown). The controller labels every finished sample of such a task."""

    def token_labels(self, sample: Sample, reference: Any) -> list[str] | None:
        """One TOKEN_LABELS entry ("" for none) per response token of `sample`; None: not labelled."""
        ...


def no_token_labels(sample: Sample, reference: Any) -> None:
    """The labeller of a task that labels nothing."""
    return None


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def check_fractions(test_fraction: float, format_reward: float = 0.0) -> None:
    """The range checks every task's constructor makes: a test split that is neither empty nor
    everything, and a format reward below a correct answer's (a bool is no number here)."""
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if isinstance(format_reward, bool) or not isinstance(format_reward, (int, float)) or not 0 <= format_reward < 1:
        raise ValueError(f"format_reward must be in [0, 1), got {format_reward!r}")


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and Python version (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def split_of(key: str, test_fraction: float, split_seed: int) -> str:
    """Which split a problem belongs to, decided by its text alone: splits are disjoint by
    construction and do not depend on how many problems were drawn or in which order."""
    return "test" if stable_hash(f"{split_seed}:{key}") % 1_000_000 < test_fraction * 1_000_000 else "train"


def decode_response(tokenizer: Any, response_ids: list[int], stop_ids: tuple[int, ...] = ()) -> str:
    """Text of a response up to (not including) its first EOS/stop token: junk the engine
    produced after the end of the answer never counts."""
    ends = set(stop_ids)
    if tokenizer.eos_token_id is not None:
        ends.add(tokenizer.eos_token_id)
    ids = list(response_ids)
    for i, t in enumerate(ids):
        if t in ends:
            ids = ids[:i]
            break
    return tokenizer.decode(ids, skip_special_tokens=True)


def answer_after(text: str, marker: str) -> str:
    """What follows the last `marker` in `text` (a tool task's final answer after its last tool
    output; the whole text when no tool was used), stripped."""
    return text.rsplit(marker, 1)[-1].strip()


def final_answer_reward(tokenizer: Any, response_ids: list[int], reference: str, marker: str) -> float:
    """A tool task's exact-match reward: 1.0 iff EOS was written and the text after the last `marker`
    (the tool-output end), up to that EOS, is the reference; else 0.0."""
    if tokenizer.eos_token_id not in response_ids:
        return 0.0
    return 1.0 if answer_after(decode_response(tokenizer, response_ids), marker) == reference else 0.0


def single_token_id(tokenizer: Any, marker: str, needed_by: str, markers: tuple[str, ...]) -> int:
    """The id of `marker`, which must be one token of `tokenizer`: the engine ends a turn on a token
    id. Otherwise a ValueError naming `needed_by` and how to add `markers` to the tokenizer."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{needed_by} needs {marker!r} to be one token of the tokenizer, it encodes to {ids}; add the markers "
            f"with tokenizer.add_tokens({list(markers)!r}) (build_char_tokenizer(tool_tokens=...) takes them)"
        )
    return ids[0]

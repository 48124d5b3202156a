"""What the controller needs from the learner and the weight transport (injected, so the
loops run in-process against fakes in tests and against processes/Ray actors for real)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from entr_megatron.types import TrainBatch
from entr_megatron.utils.seeding import mix_seed

__all__ = ["ABANDON_TIMEOUT_S", "Learner", "PromptStream", "PushHandle", "WeightPusher"]

ABANDON_TIMEOUT_S = 30.0
"""After a learner failure, how long the controller waits for each engine to give up what it was
doing for that learner: the groups in flight (`Controller.abandon`) and a broken weight version
(`RemotePush.abandon`, `wiring`'s wait for the engines)."""


@runtime_checkable
class Learner(Protocol):
    """The training side (all learner ranks behind one call)."""

    def train(self, batch: TrainBatch, current_version: int) -> dict[str, float]:
        """Train on the rollout batch `batch` with the policy at `current_version` (one or more
        optimizer steps: learner.mini_batches x learner.epochs; still one policy version); returns
        metrics. Blocks until done (engines keep generating in their own processes)."""
        ...


@runtime_checkable
class PushHandle(Protocol):
    def wait(self) -> None:
        """Returns once every engine samples from the pushed version."""
        ...


@runtime_checkable
class WeightPusher(Protocol):
    """Moves the learner's current weights to every engine (weight_sync layer)."""

    def push(self, version: int) -> PushHandle:
        """Starts sending the learner's weights as `version`; returns without waiting."""
        ...


class PromptStream:
    """Prompt i of the training stream, a pure function of (task, seed, i).

    Prompts are drawn in chunks: chunk c is `task.prompts("train", chunk_size, seed=mix_seed(seed, c))`,
    so the data position of a run is one integer (`next_index`).
    """

    def __init__(self, task: Any, chunk_size: int, seed: int = 0, split: str = "train") -> None:
        self.task, self.chunk_size, self.seed, self.split = task, chunk_size, seed, split
        self.next_index = 0
        self._cache: tuple[int, list] | None = None

    def get(self, index: int) -> tuple[list[int], Any]:
        """(prompt ids, reference) of prompt `index`."""
        chunk, pos = divmod(index, self.chunk_size)
        if self._cache is None or self._cache[0] != chunk:
            seed = mix_seed(self.seed, chunk)
            self._cache = (chunk, self.task.prompts(self.split, self.chunk_size, seed=seed))
        return self._cache[1][pos]

    def take_index(self) -> int:
        """The next unused prompt index (advances the stream)."""
        self.next_index += 1
        return self.next_index - 1

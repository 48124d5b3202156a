"""What the controller needs from the learner and the weight transport (injected, so the
loops run in-process against fakes in tests and against processes/Ray actors for real)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from entr_megatron.types import TrainBatch
from entr_megatron.utils.seeding import mix_seed

__all__ = ["ABANDON_TIMEOUT_S", "NO_RECOVERY", "ControllerHooks", "Learner", "PromptStream", "PushHandle", "Recovery", "WeightPusher"]

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
    """One weight version on its way to the engines (`WeightPusher.push`)."""

    def wait(self) -> None:
        """Returns once every engine samples from the pushed version."""
        ...

    def abandon(self, timeout_s: float = ABANDON_TIMEOUT_S) -> None:
        """Gives the version up (the learner that sent it failed): waits up to `timeout_s` for each
        engine's side to end and ignores its outcome."""
        ...


@runtime_checkable
class WeightPusher(Protocol):
    """Moves the learner's current weights to every engine (weight_sync layer)."""

    def push(self, version: int) -> PushHandle:
        """Starts sending the learner's weights as `version`; returns without waiting."""
        ...


@dataclass
class ControllerHooks:
    """Side effects kept out of the loop: metrics writers, checkpoints."""

    on_step: list[Callable[[dict], None]] = field(default_factory=list)
    checkpoint_interval: int = 0
    """Call on_checkpoint every this many steps (0: never)."""
    on_checkpoint: Callable[[Any], None] | None = None
    """Gets the controller (drained of in-flight work): saves `state_dict()` with the model."""
    eval_interval: int = 0
    """Call on_eval every this many steps (0: never), drained like a checkpoint."""
    on_eval: Callable[[Any], dict] | None = None
    """Gets the drained controller (engines idle, at the learner's version); its metrics join the step's."""
    should_stop: Callable[[], bool] | None = None
    """Checked after every step (e.g. Ctrl-C was pressed): true ends `run` after a checkpoint."""


class Recovery:
    """What the controller calls when an engine fails: `controller/job/wiring.py` `EngineRecovery`
    (embedded engines, processes or Ray actors) and `controller/job/sglang_servers.py` `ServerRecovery`
    subclass it. This base is the null recovery (`NO_RECOVERY`): no engine is ever found failed, so
    an engine's error ends the run, and silence is waited out."""

    def __init__(self) -> None:
        self.restarts = 0
        """Engines replaced so far in this job."""

    def failed(self) -> list[tuple[int, str]]:
        """The engines that are dead or do not answer a health check, with their last error."""
        return []

    def noticed(self) -> bool:
        """True when an engine is already known to have failed (an engine set that kept serving
        from the others): the controller then calls `failed` and `replace` without waiting."""
        return False

    def replace(self, failed: list[tuple[int, str]], version: int, pending_push: Any = None) -> None:
        """New engines in place of `failed`, every engine at the learner's `version` afterwards."""
        raise NotImplementedError(f"{type(self).__name__} replaces no engine")

    def returned(self) -> bool:
        """True when an engine out of service answers again (SGLang servers given by URL)."""
        return False

    def readmit(self, version: int) -> None:
        """Takes the engines that answer again back, at the learner's `version`."""

    def out_of_service(self) -> int:
        """Engines out of service now."""
        return 0


NO_RECOVERY = Recovery()


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

"""Fakes of the controller's collaborators shared by the engine-replacement tests: the recovery's
contract without processes, a pusher that sets every engine's version, a learner that records its
batches. Each test module brings its own fake engine (what it needs of one differs)."""

from __future__ import annotations

from collections.abc import Callable

from entr_megatron.controller.engines import RestartsExhausted
from entr_megatron.controller.interfaces import Recovery as RecoveryBase


class Recovery(RecoveryBase):
    """`EngineRecovery`'s contract without processes: a failed engine is killed and replaced by
    `new_engine(version)` at the learner's version, within `limit` replacements."""

    def __init__(self, engines, new_engine: Callable, limit: int = 3):
        super().__init__()
        self.engines, self.new_engine, self.limit, self.replaced = engines, new_engine, limit, []

    def noticed(self):
        return bool(self.engines.failed)

    def failed(self):
        out = []
        for i, e in enumerate(self.engines.engines):
            h = e.health()
            if not h.alive:
                e.kill()
                out.append((i, h.error))
        return out

    def replace(self, failed, version, pending_push=None):
        if self.restarts + len(failed) > self.limit:
            raise RestartsExhausted(f"{self.restarts} replaced; {failed[0][1]}")
        for i, _ in failed:
            self.engines.replace(i, self.new_engine(version))
            self.restarts += 1
            self.replaced.append(version)


class Pusher:
    """Pushes arrive at once: every engine of the set holds the newest version pushed."""

    def __init__(self, engines):
        self.engines, self.pushed = engines, []

    def push(self, version):
        self.pushed.append(version)
        for e in self.engines.engines:
            e.version = max(e.version, version)

        class Handle:
            def wait(self):
                return {}

        return Handle()


class Learner:
    """Records the batches it is given; `on_train(number of batches so far)` after each."""

    def __init__(self, on_train=None):
        self.batches, self.on_train = [], on_train

    def train(self, batch, version):
        self.batches.append(batch)
        if self.on_train is not None:
            self.on_train(len(self.batches))
        return {}

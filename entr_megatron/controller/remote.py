"""The controller's `Learner` and `WeightPusher` over a worker group of learner ranks.

    learner = RemoteLearner(group, engines, receivers)     # group: ProcessWorkerGroup / RayWorkerGroup
    learner.train(batch, version)                          # every rank: the rollout batch's optimizer steps
    handle = learner.push(version)                         # engines start receiving, ranks snapshot
    ...                                                    # the next train step runs meanwhile
    handle.wait()                                          # every engine samples from `version`

A push has two sides that meet in the broadcast groups: each engine's
`update_weights(receiver, version)` (run here, in a thread per engine: it joins
the groups and swaps the staged weights in between two decode steps) and the
ranks' `WeightSync.push` (the stage senders broadcast in their background thread).
The engine side starts first, so a learner with bounded snapshot memory never
waits for receivers that have not joined.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from entr_megatron.rollout.engine import RolloutEngine, WeightReceiver, WeightUpdateReport
from entr_megatron.types import TrainBatch

__all__ = ["RemoteLearner", "RemotePush"]


class _EngineUpdate(threading.Thread):
    def __init__(self, engine: RolloutEngine, receiver: WeightReceiver, version: int):
        super().__init__(name=f"engine-update-{version}", daemon=True)
        self.engine, self.receiver, self.version = engine, receiver, version
        self.report: WeightUpdateReport | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.report = self.engine.update_weights(self.receiver, self.version)
        except BaseException as e:  # noqa: BLE001 - raised by RemotePush.wait
            self.error = e


class RemotePush:
    """One version in flight (the controller's `PushHandle`)."""

    def __init__(self, learner: RemoteLearner, version: int, updates: list[_EngineUpdate], blocked_s: float):
        self.learner, self.version, self.updates = learner, version, updates
        self.learner_blocked_s = blocked_s
        self.report: dict[str, float] | None = None

    def wait(self) -> dict[str, float]:
        if self.report is not None:
            return self.report
        t0 = time.perf_counter()
        rank_reports = self.learner.group.call("wait_push")
        for u in self.updates:
            u.join()
        errors = [u.error for u in self.updates if u.error is not None]
        if errors:
            raise RuntimeError(f"weight version {self.version} did not reach every engine: {errors[0]}") from errors[0]
        senders = [r for r in rank_reports if r.get("sender")]
        engine = [u.report for u in self.updates if u.report is not None]
        self.report = {
            "weight_sync/version": float(self.version),
            "weight_sync/learner_blocked_s": self.learner_blocked_s,
            "weight_sync/transfer_s": max((r["transfer_s"] for r in senders), default=0.0),
            "weight_sync/gbytes_per_s": min((r["gbytes_per_s"] for r in senders), default=0.0),
            "weight_sync/engine_blocked_s": max((r.swap_s for r in engine), default=0.0),
            "weight_sync/wait_s": time.perf_counter() - t0,
        }
        self.learner.last_push_report = self.report
        return self.report


class RemoteLearner:
    """`Learner` + `WeightPusher` (controller/interfaces.py) over learner ranks in other processes."""

    def __init__(self, group: Any, engines: Sequence[RolloutEngine] = (), receivers: Sequence[WeightReceiver] = ()):
        if len(engines) != len(receivers):
            raise ValueError(f"one receiver per engine: {len(engines)} engines, {len(receivers)} receivers")
        self.group, self.engines, self.receivers = group, list(engines), list(receivers)
        self.last_push_report: dict[str, float] = {}

    def train(self, batch: TrainBatch, current_version: int) -> dict[str, float]:
        return self.group.call("train", batch, current_version)[0]

    def push(self, version: int) -> RemotePush:
        updates = [_EngineUpdate(e, r, version) for e, r in zip(self.engines, self.receivers)]
        try:
            blocked = self.group.call("push", version)
        except BaseException:
            for u in updates:  # the engines drop the half-received version when the wire breaks
                u.join(timeout=5)
            raise
        return RemotePush(self, version, updates, max(blocked))

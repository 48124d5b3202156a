"""The controller's `Learner` and `WeightPusher` over a worker group of learner ranks.

    learner = RemoteLearner(group)                         # group: ProcessWorkerGroup / RayWorkerGroup
    pusher = RemotePusher(group, engines, receivers)       # the same ranks, in their other role
    learner.train(batch, version)                          # every rank: the rollout batch's optimizer steps
    handle = pusher.push(version)                          # engines start receiving, ranks snapshot
    ...                                                    # the next train step runs meanwhile
    handle.wait()                                          # every engine samples from `version`

A push has two sides that meet in the broadcast groups: each engine's
`update_weights(receiver, version)` (run here, in a thread per engine: it joins
the groups and swaps the staged weights in between two decode steps) and the
ranks' `WeightSync.push` (the stage senders broadcast in their background thread).
The engine side starts first, so a learner with bounded snapshot memory never
waits for receivers that have not joined. Engines that learner rank 0 updates
itself (SGLang servers, through its SGLangTransport) have no side here: the
pusher gets no engines, and `on_delivered` hears of each version they hold.

`push_timeout_s` bounds `wait`. The engines' side is waited first: when an engine failed
(or did not finish in time) the ranks are not asked, so a broken wire never fails a call on the
learner ranks (their group stays usable), and the engines still receiving are told to give the
version up (a member that died breaks the group for all: what it was to relay never comes,
`cancel_weight_update`); the push is then the caller's to
`abandon` once the engine is dealt with (controller/job/wiring.py `EngineRecovery`). Engines the
ranks update themselves (SGLang) report a failed push in rank 0's answer (`engine_error`),
raised here as EnginePushError (controller/job/sglang_servers.py `ServerRecovery`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from entr_megatron.controller.ranks.learner_worker import LearnerWorker
from entr_megatron.controller.ranks.workers import WorkerGroup
from entr_megatron.controller.rl.interfaces import ABANDON_TIMEOUT_S
from entr_megatron.rollout.engine import (
    CancellableUpdates,
    EngineError,
    RolloutEngine,
    WeightReceiver,
    WeightUpdateReport,
)
from entr_megatron.types import TrainBatch

__all__ = ["EnginePushError", "RemoteLearner", "RemotePush", "RemotePusher"]

_POLL_S = 0.1
"""`RemotePush.wait` looks this often whether an engine's side failed (then the others are cancelled)."""


class EnginePushError(EngineError):
    """A version did not reach an engine (it failed, or did not answer within push_timeout_s)."""


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

    def __init__(self, pusher: RemotePusher, version: int, updates: list[_EngineUpdate], blocked_s: float):
        self.pusher, self.version, self.updates = pusher, version, updates
        self.learner_blocked_s = blocked_s
        self.report: dict[str, float] | None = None

    def wait(self) -> dict[str, float]:
        if self.report is not None:
            return self.report
        t0 = time.perf_counter()
        timeout = self.pusher.push_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while (alive := [u for u in self.updates if u.is_alive()]) and not self._failed():
            if deadline is not None and time.monotonic() >= deadline:
                raise EnginePushError(f"weight version {self.version} did not reach every engine within "
                                      f"{timeout:.0f} s (rollout.push_timeout_s)")
            alive[0].join(_POLL_S if deadline is None else min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
        errors = [u.error for u in self.updates if u.error is not None]
        if errors:
            self._cancel_the_rest()  # the group is broken for every member: the others wait in vain
            # A learner rank that died mid-push breaks the engines' side first (their broadcast
            # peer is gone): that is the learner's failure (WorkerError: relaunch the ranks), not
            # the engines'.
            self.pusher.group.raise_if_dead(f"the push of weight version {self.version}")
            raise EnginePushError(f"weight version {self.version} did not reach every engine: {errors[0]}") \
                from errors[0]
        if deadline is None:
            rank_reports = self.pusher.group.call(LearnerWorker.wait_push)
        else:  # the engines hold the version: the senders are done or about to be
            left = max(deadline - time.monotonic(), 1.0)
            rank_reports = self.pusher.group.call_async(LearnerWorker.wait_push, left).result(left + 30)
        broken = [r["engine_error"] for r in rank_reports if "engine_error" in r]
        if broken:
            raise EnginePushError(f"weight version {self.version} did not reach every engine: {broken[0]}")
        senders = [r for r in rank_reports if r.get("sender")]
        engine = [u.report for u in self.updates if u.report is not None]
        self.report = {
            "weight_sync/version": float(self.version),
            "weight_sync/learner_blocked_s": self.learner_blocked_s,
            "weight_sync/transfer_s": max((r["transfer_s"] for r in senders), default=0.0),
            "weight_sync/gbytes_per_s": min((r["gbytes_per_s"] for r in senders), default=0.0),
            "weight_sync/engine_blocked_s": max((r.swap_s for r in engine), default=0.0),
            "weight_sync/wait_s": time.perf_counter() - t0,
            # rollout.placement colocated: this push's bucket copies into engine memory (0: broadcast)
            "weight_sync/colocated_copies": sum(r.get("colocated_copies", 0.0) for r in senders),
        }
        self.pusher.last_push_report = self.report
        if self.pusher.on_delivered is not None:
            self.pusher.on_delivered(self.version)
        return self.report

    def abandon(self, timeout_s: float = ABANDON_TIMEOUT_S) -> None:
        """Give up a version that broke (an engine died): the engines still receiving it are told
        to give up (`cancel_weight_update`), then each engine's side is waited for a while and its
        outcome ignored. The ranks' side is dropped with their weight groups."""
        self._cancel_the_rest()
        for u in self.updates:
            u.join(timeout_s)

    def _failed(self) -> bool:
        return any(u.error is not None for u in self.updates)

    def _cancel_the_rest(self) -> None:
        """Engines still receiving this version give it up (a member of their broadcast group died:
        what it was to relay never comes). Engines without the call are waited for as before."""
        for u in self.updates:
            if u.is_alive() and isinstance(u.engine, CancellableUpdates):
                u.engine.cancel_weight_update()


class RemoteLearner:
    """`Learner` (controller/rl/interfaces.py) over learner ranks in other processes; also their
    checkpoints and HF export (rank 0's answer of each call)."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def train(self, batch: TrainBatch, current_version: int) -> dict[str, float]:
        return self.group.call(LearnerWorker.train, batch, current_version)[0]

    def save(self, root: str, step: int, extra_state: Any = None, keep_last: int | None = None) -> str:
        """A dist checkpoint of every rank's state (and `extra_state`) as `step` under `root`."""
        return self.group.call(LearnerWorker.save, root, step, extra_state, keep_last)[0]

    def load(self, root: str, step: int | None = None, verify: bool = True) -> tuple[int, Any]:
        """Every rank loads checkpoint `step` (None: the latest good one) under `root`; (its step,
        its extra state). verify=False: the caller checked it against its manifest already."""
        return self.group.call(LearnerWorker.load, root, step, verify)[0]

    def target_logprobs(self, examples: list[tuple[list[int], list[int]]]) -> list[float]:
        """log p(target | prompt) of each (prompt ids, target ids) pair (teacher forced, temperature 1)."""
        return self.group.call(LearnerWorker.target_logprobs, examples)[0]

    def export_hf(self, out_dir: str) -> str:
        """The current weights as an HF directory."""
        return self.group.call(LearnerWorker.export_hf, out_dir)[0]


class RemotePusher:
    """`WeightPusher` (controller/rl/interfaces.py) over the learner ranks: `engines[i]` receives
    through `receivers[i]` in a thread here; none for engines the ranks update themselves.
    `on_delivered(version)` runs once a waited push has reached every engine."""

    def __init__(self, group: WorkerGroup, engines: Sequence[RolloutEngine] = (), receivers: Sequence[WeightReceiver] = (),
                 on_delivered: Callable[[int], None] | None = None, push_timeout_s: float | None = None):
        if len(engines) != len(receivers):
            raise ValueError(f"one receiver per engine: {len(engines)} engines, {len(receivers)} receivers")
        self.group, self.engines, self.receivers = group, list(engines), list(receivers)
        self.on_delivered = on_delivered
        self.push_timeout_s = push_timeout_s
        """Longest `RemotePush.wait` (None: no limit)."""
        self.recovery: Any = None
        """The `EngineRecovery` of engines that can be replaced (controller/job/wiring.py), else None."""
        self.last_push_report: dict[str, float] = {}
        """The report of the last waited push (the step's weight_sync/* metrics)."""
        self.last_updates: list[_EngineUpdate] = []
        """The engines' side of the last push (threads here), waited or not."""

    def push(self, version: int) -> RemotePush:
        updates = [_EngineUpdate(e, r, version) for e, r in zip(self.engines, self.receivers)]
        self.last_updates = updates
        try:
            blocked = self.group.call(LearnerWorker.push, version)
        except BaseException:
            for u in updates:  # the engines drop the half-received version when the wire breaks
                u.join(timeout=5)
            raise
        return RemotePush(self, version, updates, max(blocked))

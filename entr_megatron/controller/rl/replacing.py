"""Generation that survives an engine being replaced: what fixed_lag's generate-ahead and the
held-out evaluations run (the main loop resubmits its own groups: loop.py `Controller.recover`).

    results = generate_replacing(engine, requests, recover, timeout_s=3600, idle_timeout_s=120)

Like `rollout.engine.generate` (every sample of `requests`, in request order, then sample index),
except that a failed engine call, or no sample for `idle_timeout_s`, calls `recover(error)`: it
health-checks the engines and replaces the failed ones (returning True), returns False when every
engine answered (slow, not hung), and raises when it cannot (no recovery, or the restart budget is
spent). After a replacement the whole round is generated again, as it was first submitted: every
request still running is aborted, every sample already received is dropped, and the requests go
in again in their order with their own prompts and seeds (new request ids). Idle engines then get
the same batch as in an undisturbed run, so a seeded round (fixed_lag) reproduces its samples.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence

from entr_megatron.rollout.engine import EngineError, EngineGroup, GenerateRequest, GenerateResult, generate
from entr_megatron.utils.console import say

__all__ = ["DRAIN_TIMEOUT_S", "generate_replacing"]

DRAIN_TIMEOUT_S = 60.0
"""Longest wait for the aborted requests of an interrupted round to leave the surviving engines."""

Recover = Callable[[EngineError | None], bool]


def generate_replacing(engine: EngineGroup, requests: Sequence[GenerateRequest], recover: Recover,
                       timeout_s: float, idle_timeout_s: float | None = None) -> list[GenerateResult]:
    """Every sample of `requests` (see the module docstring); TimeoutError after `timeout_s` in all."""
    deadline = time.monotonic() + timeout_s

    def silent() -> None:
        if recover(None):  # a silent engine was replaced
            raise _Replaced()
        # every engine answered: slow, not hung

    while True:
        round_ = [dataclasses.replace(r, request_id=uuid.uuid4().hex) for r in requests]
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(requests)} request(s) not finished after {timeout_s:.0f} s")
        try:
            return generate(engine, round_, timeout_s=left, idle_timeout_s=idle_timeout_s, on_silence=silent)
        except EngineError as e:
            recover(e)  # raises when no engine failed
        except _Replaced:
            pass
        _abandon(engine, [r.request_id for r in round_], deadline)
        say(f"a round of {len(requests)} request(s) interrupted by the engine replacement is generated again "
            "(same seeds)")


class _Replaced(Exception):
    """An engine was replaced while the round ran: generate it again."""


def _abandon(engine: EngineGroup, request_ids: list[str], deadline: float) -> None:
    """Abort what is left of an interrupted round on the engines that survived, and wait (bounded)
    until it has left them, so that the round starts again on idle engines."""
    is_live = engine.is_live
    live = [rid for rid in request_ids if is_live(rid)]
    if not live:
        return
    until = min(deadline, time.monotonic() + DRAIN_TIMEOUT_S)
    try:
        engine.abort(live)
        while any(is_live(rid) for rid in live) and time.monotonic() < until:
            engine.poll(timeout=0.1)  # their aborted samples, thrown away
    except EngineError:
        pass  # another engine failed: the next round's calls find it and replace it

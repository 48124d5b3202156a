"""The controller's in-flight bookkeeping: the groups submitted to the engines and not yet whole,
and the requests it gave up on whose samples may still arrive (to be ignored).

    inflight = InFlight(n=8)
    inflight.add(request_id, ref, reference, engine_version)   # recorded before the engine sees it
    record = inflight.accept(result)     # a GenerateResult; the group's record once all n arrived
    ids = inflight.give_up(lambda r: r.engine_version < oldest)   # aborted: late samples ignored
    refs = inflight.lost(is_live)        # the groups of engines that were replaced

Request ids are the engine's (`renumber` when an engine numbers requests itself). A group given
up on leaves `n - received` samples to come; `accept` swallows them, so no late sample of an
aborted or regenerated group can enter the buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from entr_megatron.controller.rl.buffer import GroupRef
from entr_megatron.rollout.engine import GenerateResult

__all__ = ["InFlight", "InFlightGroup"]


@dataclass
class InFlightGroup:
    ref: GroupRef
    reference: Any
    """The task's reference answer of the prompt (for the reward)."""
    engine_version: int
    """Engine weight version when submitted: a lower bound on every token version of the group."""
    results: dict[int, GenerateResult] = field(default_factory=dict)
    """Sample index -> result, as they arrive."""


class InFlight:
    """Groups in flight by request id, and the ids given up on with the samples still to come."""

    def __init__(self, n: int) -> None:
        self.n = n
        """Samples per group."""
        self.groups: dict[str, InFlightGroup] = {}
        self.ignored: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def busy(self) -> bool:
        """True while any sample is still to come (of a live group or one given up on)."""
        return bool(self.groups or self.ignored)

    def add(self, request_id: str, ref: GroupRef, reference: Any, engine_version: int) -> None:
        self.groups[request_id] = InFlightGroup(ref, reference, engine_version)

    def renumber(self, old: str, new: str) -> None:
        if new != old:
            self.groups[new] = self.groups.pop(old)

    def refs(self) -> list[GroupRef]:
        return [g.ref for g in self.groups.values()]

    def accept(self, result: GenerateResult) -> InFlightGroup | None:
        """Records one sample; returns its group (removed from flight) once all `n` arrived, None
        before that, and for samples of requests given up on or unknown (abandoned earlier)."""
        rid = result.request_id
        if rid in self.ignored:
            self.swallow(rid)
            return None
        group = self.groups.get(rid)
        if group is None:
            return None
        group.results[result.sample_index] = result
        if len(group.results) < self.n:
            return None
        return self.groups.pop(rid)

    def give_up(self, which: Callable[[InFlightGroup], bool] = lambda group: True) -> dict[str, InFlightGroup]:
        """Removes the groups `which` selects (all by default); their samples still to come are
        ignored from now on. Returns them by request id."""
        chosen = {rid: g for rid, g in self.groups.items() if which(g)}
        for rid, group in chosen.items():
            del self.groups[rid]
            if self.n - len(group.results) > 0:
                self.ignored[rid] = self.n - len(group.results)
        return chosen

    def lost(self, is_live: Callable[[str], bool]) -> list[GroupRef]:
        """Removes the groups whose request no engine holds any more (their engine was replaced)
        and forgets the ignored requests of those engines; returns the lost groups' refs."""
        lost = [rid for rid in self.groups if not is_live(rid)]
        self.ignored = {rid: k for rid, k in self.ignored.items() if is_live(rid)}
        return [self.groups.pop(rid).ref for rid in lost]

    def swallow(self, request_id: str) -> None:
        """One sample of a request given up on arrived (`accept`, or read directly by `abandon`)."""
        left = self.ignored.pop(request_id, 0) - 1
        if left > 0:
            self.ignored[request_id] = left

"""Many rollout engines behind one `RolloutEngine`, for the controller.

    engines = EngineSet([engine_0, engine_1, engine_2])
    ids = engines.submit(requests)      # each request goes to the engine with the fewest live samples
    results = engines.poll(timeout=1.0)  # from whichever engines have finished samples
    engines.weight_version              # the oldest weights any engine samples from

Request ids: a request keeps the id its caller set (it must not be live anywhere in the
set); one without gets a fresh id, as an engine would give it. The id an engine answers
with is mapped back, so `GenerateResult.request_id` is always the id `submit` returned,
even if two engines number their requests alike. A request is live (counted for the
balance) until all n of its samples came back from `poll`, aborted ones included.

Weights do not go through the set: the weight pusher (weight_sync layer) sends them to
every engine itself, so `update_weights` raises. Not thread-safe: one controller thread
drives it.

An engine that fails (EngineError from submit, poll or abort) is marked `failed` and gets no
more requests; `poll` still returns the other engines' samples and raises only when it has
none to give. `replace(index, engine)` puts a new engine in its place: the requests that were
live there are gone (`is_live` says which ids still are; the caller submits them again).
`park(index)` takes an engine out of service without a replacement (a server given by URL that
stopped answering): its requests are gone the same way, and it gets no calls at all (no
requests, polls, pauses; it counts for neither the version nor the health) until `replace`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from entr_megatron.rollout.engine import (
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    WeightSource,
    WeightUpdateReport,
)

__all__ = ["POLL_SLICE_S", "EngineSet", "RestartsExhausted"]

logger = logging.getLogger(__name__)

POLL_SLICE_S = 0.02
"""Longest wait on one engine inside `EngineSet.poll` before the next engine gets its turn."""


class RestartsExhausted(EngineError):
    """An engine failed and `rollout.max_engine_restarts` replacements were already made."""


@dataclass
class _Route:
    engine: int
    inner_id: str
    live_samples: int


class EngineSet:
    """A `RolloutEngine` over a list of engines (see the module docstring)."""

    def __init__(self, engines: Sequence[RolloutEngine], poll_slice_s: float = POLL_SLICE_S) -> None:
        if not engines:
            raise ValueError("EngineSet needs at least one engine")
        if not poll_slice_s > 0:
            raise ValueError(f"EngineSet poll_slice_s must be > 0, got {poll_slice_s!r}")
        self.engines: list[RolloutEngine] = list(engines)
        self.poll_slice_s = float(poll_slice_s)
        self._routes: dict[str, _Route] = {}  # outer id -> where it runs
        self._outer: list[dict[str, str]] = [{} for _ in self.engines]  # per engine: inner id -> outer id
        self._live: list[int] = [0] * len(self.engines)  # live samples per engine
        self._next_first = 0  # engine that waits first in the next poll (rotates)
        self._closed = False
        self.failed: dict[int, str] = {}
        """Engines that raised EngineError (index -> the error), until `replace`d or `park`ed."""
        self.parked: set[int] = set()
        """Engines out of service (`park`), until `replace`d."""

    def __len__(self) -> int:
        return len(self.engines)

    def live_samples(self) -> list[int]:
        """Samples submitted to each engine and not yet returned by `poll`."""
        return list(self._live)

    def is_live(self, request_id: str) -> bool:
        """Whether the request runs on an engine of the set (not finished, not lost with a replaced engine)."""
        return request_id in self._routes

    def replace(self, index: int, engine: RolloutEngine) -> list[str]:
        """Engine `index` is `engine` from now on (the caller shut the old one down); returns the
        ids of the requests that were live on the old one (lost: none of their samples will come)."""
        lost = self._forget(index)
        self.engines[index] = engine
        self.parked.discard(index)
        return lost

    def park(self, index: int) -> list[str]:
        """Take engine `index` out of service (the caller shut it down) until `replace`; returns
        the ids of the requests that were live on it (lost, as with `replace`)."""
        lost = self._forget(index)
        self.parked.add(index)
        if len(self.parked) == len(self.engines):
            logger.warning("every engine of the set is out of service")
        return lost

    def in_service(self) -> list[int]:
        """Indices of the engines not parked."""
        return [i for i in range(len(self.engines)) if i not in self.parked]

    def _forget(self, index: int) -> list[str]:
        lost = list(self._outer[index].values())
        for outer in lost:
            del self._routes[outer]
        self._outer[index] = {}
        self._live[index] = 0
        self.failed.pop(index, None)
        return lost

    # --- requests ------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        """Place each request on the engine with the fewest live samples (ties: lowest
        index), counting the requests placed before it; returns the requests' ids."""
        outer_ids: list[str] = []
        for r in requests:
            if r.request_id is None:
                r.request_id = uuid.uuid4().hex
            if r.request_id in self._routes or r.request_id in outer_ids:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            outer_ids.append(r.request_id)
        planned = list(self._live)
        placement: list[list[int]] = [[] for _ in self.engines]  # per engine: positions in `requests`
        usable = [i for i in self.in_service() if i not in self.failed]
        if requests and not usable:
            raise EngineError(f"every engine of the set failed or is out of service: failed {self.failed}, "
                              f"out of service {sorted(self.parked)}")
        for pos, r in enumerate(requests):
            target = min(usable, key=lambda i: (planned[i], i))
            placement[target].append(pos)
            planned[target] += r.params.n
        for index, positions in enumerate(placement):
            if not positions:
                continue
            inner_ids = self._guard(index, self.engines[index].submit, [requests[p] for p in positions])
            if len(inner_ids) != len(positions):
                raise RuntimeError(
                    f"engine {index} returned {len(inner_ids)} request ids for {len(positions)} requests"
                )
            for pos, inner in zip(positions, inner_ids):
                outer, n = outer_ids[pos], requests[pos].params.n
                if inner in self._outer[index]:
                    raise RuntimeError(f"engine {index} returned request id {inner!r}, which is already live")
                self._routes[outer] = _Route(index, inner, n)
                self._outer[index][inner] = outer
                self._live[index] += n
        return outer_ids

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        """Finished samples of every engine; waits up to `timeout` s (None: forever) for one.

        Every engine is asked without waiting first. If none has anything, the engines
        take turns waiting at most `poll_slice_s` each (the first to wait rotates between
        calls) until one answers or the timeout is spent; then the others are asked
        without waiting again, so a poll never favours one engine's results. With one engine in
        service that has not failed, it waits on that one (one call, not a call per slice)."""
        results = self._poll_all()
        if not results:
            self._raise_failed()
        if results or timeout == 0:
            return results
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        usable = [i for i in self.in_service() if i not in self.failed]
        if len(usable) == 1 and deadline is not None:  # no one to take turns with: one wait, not many short ones
            found = self._poll_one(usable[0], max(deadline - time.monotonic(), 0.0))
            if not found:
                self._raise_failed()
            return found
        count = len(self.engines)
        while True:
            first = self._next_first
            self._next_first = (first + 1) % count
            for step in range(count):
                index = (first + step) % count
                left = self.poll_slice_s if deadline is None else min(self.poll_slice_s, deadline - time.monotonic())
                if left <= 0:
                    return []
                found = self._poll_one(index, left)
                if not found:
                    self._raise_failed()  # nothing to give, and an engine is gone: say so now
                if found:
                    others = [i for i in range(count) if i != index]
                    return found + self._poll_all(others)

    def _poll_all(self, indices: Iterable[int] | None = None) -> list[GenerateResult]:
        indices = range(len(self.engines)) if indices is None else indices
        out: list[GenerateResult] = []
        for index in indices:
            out += self._poll_one(index, 0.0)
        return out

    def _poll_one(self, index: int, timeout: float) -> list[GenerateResult]:
        """Engine `index`'s samples; none from a failed one (its error is kept in `failed`) or a parked one."""
        if index in self.failed or index in self.parked:
            if timeout:
                time.sleep(timeout)  # its turn to wait, as if it had nothing
            return []
        try:
            return self._translate(index, self.engines[index].poll(timeout=timeout))
        except EngineError as e:
            self.failed[index] = str(e)
            return []

    def _guard(self, index: int, call, *args):
        """`call(*args)` on engine `index`; an EngineError marks the engine failed and is raised."""
        try:
            return call(*args)
        except EngineError as e:
            self.failed[index] = str(e)
            raise

    def _raise_failed(self) -> None:
        if self.failed:
            index, error = next(iter(self.failed.items()))
            raise EngineError(f"engine {index} of the set failed:\n{error}")

    def _translate(self, index: int, results: list[GenerateResult]) -> list[GenerateResult]:
        """Give each result the id `submit` returned and count its sample as returned."""
        for result in results:
            outer = self._outer[index].get(result.request_id)
            if outer is None:
                logger.warning(
                    "engine %d returned a sample of request %r, which was not submitted through this "
                    "EngineSet; passing it on unchanged",
                    index,
                    result.request_id,
                )
                continue
            route = self._routes[outer]
            route.live_samples -= 1
            self._live[index] -= 1
            if route.live_samples <= 0:
                del self._routes[outer]
                del self._outer[index][route.inner_id]
            result.request_id = outer
        return results

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests on their engines (unknown or finished ids are ignored); their
        samples come back from `poll` with finish_reason "abort"."""
        per_engine: list[list[str]] = [[] for _ in self.engines]
        for outer in request_ids:
            route = self._routes.get(outer)
            if route is not None:
                per_engine[route.engine].append(route.inner_id)
        for index, inner_ids in enumerate(per_engine):
            if inner_ids and index not in self.failed and index not in self.parked:
                self._guard(index, self.engines[index].abort, inner_ids)

    # --- engine state --------------------------------------------------------------------

    def pause(self) -> None:
        """Pause every engine in service; returns once none of them runs a step."""
        for index in self.in_service():
            self.engines[index].pause()

    def resume(self) -> None:
        for index in self.in_service():
            self.engines[index].resume()

    def health(self) -> EngineHealth:
        """One snapshot of the set: alive and paused only if every engine is, the lowest
        weight version, counters summed, the last update and error of the engines that
        lag (lowest version) or died; of the engines in service (none: not alive). Per engine:
        `health_per_engine()`."""
        indices = self.in_service()
        if not indices:
            return EngineHealth(alive=False, weight_version=self.weight_version,
                                error=f"every engine is out of service: {sorted(self.parked)}")
        healths = self.health_per_engine()
        version = min(h.weight_version for h in healths)
        errors = [f"engine {i}: {h.error or 'not alive'}" for i, h in zip(indices, healths) if not h.alive]
        behind = [h.last_update for h in healths if h.weight_version == version and h.last_update is not None]
        return EngineHealth(
            alive=all(h.alive for h in healths),
            weight_version=version,
            paused=all(h.paused for h in healths),
            num_running=sum(h.num_running for h in healths),
            num_waiting=sum(h.num_waiting for h in healths),
            steps=sum(h.steps for h in healths),
            generated_tokens=sum(h.generated_tokens for h in healths),
            last_update=behind[0] if behind else None,
            error="\n".join(errors) or None,
        )

    def health_per_engine(self) -> list[EngineHealth]:
        """The engines in service, in index order."""
        return [self.engines[i].health() for i in self.in_service()]

    @property
    def weight_version(self) -> int:
        """The oldest weight version any engine in service samples from (all parked: of all)."""
        return min(self.engines[i].weight_version for i in self.in_service() or range(len(self.engines)))

    def update_weights(self, weights: WeightSource, version: int) -> WeightUpdateReport:
        raise NotImplementedError(
            "EngineSet.update_weights is not supported: weights go to each engine through the weight "
            "pusher (entr_megatron.weight_sync), which updates every engine of the set itself"
        )

    def shutdown(self) -> None:
        """Shut every engine down (idempotent); the first failure is raised after all were tried."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for index, engine in enumerate(self.engines):
            try:
                engine.shutdown()
            except Exception as exc:  # keep shutting the others down
                logger.warning("engine %d failed to shut down: %s", index, exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

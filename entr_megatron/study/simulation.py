"""The planner's discrete-event simulation (the model is described in planner.py).

    plan = simulate(costs, workload, "fully_async")      # -> Plan

Every run is bounded: it processes at most `max_events` events (a decode macro-step's end or a
weight arrival; default `default_max_events`), and raises `SimulationBoundError` past that
instead of running on. A valid workload finishes far below the bound; hitting it means the
modelled loop makes no progress (a workload `Workload` would refuse, built around its checks).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from typing import Any

from entr_megatron.config.controller import SEQUENTIAL_MODES, fully_async_inflight_target
from entr_megatron.study.workload import Costs, Plan, Workload

__all__ = ["SimulationBoundError", "default_max_events", "simulate"]

EVENTS_PER_SEQUENCE = 64
"""Allowance of events per generated sequence in the default bound. A sequence ends at most one
macro-step of its engine, and a weight arrival is one event per step, so a run that makes
progress needs about 1 event per sequence (regenerated ones included); 64 leaves room for
fully_async's regenerations while still ending a run that loops without progress in seconds."""


class SimulationBoundError(RuntimeError):
    """The simulation passed its event bound without finishing its steps (no progress)."""


def default_max_events(costs: Costs, workload: Workload) -> int:
    """The event bound of a run: EVENTS_PER_SEQUENCE per sequence the run's steps need
    (steps x prompts_per_step x n), plus one weight arrival per step, at least 10 000."""
    sequences = workload.steps * workload.prompts_per_step * workload.n
    return max(10_000, EVENTS_PER_SEQUENCE * sequences + workload.steps * (costs.engines + 1))


def simulate(costs: Costs, workload: Workload, mode: str, max_events: int | None = None) -> Plan:
    """The modelled run of `workload.steps` steps in `mode` (see planner.py); at most `max_events`
    events (default `default_max_events`), SimulationBoundError past them."""
    workload.check_mode(mode)
    bound = default_max_events(costs, workload) if max_events is None else max_events
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        raise ValueError(f"max_events must be an integer >= 1, got {bound!r}")
    return _Simulation(costs, workload, mode, bound).run()


class _Group:
    __slots__ = ("id", "left", "tokens", "versions", "submit_version", "aborted")

    def __init__(self, gid: int, n: int, submit_version: int):
        self.id, self.left, self.tokens = gid, n, 0
        self.versions: list[list[int]] = []
        """Runs [version, tokens] of the group's tokens."""
        self.submit_version, self.aborted = submit_version, False

    def add(self, version: int, count: int) -> None:
        self.tokens += count
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += count
        else:
            self.versions.append([version, count])

    @property
    def oldest(self) -> int:
        return min(v for v, _ in self.versions)


class _Seq:
    __slots__ = ("group", "remaining", "prompt")

    def __init__(self, group: _Group, length: int, prompt: int):
        self.group, self.remaining, self.prompt = group, length, prompt


class _Engine:
    """Continuous batching, advanced in macro-steps: k decode steps with the same running set
    (until the first sequence finishes), one event each. Weights arriving during a macro-step
    take effect from the next decode step that starts after them (the swap is between steps)."""

    def __init__(self, costs: Costs):
        self.c, self.running, self.waiting = costs, [], deque()
        self.version, self.busy, self.busy_s, self.stall = 0, False, 0.0, 0.0
        self.k, self.start, self.first, self.step = 0, 0.0, 0.0, 0.0
        self.old: tuple[int, int] | None = None
        """(steps at the old version, old version) when weights arrived during the macro-step."""

    def plan(self, now: float) -> float:
        """Admits waiting sequences; returns the duration of the next macro-step (0: idle)."""
        prefill = 0
        self.running = [q for q in self.running if not q.group.aborted]
        while self.waiting and len(self.running) < self.c.max_batch_size:
            seq = self.waiting.popleft()
            if seq.group.aborted:
                continue
            self.running.append(seq)
            prefill += seq.prompt
        if not self.running:
            return 0.0
        self.step = self.c.decode_base_s + self.c.decode_per_seq_s * len(self.running)
        self.first = self.step + self.c.prefill_per_token_s * prefill + self.stall
        self.stall, self.start, self.old = 0.0, now, None
        self.k = min(q.remaining for q in self.running)
        return self.first + (self.k - 1) * self.step

    def new_weights(self, now: float, version: int) -> None:
        if version <= self.version:
            return
        if self.busy and self.old is None:
            elapsed = now - self.start  # decode steps started before now keep the old weights
            started = 1 if elapsed <= self.first else 1 + math.ceil((elapsed - self.first) / self.step)
            self.old = (min(started, self.k), self.version)
        self.version = version

    def finish(self) -> list[_Group]:
        """The macro-step's k tokens per running sequence (at the versions they were decoded with);
        the groups completed."""
        done, still = [], []
        for seq in self.running:
            if seq.group.aborted:
                continue
            if self.old is not None:
                seq.group.add(self.old[1], self.old[0])
                if self.k > self.old[0]:
                    seq.group.add(self.version, self.k - self.old[0])
            else:
                seq.group.add(self.version, self.k)
            seq.remaining -= self.k
            if seq.remaining == 0:
                seq.group.left -= 1
                if seq.group.left == 0:
                    done.append(seq.group)
            else:
                still.append(seq)
        self.running, self.old = still, None
        return done


class _Simulation:
    def __init__(self, costs: Costs, w: Workload, mode: str, max_events: int):
        self.c, self.w, self.mode = costs, w, mode
        self.max_events, self.events_done, self.current_step = max_events, 0, 0
        self.rng = random.Random(w.seed)
        self.engines = [_Engine(costs) for _ in range(costs.engines)]
        self.now, self.version, self.next_gid, self.rr = 0.0, 0, 0, 0
        self.inflight: dict[int, _Group] = {}
        """Groups submitted and not yet received by the controller (finished ones included)."""
        self.arrived: deque[_Group] = deque()
        """Groups the engines finished that the controller has not received yet."""
        self.finished: deque[_Group] = deque()
        """The controller's buffer: received groups not yet trained on."""
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.dropped = 0
        self.pushed_version = 0

    # ---- engines ---------------------------------------------------------------------------------
    def submit(self, count: int) -> None:
        for _ in range(count):
            group = _Group(self.next_gid, self.w.n, self.version)
            self.next_gid += 1
            self.inflight[group.id] = group
            engine = self.engines[self.rr % len(self.engines)]
            self.rr += 1
            for length in self.c.response_lengths(self.w.n, self.rng):
                engine.waiting.append(_Seq(group, length, self.c.prompt_len))
        for engine in self.engines:  # one submit call: its requests start decoding together
            self._kick(engine)

    def _kick(self, engine: _Engine) -> None:
        if not engine.busy:
            t = engine.plan(self.now)
            if t > 0:
                engine.busy = True
                engine.busy_s += t
                self._at(self.now + t, "decode", engine)

    def _at(self, t: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def advance(self) -> None:
        """Processes the next event (a macro-step's end or a weight arrival)."""
        self.events_done += 1
        if self.events_done > self.max_events:
            raise SimulationBoundError(
                f"planner: the {self.mode} simulation processed {self.max_events} events and is still in step "
                f"{self.current_step + 1} of {self.w.steps} (workload {self.w}): the modelled loop makes no progress. "
                "This is a bug or a workload outside the checked ranges; pass a larger max_events only if the "
                "workload is truly that large")
        t, _, kind, payload = heapq.heappop(self.events)
        self.now = t
        if kind == "decode":
            engine = payload
            engine.busy = False
            self.arrived.extend(g for g in engine.finish() if not g.aborted)
            self._kick(engine)
        elif kind == "weights":  # an in-flight swap stalls the next decode step; a waited one is in the wait
            version, in_flight = payload
            for engine in self.engines:
                engine.new_weights(self.now, version)
                engine.stall += self.c.swap_s if in_flight else 0.0

    def wait_until(self, condition) -> None:
        while not condition():
            if not self.events:
                raise RuntimeError("planner: nothing in flight and the condition cannot become true")
            self.advance()

    def wait_time(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            self.advance()
        self.now = max(self.now, until)

    # ---- the loops -------------------------------------------------------------------------------
    def run(self) -> Plan:
        step_s, tokens, learner_busy = [], 0, 0.0
        lags: dict[int, int] = {}  # token lag -> tokens
        step_lag: list[float] = []
        P = self.w.prompts_per_step
        if self.mode == "one_step_off":
            self.submit(P)
        for step in range(self.w.steps):
            self.current_step, t0 = step, self.now
            if self.mode in SEQUENTIAL_MODES:
                self.submit(P)
                batch = self._collect_all(P)
            elif self.mode == "one_step_off":
                batch = self._collect_all(P)
                self._push(wait=True)
                self.submit(P)
            else:
                batch = self._collect_async()
            train_s = self.c.train_overhead_s + self.c.train_per_token_s * sum(
                g.tokens + self.w.n * self.c.prompt_len for g in batch)
            learner_busy += train_s
            self.wait_time(self.now + train_s)
            if self.mode == "fixed_lag":  # by construction: segment j of a response is K + J - j old
                K, J = self.w.inter_lag, self.w.intra_lag
                stride = max(self.c.max_new_tokens // (J + 1), 1)
                for g in batch:  # segment j of T tokens: tokens [j * stride, (j + 1) * stride), the last the rest
                    T = g.tokens // self.w.n
                    for j in range(J + 1):
                        count = max(0, (min(T, (j + 1) * stride) if j < J else T) - j * stride)
                        if count:
                            lag = min(self.version, K + J - j)
                            lags[lag] = lags.get(lag, 0) + self.w.n * count
            else:
                for g in batch:
                    for version, count in g.versions:
                        lags[self.version - version] = lags.get(self.version - version, 0) + count
            tokens += sum(g.tokens for g in batch)
            step_lag.append(sum((self.version - v) * c for g in batch for v, c in g.versions)
                            / max(sum(g.tokens for g in batch), 1) if self.mode != "fixed_lag" else
                            min(self.version, self.w.inter_lag + self.w.intra_lag / 2))
            self.version += 1
            if self.mode in SEQUENTIAL_MODES:
                self._push(wait=True)
            elif self.mode == "fully_async":
                self._push(wait=False)
                self._abort_doomed()
            step_s.append(self.now - t0)
        busy = sum(e.busy_s for e in self.engines)
        return Plan(self.mode, step_s, tokens, self.now, learner_busy, min(busy, self.now * len(self.engines)),
                    len(self.engines), lags, step_lag, self.dropped)

    def _push(self, wait: bool) -> None:
        if self.version == self.pushed_version:  # the controller pushes only a new version
            return
        self.pushed_version = self.version
        arrive = self.now + self.c.push_s
        self._at(arrive, "weights", (self.version, not wait))
        if wait:
            self.wait_time(arrive + self.c.swap_s)

    def _receive(self) -> None:
        """The controller's poll: waits for a finished group when none has arrived, then takes
        every one that has (the loop receives only while it collects, not while it trains)."""
        self.wait_until(lambda: bool(self.arrived))
        while self.arrived:
            group = self.arrived.popleft()
            del self.inflight[group.id]
            self.finished.append(group)

    def _collect_all(self, count: int) -> list[_Group]:
        while len(self.finished) < count:
            self._receive()
        return [self.finished.popleft() for _ in range(count)]

    def _collect_async(self) -> list[_Group]:
        """The loop's `_collect` with its fully_async in-flight target: groups not yet received
        count as in flight, so the engines get new work only once the controller has received."""
        P, lag = self.w.prompts_per_step, self.w.max_policy_lag
        while True:
            fresh = [g for g in self.finished if g.oldest >= self.version - lag]
            stale = len(self.finished) - len(fresh)
            if stale:
                self.dropped += stale
                self.finished = deque(fresh)
            want = fully_async_inflight_target(P, lag, self.w.max_inflight_groups, len(self.finished)) \
                - len(self.inflight)
            if want > 0:
                self.submit(want)
            if len(self.finished) >= P:
                return [self.finished.popleft() for _ in range(P)]
            self._receive()

    def _abort_doomed(self) -> None:
        oldest = self.version - self.w.max_policy_lag
        for gid, group in list(self.inflight.items()):
            if group.submit_version < oldest:  # finished but not received: aborted all the same
                group.aborted = True
                del self.inflight[gid]
                self.dropped += 1
        self.arrived = deque(g for g in self.arrived if not g.aborted)

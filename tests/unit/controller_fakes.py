"""Fakes of the controller's collaborators, shared by the controller tests.

Engines: one base, `FakeEngine` (a weight version, the requests it was given, results built
alike, sample tokens a function of (seed, sample, position, weight version) only: `token`), and
one subclass per way samples finish:
- `Engine`: one request per poll; can die (a killed process) or hang (a SIGSTOPped one);
- `ClockedEngine`: one decode step per tick of a `FakeClock` (the controller-mode tests);
- `InstantEngine`: a whole request at submit, stopping at a natural length (fixed-lag tests);
- `OneTokenEngine`: one token per sample, counts its weight updates (wiring tests);
- `ManualEngine`: samples finish when the test says so (`EngineSet` tests);
- `ScriptedEngine`: scripted turns of multi-turn episodes (agent-task tests).
Also the recovery's contract without processes, a pusher that sets every engine's version, and
a learner that records its batches."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from entr_megatron.controller.rl.engines import RestartsExhausted
from entr_megatron.controller.rl.interfaces import Recovery as RecoveryBase
from entr_megatron.rollout.engine import EngineError, EngineHealth, GenerateResult, WeightUpdateReport


def token(seed: int, sample: int, position: int, version: int) -> int:
    """Token `position` of sample `sample` of a request with this seed, at this weight version."""
    return 1 + (seed * 7 + sample * 31 + position * 5 + version * 13) % 50


class FakeEngine:
    """What every fake engine shares; a subclass decides when samples finish. Request ids are the
    engine's own r0, r1, ... (as an engine may ignore the caller's), or the caller's with
    `callers_ids`."""

    callers_ids = False

    def __init__(self, version=0):
        self.version, self.requests, self.next_id = version, [], 0

    @property
    def weight_version(self):
        return self.version

    def take(self, req) -> str:
        """Record a submitted request; its id."""
        self.requests.append(req)
        rid = (req.request_id if self.callers_ids else None) or f"r{self.next_id}"
        self.next_id += 1
        return rid

    def result(self, rid, i, req, tokens, reason, logprobs=None, versions=None):
        k = len(tokens)
        return GenerateResult(rid, i, list(req.prompt_ids), list(tokens), [-0.5] * k if logprobs is None else logprobs,
                              [self.version] * k if versions is None else versions, reason,
                              group_id=req.group_id, metadata=dict(req.metadata))

    def in_flight(self) -> int:
        """Samples in flight (a weight update's `running_at_swap`)."""
        return 0

    def update_weights(self, weights, version):
        self.version = version
        return WeightUpdateReport(version, 0, 0, 0.0, 0.0, 0.0, 0.0, 0, self.in_flight())

    def health(self, timeout_s=None):
        return EngineHealth(alive=True, weight_version=self.version)

    def shutdown(self):
        pass


class Engine(FakeEngine):
    """Finishes one request per poll, every `every`-th poll only (a slow engine); uses the caller's
    request ids. `fail_after` polls it dies like a killed process, `hang_after` polls it stops
    answering (a SIGSTOPped one)."""

    callers_ids = True

    def __init__(self, version=0, fail_after=None, hang_after=None, every=1):
        super().__init__(version)
        self.fail_after, self.hang_after, self.every = fail_after, hang_after, every
        self.live, self.polls, self.error, self.hung, self.killed, self.aborted = {}, 0, None, False, False, []

    def submit(self, requests):
        if self.error:
            raise EngineError(self.error)
        ids = [self.take(r) for r in requests]
        for rid, r in zip(ids, requests):
            self.live[rid] = (r, False)
        return ids

    def poll(self, timeout=0.0):
        self.polls += 1
        if self.fail_after is not None and self.polls > self.fail_after:
            self.error = self.error or "the engine process exited (exit code -9)"
        if self.hang_after is not None and self.polls > self.hang_after:
            self.hung = True
        if self.error:
            raise EngineError(self.error)
        if self.hung or not self.live or self.polls % self.every:
            return []
        rid, (r, aborted) = next(iter(self.live.items()))
        del self.live[rid]
        so_far = len(r.prompt_ids) - 3
        out = []
        for i in range(r.params.n):
            k = 0 if aborted else r.params.max_new_tokens
            tokens = [token(r.params.seed or 0, i, so_far + p, self.version) for p in range(k)]
            out.append(self.result(rid, i, r, tokens, "abort" if aborted else "length",
                                   logprobs=[-0.25 * (1 + t % 3) for t in tokens]))
        return out

    def abort(self, ids):
        self.aborted += list(ids)
        for rid in ids:
            if rid in self.live:
                self.live[rid] = (self.live[rid][0], True)

    def die(self):
        self.error = "the engine process exited (exit code -9)"

    def hang(self):
        self.hung = True

    def health(self, timeout_s=None):
        alive = self.error is None and not self.hung
        return EngineHealth(alive=alive, weight_version=self.version, error=None if alive else self.error or "hung")

    def kill(self):
        self.killed = True
        self.error = self.error or "killed"


class FakeClock:
    """Time in ticks; every listener's `on_tick` runs at each tick, in order."""

    def __init__(self):
        self.tick, self.listeners = 0, []

    def advance(self, ticks=1):
        for _ in range(ticks):
            self.tick += 1
            for listener in self.listeners:
                listener.on_tick()


class ClockedEngine(FakeEngine):
    """Decodes one token per running sample per tick of `clock`; a poll that finds nothing finished
    waits one tick. Sample i of a request is base_len + (seed + 3 i) % jitter tokens long."""

    def __init__(self, clock, base_len=4, jitter=4):
        super().__init__()
        self.clock, self.base_len, self.jitter = clock, base_len, jitter
        self.live, self.finished = [], []
        clock.listeners.append(self)

    def in_flight(self):
        return len(self.live)

    def submit(self, requests):
        ids = []
        for req in requests:
            ids.append(rid := self.take(req))
            for i in range(req.params.n):
                length = self.base_len + (req.params.seed + 3 * i) % self.jitter
                self.live.append(dict(rid=rid, i=i, req=req, length=length, out=[], versions=[]))
        return ids

    def on_tick(self):
        still = []
        for seq in self.live:
            seq["out"].append(token(seq["req"].params.seed, seq["i"], len(seq["out"]), self.version))
            seq["versions"].append(self.version)
            (self.finished if len(seq["out"]) == seq["length"] else still).append(seq)
        self.live = still

    def poll(self, timeout=0.0):
        if not self.finished:
            self.clock.advance(1)
        out = [self.result(s["rid"], s["i"], s["req"], s["out"], "length", logprobs=[-1.0] * len(s["out"]),
                           versions=s["versions"]) for s in self.finished]
        self.finished = []
        return out

    def abort(self, request_ids):
        ids = set(request_ids)
        self.finished += [s for s in self.live if s["rid"] in ids]
        self.live = [s for s in self.live if s["rid"] not in ids]


class InstantEngine(FakeEngine):
    """Decodes a whole request at submit. A sequence stops after `natural_len(first prompt token)`
    response tokens counted from the original 3-token prompt (so a continuation stops where the
    whole would), or at the request's max_new_tokens."""

    def __init__(self, natural_len=lambda first: 10_000):
        super().__init__()
        self.natural_len, self.done = natural_len, []

    def submit(self, requests):
        ids = []
        for req in requests:
            ids.append(rid := self.take(req))
            for i in range(req.params.n):
                so_far = len(req.prompt_ids) - 3
                room = self.natural_len(req.prompt_ids[0]) - so_far
                k = min(req.params.max_new_tokens, room)
                tokens = [token(req.params.seed, i, so_far + p, self.version) for p in range(k)]
                self.done.append(self.result(rid, i, req, tokens, "stop" if k == room else "length"))
        return ids

    def poll(self, timeout=0.0):
        out, self.done = self.done, []
        return out


class OneTokenEngine(FakeEngine):
    """One token (7) per sample, at once; uses the caller's request ids; records its weight
    updates `(weights, version)` and reports a 0.01 s swap."""

    callers_ids = True

    def __init__(self, version=0):
        super().__init__(version)
        self.updates, self.done = [], []

    def submit(self, requests):
        ids = []
        for r in requests:
            ids.append(rid := self.take(r))
            self.done += [self.result(rid, i, r, [7], "stop", logprobs=[0.0]) for i in range(r.params.n)]
        return ids

    def poll(self, timeout=0.0):
        out, self.done = self.done, []
        return out

    def update_weights(self, weights, version):
        self.updates.append((weights, version))
        return WeightUpdateReport(version=version, num_tensors=1, num_bytes=4, transfer_s=0.1, swap_s=0.01,
                                  wait_s=0.0, total_s=0.1, decode_steps_during_transfer=0, running_at_swap=0)


class ManualEngine(FakeEngine):
    """Samples finish when the test says so (`finish`, or `finish_at` a monotonic time). Its health
    reports the given `alive`, `paused`, `running` and `update`; `EngineSet` must never forward a
    weight update to it."""

    def __init__(self, version=0, alive=True, paused=False, running=0, update=None):
        super().__init__(version)
        self.alive, self.paused, self.running, self.update = alive, paused, running, update
        self.live, self.ready, self.scheduled = {}, [], []
        self.poll_timeouts, self.aborted, self.shutdowns = [], [], 0

    def submit(self, requests):
        ids = [self.take(req) for req in requests]
        self.live.update(zip(ids, requests))
        return ids

    def _results(self, rid, reason):
        req = self.live.pop(rid)
        return [self.result(rid, i, req, [7], reason) for i in range(req.params.n)]

    def finish(self, rid=None):
        for r in [rid] if rid is not None else list(self.live):
            self.ready += self._results(r, "stop")

    def finish_at(self, when):
        self.scheduled.append(when)

    def poll(self, timeout=0.0):
        self.poll_timeouts.append(timeout)
        due = [t for t in self.scheduled if t <= time.monotonic() + timeout]
        if not self.ready and due:
            time.sleep(max(0.0, min(due) - time.monotonic()))
            self.scheduled.remove(min(due))
            self.finish()
        elif not self.ready and timeout:
            time.sleep(timeout)
        out, self.ready = self.ready, []
        return out

    def abort(self, request_ids):
        ids = list(request_ids)
        self.aborted.append(ids)
        for rid in ids:
            if rid in self.live:
                self.ready += self._results(rid, "abort")

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False

    def health(self, timeout_s=None):
        return EngineHealth(
            alive=self.alive, weight_version=self.version, paused=self.paused, num_running=self.running,
            steps=10, generated_tokens=100, last_update=self.update, error=None if self.alive else "died",
        )

    def update_weights(self, weights, version):
        raise AssertionError("EngineSet must not forward update_weights")

    def shutdown(self):
        self.shutdowns += 1


class ScriptedEngine(FakeEngine):
    """Answers each request with the next scripted turn of its episode (the agent-task tests).

    Episodes are recognised by their first prompt; each turn's tokens are cut after the first
    stop token (like a real engine); log-probs are distinct numbers and the weight version
    goes up by one after every submit (as if weights were updated in flight); `poll` returns
    the results out of order on purpose."""

    def __init__(self, scripts, eos_id):
        """scripts: [(first prompt ids, [turn ids, ...]), ...]."""
        super().__init__()
        self.scripts = {tuple(k): list(v) for k, v in scripts}
        self.eos_id, self.queue, self._lp = eos_id, [], itertools.count(1)

    def submit(self, requests):
        ids = []
        for req in requests:
            ids.append(rid := self.take(req))
            key = next(k for k in self.scripts if tuple(req.prompt_ids[: len(k)]) == k)
            out = self.scripts[key].pop(0)[: req.params.max_new_tokens]
            stops = set(req.params.stop_token_ids) | {self.eos_id}
            cut = next((i + 1 for i, t in enumerate(out) if t in stops), None)
            reason = "stop" if cut is not None else "length"
            out = out[:cut] if cut is not None else out
            self.queue.append(GenerateResult(
                request_id=rid, sample_index=0, prompt_ids=req.prompt_ids, output_ids=out,
                logprobs=[-0.01 * next(self._lp) for _ in out], versions=[self.version] * len(out),
                finish_reason=reason, entropy=[0.5] * len(out), group_id=req.group_id,
            ))
            self.version += 1
        return ids

    def poll(self, timeout=0.0):
        out, self.queue = self.queue[::-1], []
        return out

    def abort(self, request_ids):
        pass

    def pause(self):
        pass

    def resume(self):
        pass


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


class DeliveredPush:
    """A `PushHandle` whose version has arrived: `wait` returns at once, nothing to abandon."""

    def wait(self):
        return {}

    def abandon(self, timeout_s: float = 0.0) -> None:
        pass


class Pusher:
    """Pushes arrive at once: every engine of the set holds the newest version pushed."""

    def __init__(self, engines):
        self.engines, self.pushed = engines, []

    def push(self, version):
        self.pushed.append(version)
        for e in self.engines.engines:
            e.version = max(e.version, version)
        return DeliveredPush()


class Learner:
    """Records the batches it is given; `on_train(number of batches so far)` after each."""

    def __init__(self, on_train=None):
        self.batches, self.on_train = [], on_train

    def train(self, batch, version):
        self.batches.append(batch)
        if self.on_train is not None:
            self.on_train(len(self.batches))
        return {}

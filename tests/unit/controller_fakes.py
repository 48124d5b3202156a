"""Fakes of the controller's collaborators shared by the engine-replacement tests: an engine whose
samples are a function of (seed, sample, position, weight version) only and that can die or hang,
the recovery's contract without processes, a pusher that sets every engine's version, a learner
that records its batches."""

from __future__ import annotations

from collections.abc import Callable

from entr_megatron.controller.engines import RestartsExhausted
from entr_megatron.controller.interfaces import Recovery as RecoveryBase
from entr_megatron.rollout.engine import EngineError, EngineHealth, GenerateResult


class Engine:
    """Finishes one request per poll. Token p of sample i: a function of the request's seed, i, the
    tokens before it and the weight version; `every` k-th poll only (a slow engine). `fail_after`
    polls it dies like a killed process, `hang_after` polls it stops answering (a SIGSTOPped one)."""

    def __init__(self, version=0, fail_after=None, hang_after=None, every=1):
        self.version, self.fail_after, self.hang_after, self.every = version, fail_after, hang_after, every
        self.live, self.polls, self.error, self.hung, self.killed, self.aborted = {}, 0, None, False, False, []

    @property
    def weight_version(self):
        return self.version

    def submit(self, requests):
        if self.error:
            raise EngineError(self.error)
        for r in requests:
            self.live[r.request_id] = (r, False)
        return [r.request_id for r in requests]

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
            tokens = [1 + ((r.params.seed or 0) * 7 + i * 31 + (so_far + p) * 5 + self.version * 13) % 50
                      for p in range(k)]
            out.append(GenerateResult(rid, i, list(r.prompt_ids), tokens, [-0.25 * (1 + t % 3) for t in tokens],
                                      [self.version] * k, "abort" if aborted else "length",
                                      group_id=r.group_id, metadata=dict(r.metadata)))
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

    def update_weights(self, weights, version):
        self.version = version

    def health(self, timeout_s=None):
        alive = self.error is None and not self.hung
        return EngineHealth(alive=alive, weight_version=self.version, error=None if alive else self.error or "hung")

    def kill(self):
        self.killed = True
        self.error = self.error or "killed"

    def shutdown(self):
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

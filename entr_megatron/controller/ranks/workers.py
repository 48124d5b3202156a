"""Worker groups: one object per learner rank, every call made on all ranks at once.

    group = ProcessWorkerGroup(world_size=2, factory=make_learner_worker, args=(spec,))   # local processes
    group = RayWorkerGroup(world_size=2, factory=make_learner_worker, args=(spec,))       # Ray actors (ray_workers.py)
    metrics = group.call(LearnerWorker.train, batch, version)[0]   # blocks; a list, one result per rank
    pending = group.call_async(LearnerWorker.push, version)        # .result() later

A call names the worker's method by the method object (`LearnerWorker.train`: go-to-definition
reaches the code that runs), which travels pickled by reference and is applied to the rank's
worker; never a string looked up on the worker.

Each rank gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) before `factory(*args)` runs, so the worker joins torch.distributed
like under torchrun. Ranks ignore SIGINT: Ctrl-C reaches the driver, which
finishes the current call and saves (a rank killed mid-collective would hang the
others). When a rank fails, the call raises at once with that rank's traceback
(its peers may be stuck in a collective: `shutdown` kills them).
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch.multiprocessing as mp

from entr_megatron.utils.spawn import (
    die_with_parent,
    enter_rank,
    exit_now,
    forks_die_with_this_process,
    free_port,
    ignore_sigint,
    name_process,
    sigint_held,
    torchrun_env,
)

__all__ = ["PendingCall", "ProcessWorkerGroup", "WorkerError", "WorkerGroup", "WorkerMethod"]

POLL_S = 0.5

WorkerMethod = Callable[..., Any]
"""A method of the worker class, given unbound (`LearnerWorker.train`): each rank runs
`method(worker, *args, **kwargs)`."""


def _checked(method: WorkerMethod) -> WorkerMethod:
    """`method` if it is a function a rank can be asked to run (a worker method given by its object)."""
    if isinstance(method, str) or not callable(method) or not hasattr(method, "__qualname__"):
        raise TypeError(f"a worker call names the method object (e.g. LearnerWorker.train), got {method!r}")
    return method


def _what(method: WorkerMethod) -> str:
    return method.__qualname__


class WorkerError(RuntimeError):
    """A rank raised or died; the group is unusable afterwards."""


class PendingCall(Protocol):
    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's answer, in rank order (raises WorkerError as `call` does)."""
        ...


@runtime_checkable
class WorkerGroup(Protocol):
    """What each launcher's group offers (local processes, Ray actors): what RemoteLearner and
    RemotePusher (controller/ranks/remote.py) call."""

    name: str
    world_size: int

    def wait_ready(self) -> WorkerGroup:
        """Blocks until every rank built its worker."""
        ...

    def call(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(worker, *args, **kwargs)` on every rank's worker at once; their answers in rank order."""
        ...

    def call_async(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> PendingCall:
        """As `call`, without waiting; one call in flight at a time."""
        ...

    def raise_if_dead(self, what: str, grace_s: float = 1.0) -> None:
        """Raises WorkerError (naming `what`) if a rank has died, else returns."""
        ...

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stops the ranks (kills those that do not stop in time)."""
        ...


def _serve(rank: int, env: dict, threads: int | None, factory: Callable, args: tuple, conn) -> None:
    """A local rank: build the worker, then run calls until told to stop."""
    die_with_parent()  # the driver killed outright takes its ranks with it
    forks_die_with_this_process()  # and a rank killed outright its checkpoint writers (they hold the job's pipes)
    name_process(f"entr-rank{rank}")
    ignore_sigint()  # started with SIGINT held (`sigint_held`): a Ctrl-C while importing stays quiet
    enter_rank(env, threads)
    worker = None
    try:
        worker = factory(*args)
        conn.send(("ok", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, a, kw = msg
            try:
                conn.send(("ok", method(worker, *a, **kw)))
            except BaseException as e:  # noqa: BLE001 - reported to the driver
                conn.send(_failure(e))
    except (EOFError, BrokenPipeError):
        pass  # the driver went away
    except BaseException:  # noqa: BLE001 - construction failed
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if worker is not None and hasattr(worker, "shutdown"):
            try:
                worker.shutdown()
            except BaseException:  # noqa: BLE001 - the process ends anyway
                pass
        conn.close()
        exit_now(0)  # the driver learns of failures through the pipe


def _failure(error: BaseException) -> tuple[str, Any]:
    """A call's error for the driver: a CheckpointError (a save that found the disk full, ...) as
    itself, which the job reports in one line and the rank survives; anything else as the rank's
    traceback (a WorkerError: the group is done)."""
    from entr_megatron.checkpoint.directory import CheckpointError

    if isinstance(error, CheckpointError):
        try:
            pickle.dumps(error)
            return "raise", error
        except Exception:  # noqa: BLE001 - an error that does not travel goes as its traceback
            pass
    return "error", traceback.format_exc()


class _ProcessPending:
    def __init__(self, group: ProcessWorkerGroup, what: str):
        self.group, self.what = group, what
        self._results: list[Any] | None = None

    def result(self, timeout: float | None = None) -> list[Any]:
        if self._results is None:
            self._results = self.group._collect(self.what, timeout)
        return self._results


class ProcessWorkerGroup:
    """Ranks as local spawned processes (the default launcher)."""

    def __init__(self, world_size: int, factory: Callable, args: tuple = (), *, threads_per_rank: int | None = None,
                 master_addr: str = "127.0.0.1", startup_timeout_s: float = 900.0, name: str = "learner",
                 wait: bool = True):
        """Spawns the ranks; with `wait` (the default) also waits until each built its worker,
        else `wait_ready` does (the ranks start meanwhile: calls are refused until then)."""
        self.world_size, self.name = world_size, name
        ctx = mp.get_context("spawn")
        port = free_port()
        self._procs, self._conns = [], []
        self._busy = False
        with sigint_held():
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                env = torchrun_env(rank, world_size, master_addr, port)
                proc = ctx.Process(target=_serve, args=(rank, env, threads_per_rank, factory, args, child),
                                   name=f"{name}-rank{rank}", daemon=False)  # Megatron's checkpoint writer forks
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        self._busy = True
        self._startup_timeout_s: float | None = startup_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> ProcessWorkerGroup:
        """Blocks until every rank built its worker (once; a failed start shuts the group down)."""
        if self._startup_timeout_s is not None:
            timeout, self._startup_timeout_s = self._startup_timeout_s, None
            try:
                self._collect("startup", timeout)
            except BaseException:
                self.shutdown()
                raise
        return self

    def call_async(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> _ProcessPending:
        _checked(method)
        if self._startup_timeout_s is not None:
            raise RuntimeError(f"{self.name} group: still starting (call wait_ready first)")
        if self._busy:
            raise RuntimeError(f"{self.name} group: a call is still in flight (take its result first)")
        for conn in self._conns:
            conn.send((method, args, kwargs))
        self._busy = True
        return _ProcessPending(self, _what(method))

    def call(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call_async(method, *args, **kwargs).result()

    def _collect(self, what: str, timeout: float | None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, Any] = {}
        raised: dict[int, BaseException] = {}  # errors the ranks raised as themselves (`_failure`)
        while len(results) < self.world_size:
            waiting = [c for r, c in enumerate(self._conns) if r not in results]
            ready = multiprocessing.connection.wait(waiting, timeout=POLL_S)
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._dead(rank, what)
                if status == "error":
                    raise WorkerError(f"{self.name} rank {rank} failed in {what}:\n{payload}")
                if status == "raise":
                    raised[rank] = payload
                results[rank] = payload
            for rank, proc in enumerate(self._procs):
                if rank not in results and not proc.is_alive() and not self._conns[rank].poll():
                    self._dead(rank, what)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"{self.name} group: {what} did not finish within {timeout:.0f} s "
                                  f"(ranks done: {sorted(results)})")
        self._busy = False
        if raised:  # every rank answered (the group stays usable): the lowest rank's error, rank 0's the fullest
            raise raised[min(raised)]
        return [results[r] for r in range(self.world_size)]

    def raise_if_dead(self, what: str, grace_s: float = 1.0) -> None:
        """Raises WorkerError (as a call would) if a rank's process has died; waits up to
        `grace_s` for one to show as dead (a peer can see the broken connection first)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self._procs):
                if not proc.is_alive():
                    self._dead(rank, what)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _dead(self, rank: int, what: str):
        self._procs[rank].join(10)  # the pipe closes before the process is reaped
        code = self._procs[rank].exitcode
        raise WorkerError(f"{self.name} rank {rank} died during {what} (exit code {code}; "
                          "a negative code is the signal that killed it, e.g. -9: out of memory)")

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stops the ranks (their `shutdown` runs); kills those that do not exit in time."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not self._busy:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + (timeout_s if not self._busy else 0)
        for proc in self._procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

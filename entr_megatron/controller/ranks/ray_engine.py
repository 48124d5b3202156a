"""An embedded engine placed by Ray: the engine lives in a Ray actor (on whichever node
Ray picks), the controller holds a `RolloutEngine` proxy that forwards every call.

    engine = RayEngine(EmbeddedEngineConfig(model_dir=...), num_cpus=1)
    engine.submit([...]); engine.poll(timeout=1.0)
    engine.update_weights(receiver, version)      # the actor's engine joins the broadcast groups
    engine.health(timeout_s=60); engine.kill()    # what EngineRecovery (wiring.py) needs to replace it

The actor runs calls concurrently (`max_concurrency`): `update_weights` blocks
until the swap while `poll` and `submit` keep flowing, as with a local engine.
The model directory must be readable on the actor's node (a shared file system
on a cluster, as for the learner's checkpoints).

Failures look like a local engine's, so that wiring.EngineRecovery replaces an actor as it
replaces a process: an actor that died (its process killed, its node lost) or that does not
answer a call within `answer_timeout_s` (the run's rollout.embedded.health_timeout_s; weights:
the engine's `update_timeout_s`) raises EngineError, and `health(timeout_s)` says not alive; the
engine's own errors arrive as Ray raised them (RayTaskError(EngineError) is an EngineError).
A poll never loses samples: one not answered within its wait returns nothing, and its answer
comes with the next poll (a stalled actor is then found by the controller's silence check,
rollout.poll_timeout_s, and `health`). `kill` is Ray's (no restart by Ray: a new actor takes
its place, with the learner's weights).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from entr_megatron.rollout.engine import (
    EngineError,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    WeightUpdateReport,
)

__all__ = ["RayEngine"]

ACTOR_CONCURRENCY = 6
"""Calls one engine actor serves at once: a pending poll, update_weights, one controller call
(submit, abort, health...), and room for calls left behind by a stalled moment."""


class _EngineActor:
    def __init__(self, config: Any):
        import ray

        from entr_megatron.rollout.embedded import EmbeddedEngine
        from entr_megatron.utils.node_address import set_node_address

        # before the engine's process starts (it inherits it): its weight groups' gloo pairs listen here
        set_node_address(ray.util.get_node_ip_address())
        self.engine = EmbeddedEngine(config)

    def describe(self) -> tuple[int, str, int]:
        """(weight version, node address, pid): the proxy's start call."""
        import ray

        return self.engine.weight_version, ray.util.get_node_ip_address(), os.getpid()

    def submit(self, requests):
        return self.engine.submit(requests)

    def poll(self, timeout):
        return self.engine.poll(timeout=timeout)

    def abort(self, ids):
        self.engine.abort(ids)

    def pause(self):
        self.engine.pause()

    def resume(self):
        self.engine.resume()

    def health(self, timeout_s):
        return self.engine.health(timeout_s=timeout_s)

    def update_weights(self, weights, version):
        return self.engine.update_weights(weights, version)

    def cancel_weight_update(self):
        self.engine.cancel_weight_update()

    def forget_version(self):
        self.engine.forget_version()

    def shutdown(self):
        self.engine.shutdown()


class RayEngine:
    """`RolloutEngine` proxy of an embedded engine in a Ray actor (see the module docstring)."""

    def __init__(self, config: Any, *, num_cpus: float = 1.0, num_gpus: float = 0.0, scheduling_strategy: Any = None,
                 resources: dict[str, float] | None = None, startup_timeout_s: float | None = None,
                 answer_timeout_s: float | None = None, ray_module: Any = None, wait: bool = True):
        """Starts the actor and waits until its engine loaded the model (`startup_timeout_s`,
        default `config.startup_timeout_s`, counted from here); raises EngineError (the actor
        killed) if it did not. `wait=False` returns at once: `wait_ready` waits, so that several
        engines load at the same time, as local ones do.
        `answer_timeout_s` (default `config.rpc_timeout_s`): how long a call (submit, abort,
        pause, health...) may go unanswered before it raises EngineError; a local engine's
        submit and abort never wait, so wiring gives rollout.embedded.health_timeout_s.
        `resources`: custom Ray resources the actor needs (launcher.ray_engine_resources), and
        `scheduling_strategy` Ray's ("SPREAD": one engine per node while nodes are left).
        `ray_module`: the `ray` package (a test passes a fake)."""
        if ray_module is None:
            import ray as ray_module
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": ACTOR_CONCURRENCY}
        if scheduling_strategy is not None:
            options["scheduling_strategy"] = scheduling_strategy
        if resources:
            options["resources"] = dict(resources)
        self.config = config
        self._ray = ray_module
        self._rpc_s = float(config.rpc_timeout_s if answer_timeout_s is None else answer_timeout_s)
        self._poll_ref: Any = None  # a poll not yet collected (its samples are the next poll's)
        self._killed = self._closed = False
        self.where = "not started"
        """The actor's pid and node, for messages."""
        self.node: str | None = None
        """The address of the actor's node (once it started)."""
        self._version: int | None = None  # the engine's, once it told it (wait_ready)
        self._actor = ray_module.remote(_EngineActor).options(**options).remote(config)
        self._start = self._actor.describe.remote()
        self._start_s = float(startup_timeout_s or config.startup_timeout_s)
        self._start_by = time.monotonic() + self._start_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> RayEngine:
        """Waits until the engine loaded the model (within the start timeout, counted from the
        constructor); raises EngineError, the actor killed, if it did not. Returns self."""
        if self._start is None:
            return self
        try:
            version, ip, pid = self._get(self._start, max(self._start_by - time.monotonic(), 0.0),
                                         f"its start ({self._start_s:g} s from its launch)")
        except BaseException:
            self.kill()
            raise
        self._start = None
        self._version = version
        self.node, self.where = ip, f"pid {pid} on {ip}"
        return self

    def __repr__(self) -> str:
        return f"RayEngine({self.where})"

    def _get(self, ref: Any, timeout: float | None, what: str) -> Any:
        """`ray.get(ref)`; a dead or silent actor raises EngineError, the engine's own errors pass."""
        errors = self._ray.exceptions
        try:
            return self._ray.get(ref, timeout=timeout)
        except errors.RayTaskError:
            raise  # the method raised: RayTaskError(EngineError) is an EngineError, (ValueError) a ValueError
        except errors.GetTimeoutError as e:
            raise EngineError(f"the Ray engine actor ({self.where}) did not answer {what} within {timeout:g} s") from e
        except errors.RayError as e:  # RayActorError (died, unreachable), a crashed worker, a lost object
            raise EngineError(f"{e}\nthe Ray engine actor ({self.where}) died ({what}: {type(e).__name__})") from e

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        return self._get(self._actor.submit.remote(list(requests)), self._rpc_s, "submit")

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        """Finished samples, waiting up to `timeout` s (None: forever); an actor that does not
        answer in time gives nothing now, and its answer comes with a later poll."""
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if self._poll_ref is None:
                self._poll_ref = self._actor.poll.remote(left)
            ready, _ = self._ray.wait([self._poll_ref], timeout=left)
            if not ready:
                return []
            ref, self._poll_ref = self._poll_ref, None
            results = self._get(ref, None, "poll")
            if results or (deadline is not None and time.monotonic() >= deadline):
                return results  # (an earlier, shorter poll's empty answer: wait on with a new one)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._get(self._actor.abort.remote(list(request_ids)), self._rpc_s, "abort")

    def pause(self) -> None:
        self._get(self._actor.pause.remote(), self._rpc_s, "pause")

    def resume(self) -> None:
        self._get(self._actor.resume.remote(), self._rpc_s, "resume")

    def health(self, timeout_s: float | None = None) -> EngineHealth:
        """The engine's state; not alive when the actor died or it did not answer within
        `timeout_s` (None: `answer_timeout_s`). Never raises."""
        timeout = self._rpc_s if timeout_s is None else float(timeout_s)
        if self._killed or self._closed:
            return EngineHealth(alive=False, weight_version=self._version, error=f"the Ray engine actor ({self.where}) "
                                "was killed" if self._killed else "the engine was shut down")
        try:
            return self._get(self._actor.health.remote(timeout), timeout, "a health check")
        except Exception as e:  # noqa: BLE001 - health never raises
            return EngineHealth(alive=False, weight_version=self._version, error=str(e))

    def kill(self) -> None:
        """Kill the actor (one that stopped answering; Ray SIGKILLs its process, and the engine
        process dies with it); its calls then fail as if it died. Never raises."""
        self._killed = True
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    @property
    def weight_version(self) -> int:
        """The version the engine samples from (kept here: the actor tells it with each update)."""
        return self._version

    def update_weights(self, weights: Any, version: int) -> WeightUpdateReport:
        report = self._get(self._actor.update_weights.remote(weights, version),
                           self.config.update_timeout_s + self._rpc_s, f"the update to weight version {version}")
        self._version = version
        return report

    def cancel_weight_update(self) -> None:
        """EmbeddedEngine.cancel_weight_update, in the actor. Never raises (a dead actor's update
        fails by itself)."""
        if self._killed or self._closed:
            return
        try:
            self._get(self._actor.cancel_weight_update.remote(), self._rpc_s, "cancel_weight_update")
        except Exception:  # noqa: BLE001 - dead or silent: its update fails or times out on its own
            pass

    def forget_version(self) -> None:
        """EmbeddedEngine.forget_version, in the actor."""
        self._get(self._actor.forget_version.remote(), self._rpc_s, "forget_version")

    def shutdown(self) -> None:
        """Stop the engine and the actor (a killed one is not asked); idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        if not self._killed:
            try:
                self._get(self._actor.shutdown.remote(), self._rpc_s, "shutdown")
            except Exception:  # noqa: BLE001 - killed below
                pass
        self.kill()

"""An embedded engine placed by Ray: the engine lives in a Ray actor (on whichever node
Ray picks), the controller holds a `RolloutEngine` proxy that forwards every call.

    engine = RayEngine(EmbeddedEngineConfig(model_dir=...), num_cpus=1)
    engine.submit([...]); engine.poll(timeout=1.0)
    engine.update_weights(receiver, version)      # the actor's engine joins the broadcast groups

The actor runs calls concurrently (`max_concurrency`): `update_weights` blocks
until the swap while `poll` and `submit` keep flowing, as with a local engine.
The model directory must be readable on the actor's node (a shared file system
on a cluster, as for the learner's checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from entr_megatron.rollout.engine import EngineHealth, GenerateRequest, GenerateResult, WeightUpdateReport

__all__ = ["RayEngine"]

ACTOR_CONCURRENCY = 4
"""Calls one engine actor serves at once: update_weights + poll + submit/abort + health."""


class _EngineActor:
    def __init__(self, config: Any):
        from entr_megatron.rollout.embedded import EmbeddedEngine

        self.engine = EmbeddedEngine(config)

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

    def health(self):
        return self.engine.health()

    def weight_version(self):
        return self.engine.weight_version

    def update_weights(self, weights, version):
        return self.engine.update_weights(weights, version)

    def forget_version(self):
        self.engine.forget_version()

    def shutdown(self):
        self.engine.shutdown()


class RayEngine:
    """`RolloutEngine` proxy of an embedded engine in a Ray actor (see the module docstring)."""

    def __init__(self, config: Any, *, num_cpus: float = 1.0, num_gpus: float = 0.0, scheduling_strategy: Any = None,
                 startup_timeout_s: float = 600.0):
        import ray

        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": ACTOR_CONCURRENCY}
        if scheduling_strategy is not None:
            options["scheduling_strategy"] = scheduling_strategy
        self._ray = ray
        self._actor = ray.remote(_EngineActor).options(**options).remote(config)
        self._timeout = startup_timeout_s
        self._get(self._actor.weight_version.remote(), timeout=startup_timeout_s)  # raises if start failed
        self._closed = False

    def _get(self, ref, timeout: float | None = None):
        return self._ray.get(ref, timeout=timeout)

    def submit(self, requests: Sequence[GenerateRequest]) -> list[str]:
        return self._get(self._actor.submit.remote(list(requests)))

    def poll(self, timeout: float | None = 0.0) -> list[GenerateResult]:
        return self._get(self._actor.poll.remote(timeout))

    def abort(self, request_ids: Iterable[str]) -> None:
        self._get(self._actor.abort.remote(list(request_ids)))

    def pause(self) -> None:
        self._get(self._actor.pause.remote())

    def resume(self) -> None:
        self._get(self._actor.resume.remote())

    def health(self) -> EngineHealth:
        try:
            return self._get(self._actor.health.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - health never raises
            return EngineHealth(alive=False, weight_version=-1, error=f"Ray engine actor unreachable: {e}")

    @property
    def weight_version(self) -> int:
        return self._get(self._actor.weight_version.remote())

    def update_weights(self, weights: Any, version: int) -> WeightUpdateReport:
        return self._get(self._actor.update_weights.remote(weights, version))

    def forget_version(self) -> None:
        """EmbeddedEngine.forget_version, in the actor."""
        self._get(self._actor.forget_version.remote(), timeout=60)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._get(self._actor.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - killed below
            pass
        self._ray.kill(self._actor)

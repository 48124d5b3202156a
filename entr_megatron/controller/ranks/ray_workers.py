"""Learner ranks as Ray actors: the Ray launcher's worker group (controller/ranks/workers.py has the
interface and the local one).

    group = RayWorkerGroup(2, make_learner_worker, (spec,), ray_address="10.0.0.1:6379",
                           resources={"learner": 1})       # one bundle per rank, packed on the nodes that offer it
    group.nodes                                            # ["10.0.0.3", "10.0.0.3"]: each rank's node address
    group.call(LearnerWorker.train, batch, version)        # as the local group

Each rank knows its node's address (Ray's) before anything else runs: rank 0's becomes
MASTER_ADDR, its rendezvous store and every gloo pair of every rank listen on their own node's
address (`utils.node_address`), and the rendezvous port is one free on rank 0's node. A rank
whose node left the cluster (the node died, its raylet stopped) fails the call with
`LearnerNodeLost`, which names the node; a placement group the live nodes cannot hold says what
it waits for.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from entr_megatron.controller.ranks.workers import POLL_S, WorkerError, WorkerMethod, _checked, _what
from entr_megatron.utils.console import say
from entr_megatron.utils.node_address import set_node_address
from entr_megatron.utils.ray_connect import connect_ray
from entr_megatron.utils.spawn import enter_rank, forks_die_with_this_process, free_port, torchrun_env

__all__ = ["LearnerNodeLost", "RayWorkerGroup", "live_node_addresses", "node_lost"]

NODE_PROBE_S = 2.0
"""How long a failed rank's node may take to accept a TCP connection to its raylet before it
counts as lost (Ray's own health checks take seconds to half a minute to say so)."""


class LearnerNodeLost(WorkerError):
    """A learner rank died with its node (the node left the Ray cluster)."""


def live_node_addresses(ray: Any) -> set[str]:
    """The addresses of the nodes Ray holds alive now."""
    return {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def node_lost(ray: Any, address: str, probe_s: float = NODE_PROBE_S) -> bool:
    """Whether the node at `address` left the cluster: Ray says it is dead, or its raylet does not
    accept a connection within `probe_s` (Ray has not noticed yet). False when Ray cannot be asked."""
    try:
        nodes = [n for n in ray.nodes() if n["NodeManagerAddress"] == address]
    except Exception:  # noqa: BLE001 - the GCS itself is gone: nothing known about the node
        return False
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        return True
    try:
        with socket.create_connection((address, int(alive[0]["NodeManagerPort"])), timeout=probe_s):
            return False
    except OSError:
        return True


class _RayRank:
    """A rank as a Ray actor (wrapped with `ray.remote` when the group is built)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A port free on this node's address (rank 0's rendezvous port)."""
        return free_port(host=self.node_ip())

    def start(self, env: dict, threads: int | None, factory: Callable, args: tuple) -> int:
        set_node_address(self.node_ip())  # gloo pairs and stores on this node's address, before any group
        enter_rank(env, threads, loopback_gloo=False)
        forks_die_with_this_process()  # else a rank killed while its checkpoint writers run is not seen dead
        self.worker = factory(*args)
        return os.getpid()

    def call(self, method: WorkerMethod, args: tuple, kwargs: dict) -> Any:
        return method(self.worker, *args, **kwargs)

    def stop(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None and hasattr(worker, "shutdown"):
            worker.shutdown()
        self.worker = None


class _RayPending:
    def __init__(self, group: RayWorkerGroup, refs: list, what: str):
        self.group, self.refs, self.what = group, refs, what
        self._results: list[Any] | None = None

    def result(self, timeout: float | None = None) -> list[Any]:
        if self._results is None:
            self._results = self.group._get(self.refs, self.what, timeout)
        return self._results


def _placeable(bundle: Mapping[str, float], count: int, nodes: list[dict]) -> bool:
    """Whether `count` bundles fit on the live `nodes` (each node's totals, bundles never split)."""
    fits = 0
    for node in nodes:
        if node.get("Alive"):
            have = node.get("Resources", {})
            fits += int(min((have.get(k, 0.0) + 1e-9) // v for k, v in bundle.items() if v > 0))
    return fits >= count


class RayWorkerGroup:
    """Ranks as Ray actors in one placement group (one bundle per rank, packed onto few nodes).

    `ray_address`: an existing cluster ("auto", "HOST:6379", "ray://host:10001") or None to start a
    local one. `resources`: custom Ray resources each rank's bundle needs besides its CPUs and GPUs
    (launcher.ray_learner_resources). Rank 0's node address and a port free there become
    MASTER_ADDR / MASTER_PORT. `env_from_driver`: names of environment variables copied from this
    process into every rank's environment (actors on other nodes inherit nothing from it), e.g.
    rollout.sglang.api_key_env. They travel as an argument of the rank's start call, not in Ray's
    runtime_env (which the Ray dashboard shows).
    """

    def __init__(self, world_size: int, factory: Callable, args: tuple = (), *, threads_per_rank: int | None = None,
                 gpus_per_rank: float = 0.0, ray_address: str | None = None, startup_timeout_s: float = 900.0,
                 name: str = "learner", placement_strategy: str = "PACK", env_from_driver: Sequence[str] = (),
                 resources: Mapping[str, float] | None = None):
        ray = connect_ray(ray_address, log_to_driver=True)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size, self.name = world_size, name
        self._broken = False  # a call failed: shutdown kills without asking
        cpus = float(threads_per_rank or 1)
        bundle = {"CPU": cpus, **({"GPU": gpus_per_rank} if gpus_per_rank else {}), **dict(resources or {})}
        if not _placeable(bundle, world_size, ray.nodes()):
            say(f"{name}: the live Ray nodes cannot hold {world_size} x {bundle} now (launcher.nproc_per_node, "
                "cpu_threads_per_rank, ray_learner_resources); waiting up to "
                f"{startup_timeout_s:.0f} s for nodes that offer them to join")
        self._pg = placement_group([bundle] * world_size, strategy=placement_strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=startup_timeout_s)
        if not ready:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            have = sorted((n["NodeManagerAddress"], n.get("Resources", {})) for n in ray.nodes() if n.get("Alive"))
            raise WorkerError(f"{name}: Ray could not place {world_size} x {bundle} within {startup_timeout_s:.0f} s; "
                              f"the live nodes offer {have}")
        actor_cls = ray.remote(_RayRank)
        self._actors = [
            actor_cls.options(
                num_cpus=cpus, num_gpus=gpus_per_rank, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
            ).remote()
            for i in range(world_size)
        ]
        ips = ray.get([a.node_ip.remote() for a in self._actors], timeout=startup_timeout_s)
        master, port = ips[0], ray.get(self._actors[0].free_port.remote(), timeout=startup_timeout_s)
        self.nodes: list[str] = ips
        """Each rank's node address."""
        self.master = f"{master}:{port}"
        """Rank 0's rendezvous store (MASTER_ADDR:MASTER_PORT)."""
        self.driver_node: str = ray.util.get_node_ip_address()
        """The address of this process's (the driver's) Ray node."""
        local_rank: dict[str, int] = {}
        refs = []
        for rank, (actor, ip) in enumerate(zip(self._actors, ips)):
            lr = local_rank.get(ip, 0)
            local_rank[ip] = lr + 1
            env = torchrun_env(rank, world_size, master, port, local_rank=lr, local_world_size=ips.count(ip))
            env.update({k: os.environ[k] for k in env_from_driver if k in os.environ})
            refs.append(actor.start.remote(env, threads_per_rank, factory, args))
        self._busy = False
        try:
            self.pids: list[int] = self._get(refs, "startup", startup_timeout_s)
            """Each rank's process id (on its node)."""
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> RayWorkerGroup:
        """The ranks are ready when the constructor returns (the same interface as the local group)."""
        return self

    def where(self) -> str:
        """Where the ranks run, for the log: "rank 0 pid 123 on 10.0.0.3, ..."."""
        return ", ".join(f"rank {r} pid {pid} on {ip}" for r, (pid, ip) in enumerate(zip(self.pids, self.nodes)))

    def raise_if_dead(self, what: str, grace_s: float = 1.0) -> None:
        """Raises WorkerError if a rank's actor has died (its cheap `node_ip` call fails within
        `grace_s`), LearnerNodeLost if a rank that did not answer is on a node that left the
        cluster (Ray may take half a minute to fail calls to actors of a killed node; its raylet
        refuses at once); a rank busy in a call answers late, which counts as alive."""
        import ray

        refs = [a.node_ip.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a dead actor: re-raised with the rank
                    self._broken = True
                    raise self._failure(rank, f"died during {what}", e) from e
        probed: dict[str, bool] = {}
        for rank, ref in enumerate(refs):
            node = self.nodes[rank]
            if ref in ready:
                continue
            if node not in probed:
                probed[node] = node_lost(ray, node)
            if probed[node]:
                self._broken = True
                raise self._node_lost(rank, f"died during {what}", node, "Ray has not failed the rank's calls yet")

    def _failure(self, rank: int, what: str, error: Exception) -> WorkerError:
        """The error of rank `rank` that failed (`what`): LearnerNodeLost when its node left the cluster."""
        import ray

        node = self.nodes[rank] if rank < len(getattr(self, "nodes", [])) else None
        if node is not None and isinstance(error, ray.exceptions.RayActorError) and node_lost(ray, node):
            return self._node_lost(rank, what, node, str(error))
        return WorkerError(f"{self.name} rank {rank} {what}:\n{error}")

    def _node_lost(self, rank: int, what: str, node: str, detail: str) -> LearnerNodeLost:
        """The one message for a rank lost with its node (the job's log and the tests read it)."""
        return LearnerNodeLost(f"{self.name} rank {rank} {what}: its node {node} left the Ray cluster "
                               f"(the machine died or its raylet stopped)\n{detail}")

    def call_async(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> _RayPending:
        _checked(method)
        return _RayPending(self, [a.call.remote(method, args, kwargs) for a in self._actors], _what(method))

    def call(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call_async(method, *args, **kwargs).result()

    def _get(self, refs: Sequence, what: str, timeout: float | None) -> list[Any]:
        import ray

        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for rank, ref in enumerate(refs):
                if ref not in pending:
                    try:
                        ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - re-raised with the rank
                        self._broken = True
                        raise self._failure(rank, f"failed in {what}", e) from e
            if deadline is not None and time.monotonic() > deadline:
                self._broken = True
                raise WorkerError(f"{self.name} group: {what} did not finish within {timeout:.0f} s")
        return ray.get(list(refs))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stops the ranks (their `shutdown` runs) and kills the actors; after a failed call they
        are killed at once (a rank's peers may be stuck in a collective, behind which `stop` would
        wait). Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._pg is None:
            return
        if not self._broken:
            try:
                ray.get([a.stop.remote() for a in self._actors], timeout=timeout_s)
            except Exception:  # noqa: BLE001 - killed below
                pass
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        remove_placement_group(self._pg)
        self._pg = None

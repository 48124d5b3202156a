"""The pieces of many-node runs that need no cluster: where gloo listens once a process knows its
node (utils/node_address.py), ports free on a given address, the launcher's Ray placement fields,
whether a placement group fits the live nodes and whether a failed rank's node is lost
(controller/ranks/ray_workers.py), and the loopback cluster's node specs (utils/ray_nodes.py)."""

from __future__ import annotations

import socket

import psutil
import pytest

from entr_megatron.config.loader import load_config
from entr_megatron.utils import node_address
from entr_megatron.utils.spawn import free_port, free_port_range, run_gloo

NODE = "127.0.0.3"


def test_gloo_listens_on_the_node_address_once_known_else_as_before(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv(node_address.NODE_ADDRESS_ENV, raising=False)
    assert node_address.gloo_address("127.0.0.1") == "127.0.0.1"  # a local job: loopback, as before
    assert node_address.gloo_address("10.0.0.1") is None  # a cluster without a node address: gloo's choice
    monkeypatch.setenv(node_address.NODE_ADDRESS_ENV, NODE)
    assert node_address.node_address() == NODE
    assert node_address.gloo_address("127.0.0.2") == NODE  # its own node's, not the master's
    assert node_address.gloo_address("10.0.0.1") == NODE
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert node_address.gloo_address("127.0.0.2") is None  # the variable wins (gloo reads it)


def _ranks_listen_on_the_node(rank: int, world: int, node: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # run_gloo's ranks are pinned to loopback; a node address frees them
    node_address.set_node_address(node)
    group = dist.new_group([0, 1], backend="gloo")  # Megatron makes its groups this way
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [3.0] * 4
    # what torch builds its gloo groups with is still torch's class for every isinstance check
    assert issubclass(dist.distributed_c10d.ProcessGroupGloo, torch._C._distributed_c10d.ProcessGroupGloo)
    mine = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert node in mine, mine
    dist.barrier(group=group)


def test_set_node_address_binds_torch_distributed_gloo_groups_there():
    run_gloo(_ranks_listen_on_the_node, 2, NODE, timeout_s=180)


def test_free_ports_are_checked_on_the_address_given():
    port = free_port(host=NODE)
    with socket.socket() as s:
        s.bind((NODE, port))
    base = free_port_range(3, host=NODE)
    for p in range(base, base + 3):
        with socket.socket() as s:
            s.bind((NODE, p))


@pytest.mark.parametrize("override, rule", [
    ("launcher.ray_learner_resources={CPU: 1}", "'CPU' is set by Ray itself"),
    ("launcher.ray_engine_resources={engine: 0}", "amounts > 0"),
    ("launcher.ray_engine_resources=[engine]", "mapping of custom Ray resource names"),
    ("launcher.ray_engine_strategy=PACK", "allowed: SPREAD, DEFAULT"),
])
def test_ray_placement_fields_are_checked_naming_the_field(override, rule):
    field = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"{field}=.* is not valid; .*{rule}"):
        load_config(None, ["launcher.kind=ray", override])
    with pytest.raises(ValueError, match=rf"launcher.ray_learner_resources=.*only used with launcher.kind='ray'"):
        load_config(None, ["launcher.ray_learner_resources={learner: 1}"])
    cfg = load_config(None, ["launcher.kind=ray", "launcher.ray_learner_resources={learner: 1}",
                             "launcher.ray_engine_resources={engine: 2}"])
    assert cfg.launcher.ray_learner_resources == {"learner": 1.0} and cfg.launcher.ray_engine_resources == {"engine": 2.0}
    assert cfg.launcher.ray_engine_strategy == "SPREAD"


def test_a_placement_group_fits_only_whole_bundles_on_live_nodes():
    from entr_megatron.controller.ranks.ray_workers import _placeable

    a = {"Alive": True, "Resources": {"CPU": 2.0, "learner": 2.0}}
    b = {"Alive": True, "Resources": {"CPU": 3.0, "engine": 2.0}}
    dead = {"Alive": False, "Resources": {"CPU": 8.0, "learner": 8.0}}
    bundle = {"CPU": 1.0, "learner": 1.0}
    assert _placeable(bundle, 2, [a, b, dead])
    assert not _placeable(bundle, 3, [a, b, dead])  # the dead node's resources count for nothing
    assert not _placeable({"CPU": 1.5, "learner": 1.0}, 2, [a, b])  # bundles are never split across nodes
    assert _placeable({"CPU": 1.0}, 5, [a, b])


class FakeRay:
    def __init__(self, nodes):
        self._nodes = nodes

    def nodes(self):
        return self._nodes


def test_a_failed_ranks_node_is_lost_when_ray_says_dead_or_its_raylet_refuses():
    from entr_megatron.controller.ranks.ray_workers import node_lost

    with socket.socket() as listening:
        listening.bind((NODE, 0))
        listening.listen()
        port = listening.getsockname()[1]
        alive = {"NodeManagerAddress": NODE, "NodeManagerPort": port, "Alive": True}
        assert not node_lost(FakeRay([alive]), NODE)
        assert node_lost(FakeRay([{**alive, "Alive": False}]), NODE)  # Ray called it dead
        assert node_lost(FakeRay([]), NODE)  # not in the cluster at all
    assert node_lost(FakeRay([alive]), NODE, probe_s=1.0)  # the raylet's port refuses: Ray has not noticed yet

    class Gone(FakeRay):
        def nodes(self):
            raise ConnectionError("the GCS is gone")

    assert not node_lost(Gone([]), NODE)  # nothing known: not called lost


def test_a_rank_that_does_not_answer_on_a_node_that_left_is_called_lost_before_ray_notices(monkeypatch):
    """The learner node SIGKILLed mid-push: the engines' broadcast breaks at once, while Ray takes
    up to half a minute to fail calls to the node's actors. `raise_if_dead` must name the node
    then (its raylet refuses), not let the engines' error stand; a rank that is only busy (its
    node answers) is alive."""
    import ray

    from entr_megatron.controller.ranks import ray_workers

    class Actor:
        class node_ip:  # noqa: N801 - Ray's call syntax: actor.method.remote()
            @staticmethod
            def remote():
                return object()

    def make_group(nodes):
        group = object.__new__(ray_workers.RayWorkerGroup)
        group.name, group.nodes, group._broken, group._actors = "learner", nodes, False, [Actor() for _ in nodes]
        return group

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: ([], list(refs)))  # nobody answers
    probes = []

    def lost(_ray, node, probe_s=ray_workers.NODE_PROBE_S):
        probes.append(node)
        return node == "127.0.0.3"

    monkeypatch.setattr(ray_workers, "node_lost", lost)
    make_group(["127.0.0.4", "127.0.0.4"]).raise_if_dead("a push")  # busy ranks on a live node: alive
    assert probes == ["127.0.0.4"]  # one probe per node, not per rank
    group = make_group(["127.0.0.4", "127.0.0.3"])
    with pytest.raises(ray_workers.LearnerNodeLost,
                       match=r"learner rank 1 died during the push of weight version 3: its node 127\.0\.0\.3 left"):
        group.raise_if_dead("the push of weight version 3")
    assert group._broken  # shutdown then kills without asking the dead ranks


def test_loopback_nodes_take_loopback_addresses_only():
    from entr_megatron.utils.ray_nodes import LoopbackCluster, RayNode

    for address, rule in [("10.0.0.2", "not a loopback address"), ("node-b", "not an IP address"),
                          ("::1", "not a loopback address")]:
        with pytest.raises(ValueError, match=rule):
            RayNode("b", address)
    with pytest.raises(ValueError, match="unique"):
        LoopbackCluster([RayNode("h", "127.0.0.2"), RayNode("b", "127.0.0.2")], ray="ray")


def _join(rank: int, port: int, world: int, sleep_s: float, queue) -> None:
    import time

    import torch

    from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup

    spec = WeightGroup("127.0.0.1", port, world, "g", "gloo", tuple(range(1, world)), streams=2)
    t0 = time.monotonic()
    try:  # the learner (rank 0, the store's host) joins without a join timeout, as in a run
        group = BroadcastGroup.join(spec, rank, timeout_s=600, join_timeout_s=None if rank == 0 else 3)
    except Exception as e:  # noqa: BLE001 - reported
        queue.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))
        return
    t = torch.full((4,), 7.0 if rank == 0 else 0.0)
    time.sleep(sleep_s)  # the sender waits past the join timeout: the collective's own timeout applies
    group.broadcast(t)
    queue.put((rank, t.tolist(), time.monotonic() - t0))


def test_an_engine_gives_up_a_join_that_a_dead_member_holds_not_a_slow_transfer():
    """weight_sync.receiver.JOIN_TIMEOUT_S: a member that died before joining (its node lost as
    the group's first version went out) held an engine's join, and the updates queued behind it,
    for the whole push timeout (600 s seen); the join has its own timeout, the transfer keeps its own."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_join, args=(r, port, 3, 0.0, queue), daemon=True) for r in (0, 1)]  # rank 2 never
    for p in procs:
        p.start()
    rank, error, took = queue.get(timeout=300)  # (spawned processes import torch: slow on a busy machine)
    assert rank == 1 and "timeout" in error and took < 30, (rank, error, took)
    procs[1].join(60)  # it ends by itself: killed while its queue's feeder thread writes, the queue's
    procs[0].kill()    # lock would stay held and the next put block forever
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_join, args=(r, port, 2, 6.0 if r == 0 else 0.0, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=300) for _ in procs)
    assert [g[1] for g in got] == [[7.0] * 4, [7.0] * 4], got  # a broadcast 6 s after a 3 s join timeout arrives
    for p in procs:
        p.join(30)

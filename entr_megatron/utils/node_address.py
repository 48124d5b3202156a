"""This process's node address: the one address its node advertises, where what it serves listens.

    set_node_address("10.0.0.3")      # a Ray actor, first thing: Ray's address of its node
    node_address()                    # "10.0.0.3" here and in every process started from here
    gloo_address("10.0.0.1")          # where this process's gloo pairs listen in a group whose master is there

A process that knows its node (a learner rank or an engine placed by Ray: `ray.util.get_node_ip_address()`)
says so once; the address goes into the environment (ENTR_NODE_ADDRESS), so the processes it starts
(an embedded engine's, Megatron's checkpoint writers) know it too. Then every gloo pair of the process
listens on that address: the weight groups' (`weight_sync/group.py` asks `gloo_address`) and
torch.distributed's own groups, Megatron's included (`set_node_address` makes torch's gloo groups,
which otherwise take the host name's address or GLOO_SOCKET_IFNAME's interface, bind it). Stores
bind the address their clients dial (`utils.spawn.tcp_store`), which is a node address already.

GLOO_SOCKET_IFNAME, when set, wins everywhere (gloo's own rule, for a cluster's fabric). A process
that was told nothing (a local job) keeps the behaviour it had: loopback when the master is, else
gloo's choice.
"""

from __future__ import annotations

import datetime
import os

from entr_megatron.utils.spawn import bind_ip, is_loopback

__all__ = ["NODE_ADDRESS_ENV", "gloo_address", "node_address", "set_node_address"]

NODE_ADDRESS_ENV = "ENTR_NODE_ADDRESS"
"""Where this process's node address travels to the processes it starts."""
_GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_BOUND: list[str] = []  # the address torch's gloo groups of this process were bound to, if any


def node_address() -> str | None:
    """The address this process's node advertises, if a launcher said (`set_node_address`)."""
    return os.environ.get(NODE_ADDRESS_ENV) or None


def gloo_address(master_address: str) -> str | None:
    """Where this process's gloo pairs listen in a group whose store is at `master_address`: None
    (gloo's own choice) with GLOO_SOCKET_IFNAME set; else this node's address when known; else
    loopback when the master is loopback (every rank dials it there); else None."""
    if os.environ.get(_GLOO_IFNAME_ENV):
        return None
    mine = node_address()
    if mine is not None:
        return mine
    return bind_ip(master_address) if is_loopback(master_address) else None


def set_node_address(address: str) -> None:
    """This process (and those it starts) runs on the node `address`: its gloo groups listen there
    from now on, torch.distributed's (the learner's, Megatron's) included, unless GLOO_SOCKET_IFNAME
    is set. Idempotent."""
    os.environ[NODE_ADDRESS_ENV] = address
    if not os.environ.get(_GLOO_IFNAME_ENV):
        _bind_torch_gloo(address)


def _bind_torch_gloo(address: str) -> None:
    """torch.distributed creates each gloo group's device from the host name (or GLOO_SOCKET_IFNAME);
    from here on it creates them on `address`: the class it builds groups with becomes a subclass
    whose constructor passes a device bound there (isinstance checks hold: it is still a
    ProcessGroupGloo)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _BOUND:
        _BOUND[0] = address
        return
    base = dist.ProcessGroupGloo

    class NodeBoundGloo(base):  # type: ignore[misc, valid-type]
        def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     options=None):
            if options is None:
                options = base._Options()
                options._timeout = timeout
                options._devices = [base.create_device(hostname=_BOUND[0])]
                options._threads = 2  # torch's own constructor's
            super().__init__(store, rank, size, options)

    _BOUND.append(address)
    c10d.ProcessGroupGloo = NodeBoundGloo

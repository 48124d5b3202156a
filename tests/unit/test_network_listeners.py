"""What our TCP listeners bind: loopback for a one-node run, never every interface unless asked.

Checked on the sockets themselves: the listening address of this process's (or a child's)
sockets as the kernel reports it (psutil), and a connection attempt to the same port on a
non-loopback address of this machine, which must be refused. torch's own TCPStore binds
every interface whatever host it is given (pinned down by the first test); `tcp_store` hands
it a socket bound where its clients dial instead.
"""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import torch
import torch.distributed as dist

from entr_megatron.utils.spawn import free_port, serve_rendezvous, tcp_store
from entr_megatron.weight_sync.group import BroadcastGroup, stage_groups

TIMEOUT = datetime.timedelta(seconds=30)


def listening(pid: int | None = None, port: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets `pid` (None: this process) listens on."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {(c.laddr.ip, c.laddr.port) for c in conns
            if c.status == psutil.CONN_LISTEN and (port is None or c.laddr.port == port)}


def other_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None: it has none)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def assert_loopback_only(port: int, pid: int | None = None) -> None:
    addrs = listening(pid, port)
    assert addrs and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in addrs), addrs
    assert reachable("127.0.0.1", port)
    other = other_address()
    if other is not None:
        assert not reachable(other, port), f"{other}:{port} accepts connections"


def test_torch_tcpstore_alone_listens_on_every_interface():
    """The finding behind `tcp_store` (torch 2.13, libuv and legacy backends): the host name a
    server store is given is not where it listens."""
    for libuv in (True, False):
        store = dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, use_libuv=libuv)
        assert {ip for ip, _ in listening(port=store.port)} <= {"::", "0.0.0.0"}, listening(port=store.port)
        del store


def test_tcp_store_listens_where_its_clients_dial():
    master = tcp_store("127.0.0.1", 0, 2, True, TIMEOUT, wait_for_workers=False)
    assert_loopback_only(master.port)
    client = tcp_store("127.0.0.1", master.port, 2, False, TIMEOUT)
    client.set("k", "v")
    assert master.get("k") == b"v"
    # multi-tenant: a second master of this process on the port shares the first one's server
    a = tcp_store("127.0.0.1", free_port(), None, True, TIMEOUT, multi_tenant=True, wait_for_workers=False)
    b = tcp_store("127.0.0.1", a.port, None, True, TIMEOUT, multi_tenant=True, wait_for_workers=False)
    a.set("shared", "1")
    assert b.get("shared") == b"1"
    assert_loopback_only(a.port)
    del master, client, a, b


def test_every_interface_only_when_asked():
    store = tcp_store("127.0.0.1", 0, 1, True, TIMEOUT, bind_address="0.0.0.0")
    assert {ip for ip, _ in listening(port=store.port)} <= {"::", "0.0.0.0"}
    del store


def test_weight_group_store_and_gloo_pairs_listen_on_loopback():
    before = listening()
    (spec,) = stage_groups("127.0.0.1", free_port(), 1, (1,), backend="gloo", streams=2)
    groups: dict[int, BroadcastGroup] = {}

    def join(rank):
        groups[rank] = BroadcastGroup.join(spec, rank, timeout_s=30)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert set(groups) == {0, 1}
        assert_loopback_only(spec.master_port)
        new = listening() - before  # the store and every gloo pair's listener
        assert len(new) >= 2 and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in new), new
        sent, got = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
        threads = [threading.Thread(target=groups[0].broadcast, args=(sent,)),
                   threading.Thread(target=groups[1].broadcast, args=(got,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert torch.equal(sent, got)
    finally:
        for g in groups.values():
            g.close()


RANK0 = textwrap.dedent("""
    import json, sys, psutil, torch.distributed as dist
    from entr_megatron.utils.spawn import enter_rank, torchrun_env
    port = int(sys.argv[1])
    enter_rank(torchrun_env(0, 1, "127.0.0.1", port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.barrier()
    conns = psutil.Process().net_connections(kind="tcp")
    print(json.dumps(sorted({(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN})))
    dist.destroy_process_group()
""")


def test_rank_zero_rendezvous_store_listens_on_master_addr_only():
    """`enter_rank` on rank 0 serves torch.distributed's rendezvous on MASTER_ADDR; the process
    group (tcp:// init, multi-tenant store) takes that server over."""
    port = free_port()
    out = subprocess.run([sys.executable, "-c", RANK0, str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    addrs = {tuple(a) for a in json.loads(out.stdout.strip().splitlines()[-1])}
    assert ("127.0.0.1", port) in addrs and all(ip == "127.0.0.1" for ip, _ in addrs), addrs


def test_serve_rendezvous_leaves_wildcards_and_taken_ports_to_torch():
    assert not serve_rendezvous("0.0.0.0", free_port())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not serve_rendezvous("127.0.0.1", s.getsockname()[1])  # someone else's: torch reports it
    with pytest.raises(OSError):
        tcp_store("127.0.0.1", 0, 1, True, TIMEOUT, bind_address="192.0.2.254")  # not an address of this host

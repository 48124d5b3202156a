"""Spawn a local gloo process group: many ranks on one machine, for tests and tools.

Megatron code and our collectives run unchanged on CPU over gloo, so multi-rank
behaviour is tested by spawning ``world_size`` processes here rather than on a
cluster. The function must be importable by name (module level), because spawned
children re-import it.

`torchrun_env` / `enter_rank` are the one place a rank's torchrun variables are
written: for these ranks and for the controller's worker groups (processes, Ray).

Listening sockets. torch's `TCPStore` server (libuv and legacy backends alike, torch
2.13) binds the wildcard address, every interface, IPv4 and IPv6, whatever host name
it is given: the name only tells the clients where to dial. It takes over a socket we
bound ourselves (`master_listen_fd`), so `tcp_store` binds the address its clients dial
(`bind_address` says otherwise) and hands that socket over: a store for 127.0.0.1
listens on loopback only. `enter_rank` does the same for torch.distributed's own
rendezvous store (`serve_rendezvous`, on rank 0). gloo listens on the address of its
device (GLOO_SOCKET_IFNAME, else the host name's address). None of them authenticates
its peers.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import ipaddress
import logging
import multiprocessing.util
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from multiprocessing import resource_tracker
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from entr_megatron.utils.megatron_warnings import quiet_megatron_fallbacks

__all__ = [
    "ALL_INTERFACES",
    "LOOPBACK",
    "available_cores",
    "bind_ip",
    "die_with_parent",
    "exit_now",
    "name_process",
    "enter_rank",
    "free_port",
    "free_port_range",
    "is_loopback",
    "listening_socket",
    "run_gloo",
    "serve_rendezvous",
    "tcp_store",
    "torchrun_env",
]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = ("", "0.0.0.0", "::", "*")
"""Bind addresses that mean every interface: the only way to get torch's own (wildcard) bind."""
LISTEN_BACKLOG = 4096
"""What torch's own TCPStore sockets use (a rendezvous of many ranks connects at once)."""
RENDEZVOUS_TIMEOUT_S = 1800.0
"""`serve_rendezvous`: timeout of the store's own client (torch.distributed's default for gloo)."""

_RENDEZVOUS: dict[int, Any] = {}
"""port -> the TCPStore `serve_rendezvous` keeps alive for this process's lifetime."""


_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, or None where there is none (not Linux)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies, however it dies (Linux
    PR_SET_PDEATHSIG; a no-op elsewhere). Called first thing in every child the job starts (ranks,
    engines, a study's cells), so a job killed outright
    leaves no orphans. The parent must be the main thread of its process (the kernel counts a
    thread's exit as the parent's death)."""
    prctl = _prctl()
    if prctl is not None:  # (elsewhere children of a job killed outright may outlive it)
        prctl(_PR_SET_PDEATHSIG, int(sig))


def forks_die_with_this_process() -> None:
    """From now on every process forked from this one gets `die_with_parent` (SIGKILL when this
    process dies). Every learner rank needs it: the children it forks (Megatron's checkpoint
    writers) inherit its sockets and pipes. Under Ray, while they live Ray does not see the actor
    die (a learner rank killed during a save went unnoticed for minutes, until Ray's keepalive gave
    up); in a local job, they outlive a rank killed during a save and keep the job's stdout and
    stderr open after it exits. The fork must come from the main thread, which a local rank's
    call loop and Ray's synchronous actors run their calls on (see `die_with_parent`)."""
    prctl = _prctl()  # looked up here, not in each forked child
    if prctl is not None:
        os.register_at_fork(after_in_child=lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)))


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT blocked in this thread for the block: children started in it inherit the blocked
    signal through fork and exec, so a Ctrl-C while they import (before they call `ignore_sigint`)
    stays pending in them instead of printing a KeyboardInterrupt traceback from each; here it is
    delivered when the block ends. A no-op where there is no signal mask (not POSIX)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    resource_tracker.ensure_running()  # started by the first spawn, it unblocks SIGINT after its own start
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_sigint() -> None:
    """First thing in a child started under `sigint_held` that leaves Ctrl-C to its parent: SIGINT
    ignored, then unblocked (a pending one is discarded)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def exit_now(code: int = 0) -> NoReturn:
    """End this spawned worker process now: multiprocessing's own exit steps (its finalizers:
    queues flushed, semaphores released; children joined), stdout and stderr flushed, then
    `os._exit`, skipping the interpreter's teardown (torch's operator-library finalizers alone
    take ~2 s of CPU in a process that imported torch and transformers). Only for workers whose
    other resources (process groups, files) were released already: atexit handlers do not run."""
    multiprocessing.util._exit_function()  # what multiprocessing's bootstrap runs last in a child
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def name_process(name: str) -> None:
    """This process's name in ps, top and psutil (Linux PR_SET_NAME, 15 bytes at most; a no-op
    elsewhere), so that an operator (or a fault test) tells the job's processes apart."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the process keeps its interpreter's name


LISTEN_PORTS_LOW = 10000
"""Lowest port `free_port` picks; it picks below the kernel's ephemeral range."""
_PORT_PICKS = random.SystemRandom()  # never seeded: two jobs starting at once must not draw alike


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; 32768-60999 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(attempts: int = 64, host: str = LOOPBACK) -> int:
    """A TCP port on `host` (an address of this machine) that was free a moment ago, drawn at
    random below the kernel's ephemeral range. A port between its check and its use is not held: drawing it from the
    ephemeral range (bind to port 0) let any outgoing connection of another job on the host take
    it as its local port meanwhile, and two jobs starting together could be handed the same
    recently freed port (seen: two study cells' weight stores on one port, a connection reset,
    a push that never arrived). Falls back to the kernel's choice when no drawn port is free."""
    low = LISTEN_PORTS_LOW
    high = min(_ephemeral_range()[0], 65536) - 1
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts if high > low else 0):
        port = _PORT_PICKS.randint(low, high)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(count: int, attempts: int = 100, host: str = LOOPBACK) -> int:
    """The first of `count` consecutive TCP ports on `host` (an address of this machine) that were
    all free a moment ago (e.g. one weight-sync group per pipeline stage on `base + stage`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts):
        base = free_port(host=host)
        if base + count > 65536:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found in {attempts} attempts")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost" (a name that resolves to loopback is not: on other nodes it may not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_ip(host: str) -> str | None:
    """The IP a server whose clients dial `host` listens on: the IP itself, or what the name resolves
    to here ("localhost": 127.0.0.1); None for `ALL_INTERFACES`."""
    if host in ALL_INTERFACES:
        return None
    if host == "localhost":
        return LOOPBACK
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    ip = infos[0][4][0]
    if ipaddress.ip_address(ip).is_loopback:
        logger.warning("%s resolves to %s here: a server for it listens on loopback only, which other "
                       "nodes cannot reach (give an IP address)", host, ip)
    return ip


def listening_socket(ip: str, port: int) -> socket.socket:
    """A TCP socket bound to (ip, port) and listening (SO_REUSEADDR, as torch's own)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store(host: str, port: int, world_size: int | None, is_master: bool, timeout: datetime.timedelta, *,
              bind_address: str | None = None, multi_tenant: bool = False, wait_for_workers: bool = True):
    """A `dist.TCPStore` at host:port. The server (is_master) listens on `bind_address` only (None:
    `host`, the address its clients dial; one of `ALL_INTERFACES`: every interface, torch's own bind).

    multi_tenant: another master store of this process on the same port shares its server (torch
    keeps one per port); a port already bound here is then left to torch to reuse."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout, multi_tenant=multi_tenant)
    ip = bind_ip(host if bind_address is None else bind_address)
    if ip is None:
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                             multi_tenant=multi_tenant)
    try:
        sock = listening_socket(ip, port)
    except OSError as e:
        if multi_tenant and port and e.errno == errno.EADDRINUSE:
            # Either this process already serves the port (torch hands back that server) or
            # another one does (torch raises its own "address already in use").
            return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                                 multi_tenant=True)
        raise
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store's server owns (and closes) it from here on
    return dist.TCPStore(host, bound_port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                         multi_tenant=multi_tenant, master_listen_fd=fd)


def serve_rendezvous(master_addr: str, master_port: int) -> bool:
    """Start torch.distributed's rendezvous server of this process (rank 0) on `master_addr` only.

    `init_process_group` (tcp:// and env://) opens its store multi-tenant, so rank 0's takes over
    this server instead of binding every interface itself. The server stays until the process
    exits. Returns False (torch binds as it does) when the address is a wildcard, the port is
    taken, or the address is not one of this host's."""
    if master_port in _RENDEZVOUS:
        return True
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return False  # torchrun's agent serves the store; the ranks are all clients
    try:
        if bind_ip(master_addr) is None:
            return False
        store = tcp_store(master_addr, master_port, None, True, datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                          multi_tenant=True, wait_for_workers=False)
    except (OSError, RuntimeError) as e:  # torch's DistNetworkError is a RuntimeError
        logger.warning("rendezvous store not bound to %s:%s (%s): torch.distributed binds it on every interface",
                       master_addr, master_port, e)
        return False
    _RENDEZVOUS[master_port] = store
    return True


def torchrun_env(rank: int, world_size: int, master_addr: str, master_port: int, *,
                 local_rank: int | None = None, local_world_size: int | None = None) -> dict[str, str]:
    """The variables torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), so a rank started any other way joins torch.distributed alike.

    Local rank and local world size default to the global ones: all ranks on one machine.
    """
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    }


def enter_rank(env: Mapping[str, str], threads: int | None = None, *, loopback_gloo: bool = True,
               bind_rendezvous: bool = True) -> None:
    """Make this process a rank: export `env` (see `torchrun_env`) and give torch `threads`
    intra-op threads (None or 0: torch's default).

    With `loopback_gloo` and rank 0 on 127.0.0.1, gloo is pinned to the loopback interface
    (unless GLOO_SOCKET_IFNAME is already set): its own choice, the host name's address, may
    be an interface the loopback rendezvous cannot reach. With `bind_rendezvous`, rank 0 starts
    the rendezvous store on MASTER_ADDR only (`serve_rendezvous`), not on every interface.
    Megatron's known fallback warnings are silenced here (utils/megatron_warnings.py).
    """
    quiet_megatron_fallbacks()  # a rank's own copy of the driver's filters (they are per process)
    os.environ.update(env)
    if loopback_gloo and env.get("MASTER_ADDR") == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if bind_rendezvous and env.get("RANK") == "0" and env.get("MASTER_ADDR") and env.get("MASTER_PORT", "").isdigit():
        serve_rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if threads:
        torch.set_num_threads(threads)


def _child(rank: int, fn: Callable, world_size: int, port: int, threads: int, args: tuple) -> None:
    ignore_sigint()  # started with SIGINT held (`run_gloo`): Ctrl-C is the parent's, which ends the ranks
    enter_rank(torchrun_env(rank, world_size, LOOPBACK, port), threads)
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now(0)  # a failure above raises instead: torch's wrapper reports it to the parent


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's limit), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0, threads: int | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Raises the first child's exception (with its traceback) or ``TimeoutError``
    after ``timeout_s``; the children are terminated in both cases. Each child
    gets ``threads`` intra-op threads (default: cores divided among ranks).
    """
    threads = threads or max(1, available_cores() // world_size)
    with sigint_held():  # a Ctrl-C while they import stays quiet in them
        ctx = mp.start_processes(
            _child, args=(fn, world_size, free_port(), threads, args), nprocs=world_size,
            join=False, start_method="spawn",
        )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} gloo ranks running {fn.__qualname__} did not finish in {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()

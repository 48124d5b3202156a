"""Spawn a local gloo process group: many ranks on one machine, for tests and tools.

Megatron code and our collectives run unchanged on CPU over gloo, so multi-rank
behaviour is tested by spawning ``world_size`` processes here rather than on a
cluster. The function must be importable by name (module level), because spawned
children re-import it.

`torchrun_env` / `enter_rank` are the one place a rank's torchrun variables are
written: for these ranks and for the controller's worker groups (processes, Ray).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["enter_rank", "free_port", "free_port_range", "run_gloo", "torchrun_env"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int, attempts: int = 100) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that were all free a moment ago
    (e.g. one weight-sync group per pipeline stage on `base + stage`)."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65536:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found in {attempts} attempts")


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


def enter_rank(env: Mapping[str, str], threads: int | None = None, *, loopback_gloo: bool = True) -> None:
    """Make this process a rank: export `env` (see `torchrun_env`) and give torch `threads`
    intra-op threads (None or 0: torch's default).

    With `loopback_gloo` and rank 0 on 127.0.0.1, gloo is pinned to the loopback interface
    (unless GLOO_SOCKET_IFNAME is already set): its own choice, the host name's address, may
    be an interface the loopback rendezvous cannot reach.
    """
    os.environ.update(env)
    if loopback_gloo and env.get("MASTER_ADDR") == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        torch.set_num_threads(threads)


def _child(rank: int, fn: Callable, world_size: int, port: int, threads: int, args: tuple) -> None:
    enter_rank(torchrun_env(rank, world_size, LOOPBACK, port), threads)
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0, threads: int | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Raises the first child's exception (with its traceback) or ``TimeoutError``
    after ``timeout_s``; the children are terminated in both cases. Each child
    gets ``threads`` intra-op threads (default: cores divided among ranks).
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
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

"""Stops a launched server's process group once the process that launched it is gone.

    python -I orphan_guard.py OWNER_PID OWNER_START PGID      # started by launcher.ManagedProcess

A server runs in a session of its own (so that terminating it ends its scheduler and
detokenizer too), which also means a `train` killed with SIGKILL, or by the OOM killer, leaves
its servers running: on CPU some 3 GB of memory and a port each, until someone finds them.
`PR_SET_PDEATHSIG` cannot help: it fires when the launching *thread* ends, and servers are
started from worker threads too. So each server gets this small watcher, in a session of its
own as well: once a second it checks that the owner (pid and start time, so a reused pid is no
owner) is alive, and when it is not, SIGTERMs the server's group, then SIGKILLs what is left
after `GRACE_S`. It ends by itself when the server's group is gone. Run by path with `-I`: it
imports only the standard library (no package `__init__`, no torch).
"""

from __future__ import annotations

import os
import signal
import sys
import time

INTERVAL_S = 1.0
GRACE_S = 10.0


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat, clock ticks since boot), or
    None when there is no such process or it has exited (a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_start_time(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


def parse_start_time(stat: str) -> str | None:
    """Field 22 of a /proc/PID/stat line, None for an exited process (state Z or X). The command
    name (field 2) may hold spaces and parentheses, so the fields are counted from the last ')'."""
    fields = stat[stat.rindex(")") + 2:].split()  # fields 3.. after "pid (comm) "
    return None if fields[0] in ("Z", "X") else fields[19]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(owner_pid: int, owner_start: str, pgid: int, interval_s: float = INTERVAL_S,
          grace_s: float = GRACE_S) -> bool:
    """Wait until the group `pgid` is gone (returns False) or the owner is (stops the group,
    returns True)."""
    while group_alive(pgid):
        if start_time(owner_pid) != owner_start:
            stop_group(pgid, grace_s)
            return True
        time.sleep(interval_s)
    return False


def stop_group(pgid: int, grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: orphan_guard.py OWNER_PID OWNER_START PGID", file=sys.stderr)
        return 2
    watch(int(argv[0]), argv[1], int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

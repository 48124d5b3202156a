"""A launched server does not outlive a `train` killed with SIGKILL (rollout/sglang/orphan_guard.py):
the server's process group (a stand-in: a sleeping process and its child, in a session of their
own as ManagedProcess starts every server) is stopped once its owner is gone, and only then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from entr_megatron.rollout.sglang import orphan_guard
from entr_megatron.rollout.sglang.launcher import ManagedProcess

# a "server" that starts a child of its own (as SGLang's scheduler), both sleeping
SERVER = [sys.executable, "-c", "import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if orphan_guard.start_time(pid) is None:  # no such process, or a zombie
            return True
        time.sleep(0.1)
    return False


def _group(pgid: int) -> list[int]:
    """The live members of process group `pgid` (zombies left out)."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(entry)) == pgid and orphan_guard.start_time(int(entry)) is not None:
                pids.append(int(entry))
        except OSError:  # gone while listed
            continue
    return pids


def test_parse_start_time_counts_fields_after_the_command_name():
    # field 22 is the start time; the command name may hold spaces and parentheses
    fields = [str(n) for n in range(3, 53)]
    fields[0] = "S"
    stat = "4242 (a (weird) name) " + " ".join(fields)
    assert orphan_guard.parse_start_time(stat) == "22"
    assert orphan_guard.parse_start_time(stat.replace(") S ", ") Z ")) is None  # exited, not yet reaped
    assert orphan_guard.start_time(os.getpid()) == orphan_guard.start_time(os.getpid()) is not None
    assert orphan_guard.start_time(2**22 + 12345) is None  # above pid_max: no such process


def test_a_killed_owner_takes_its_servers_with_it(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from entr_megatron.rollout.sglang.launcher import ManagedProcess\n"
         f"p = ManagedProcess('server', {SERVER!r}, 'http://127.0.0.1:1', {str(tmp_path / 'server.log')!r})\n"
         "print(p.pid, p._guard.pid, flush=True)\n"
         "time.sleep(600)\n"], stdout=subprocess.PIPE, text=True)
    try:
        server, guard = map(int, owner.stdout.readline().split())
        deadline = time.monotonic() + 30
        while len(_group(server)) < 2 and time.monotonic() < deadline:  # the server and its child
            time.sleep(0.1)
        members = _group(server)
        assert len(members) == 2, members
        time.sleep(2 * orphan_guard.INTERVAL_S)
        assert _group(server) == members  # the owner lives: the guard leaves the group alone
        owner.send_signal(signal.SIGKILL)  # not reaped until the end: a zombie owner is gone too
        assert all(_gone(pid, 5 + orphan_guard.GRACE_S) for pid in members), _group(server)
        assert _gone(guard, 5)  # and the guard ends with its work done
    finally:
        owner.kill()
        owner.wait(10)
        for pid in _group(server) if "server" in locals() else []:
            os.kill(pid, signal.SIGKILL)


def test_terminate_stops_the_guard_and_a_server_that_exits_ends_it(tmp_path):
    p = ManagedProcess("server", SERVER, "http://127.0.0.1:1", tmp_path / "a.log")
    assert p._guard is not None and p._guard.poll() is None
    p.terminate(grace_s=5)
    assert p._guard.poll() is not None and not _group(p.pid)
    q = ManagedProcess("short", [sys.executable, "-c", "pass"], "http://127.0.0.1:1", tmp_path / "b.log")
    q.proc.wait(10)
    try:
        q._guard.wait(5 + orphan_guard.INTERVAL_S)  # the group is gone: nothing left to guard
    except subprocess.TimeoutExpired:
        pytest.fail("the guard of an exited server did not end")

"""One job per run directory: an exclusive lock held for the job's lifetime.

    with RunLock(run_dir):            # RunLockedError at once when another live job holds it
        ...                           # the whole job

The lock is ``run_dir/.lock``, an advisory ``flock`` on an open file that also holds the holder's
pid, host and start time (JSON). The kernel drops a ``flock`` when its process dies, however it
dies, so a lock left by a killed job is never stale: the next job simply takes it (and says
whose it was). A file system that refuses ``flock`` is an error naming it, not a silent
unguarded run.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

__all__ = ["LOCK_FILE", "RunLock", "RunLockedError"]

LOCK_FILE = ".lock"


class RunLockedError(RuntimeError):
    """Another live job holds the run directory's lock (the message names it), or the lock cannot
    be taken there (a read-only directory, a file system without flock)."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (command: {holder.get('command', '?')}, since {when})"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text() or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


class RunLock:
    """Exclusive lock of `run_dir` for one job (see the module docstring); a context manager."""

    def __init__(self, run_dir: str | os.PathLike, command: str = "train", flag: str = "--run-dir"):
        self.path = Path(run_dir) / LOCK_FILE
        self.command = command
        self.flag = flag
        """The command-line flag that chooses the directory (named in the errors' advice)."""
        self._fd: int | None = None
        self.previous: dict = {}
        """What the lock file said before this job took it (a job that died), {} when new."""

    def acquire(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunLockedError(f"cannot create {self.path}: {e.strerror}; the directory must be writable "
                                 f"(use another {self.flag})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(
                f"{self.path.parent} is in use by another job: {_describe(_read(self.path))}. Wait for it to "
                f"finish or stop it (Ctrl-C saves and exits), or use another {self.flag}") from None
        except OSError as e:  # a file system without flock
            os.close(fd)
            raise RunLockedError(f"cannot lock {self.path} ({e.strerror}): this file system does not support "
                                 f"flock; use a directory ({self.flag}) on a local or flock-capable file system") from None
        self.previous = _read(self.path)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command, "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an unheld lock file says nobody holds it
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

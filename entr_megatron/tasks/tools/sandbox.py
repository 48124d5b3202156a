"""A sandboxed `python` tool: model-written code runs in a throw-away child with hard limits.

    PythonSandbox().run("print(6*7)")   # SandboxResult(stdout="42\\n", exit_code=0, killed=None, ...)
    PythonTool()(code="1/0")            # "ZeroDivisionError: division by zero"

Layers, outermost first:

- parent (this module): a fresh directory per run (`sandbox-*` in the system temp dir: `work/`
  is the scratch directory, cwd, HOME and TMPDIR of the code; `root/` the mount point of the
  private root; all removed afterwards), a whitelisted environment (no inherited secrets), a
  new session killed as a whole (`killpg`) on the wall-clock limit or once the output is far
  past its cap; stdout and stderr are read by threads that keep a bounded head and tail, so the
  parent's memory stays bounded whatever the child prints;
- stage 1 (`sandbox_launcher.py`): user + network + mount + pid namespaces and a private root
  built by the kernel: a read-only tmpfs holding only the scratch directory (a tmpfs of
  `max_scratch_mb` and SCRATCH_INODES files, read-write, noexec), read-only binds of the
  interpreter, its standard library (without ctypes and its kin), the directories of the shared
  libraries it maps and its ELF loader, and /dev/null, zero, random, urandom; `pivot_root` into
  it, the host's root detached; rlimits (CPU, address space, file size, open files, no core,
  processes), no_new_privs, a seccomp filter refusing every new process and thread (for the
  host's root too), a pid-1 reaper so every process the code starts dies with it;
- stage 2 (`sandbox_guard.py`): an audit hook refusing processes, signals, sockets other than
  AF_UNIX pairs, threads, ctypes/cffi, foreign extension modules, and file access outside
  scratch and the standard library; then the code runs with fresh globals.

Contained by the kernel (whatever opens the file: `open`, `readline.read_history_file`,
`sqlite3.connect`, `mmap`, `zipimport`, `dbm`, `shelve`, native code): every file outside the
private root is absent: /etc but ld.so.cache (so /etc/passwd, /etc/shadow, and
`pwd.getpwall()` finds no account), /root and /home (but the path to the interpreter's prefix
where it lives there, e.g. pyenv's), /proc, /sys, the project and its runs, other sandboxes'
scratch directories; writes anywhere but scratch (read-only mounts), and there at most
`max_scratch_mb` in all; the network (an empty network namespace); other processes (pid
namespace); new processes and threads (seccomp); ctypes (its module is not in the private root).
Not contained: reads of what the private root shows (the interpreter's prefix, the directories
of the shared libraries it maps, e.g. /usr/lib/x86_64-linux-gnu: installed software, no user's
data); stat/existence checks inside it; CPU and memory the child takes within its limits (its
scratch files are memory too, up to `max_scratch_mb`); kernel bugs (the seccomp filter refuses
only the syscalls that make tasks: the child can make any other syscall its lack of capabilities
allows). Audit hooks are not a security boundary (the Python docs say so); here they are a second
wall, behind the private root.

If the kernel cannot build the private root (no user or mount namespaces, no `pivot_root`),
or cannot refuse new processes to the host's root user (no seccomp filter: a kernel without it,
a machine without a syscall table here), the tool refuses to run (`SandboxUnavailable` when a `PythonTool` is built, `REFUSED` in a
run's stderr) unless `allow_weak_containment=True` (config:
`task.search.python_tool_allow_weak_containment`): then files outside scratch are held by the
audit hook alone (native openers like `readline` and `sqlite3` read any file the training user
can), scratch is a host directory bounded per file only, the network and processes by whatever
namespaces and filter the kernel gave.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from entr_megatron.tasks.tools import sandbox_guard, sandbox_launcher

__all__ = ["PythonSandbox", "PythonTool", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]

OUTPUT_KILL_FACTOR = 8
"""The child is killed once one stream exceeds this many times its kept size (plus 1 MiB)."""
NOFILE = 64
TASKS_IN_NAMESPACE = 16
"""RLIMIT_NPROC inside the user namespace: counts only the sandbox's own tasks there. A second limit
behind the seccomp filter that refuses every new task (RLIMIT_NPROC binds no host root)."""
SCRATCH_INODES = 1024
"""Files and directories the code may create in its scratch tmpfs."""
READER_JOIN_S = 1.0
"""How long the parent waits for the pipes to close after the child is gone."""
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class SandboxLimits:
    """Hard limits of one run."""

    cpu_s: float = 2.0
    """CPU seconds (RLIMIT_CPU, rounded up; SIGXCPU, then SIGKILL one second later)."""
    wall_s: float = 5.0
    """Wall-clock seconds before the whole process group is killed."""
    memory_mb: int = 256
    """Address space of the child (RLIMIT_AS); the interpreter itself takes some 20 MB."""
    max_output_chars: int = 2000
    """Characters kept of stdout and of stderr each."""
    max_file_mb: int = 8
    """Largest file the child may write (RLIMIT_FSIZE)."""
    max_scratch_mb: int = 32
    """All the child's files together: the size of its scratch tmpfs (in memory, beside memory_mb),
    of at most SCRATCH_INODES files."""

    def __post_init__(self):
        for field in ("cpu_s", "wall_s", "memory_mb", "max_output_chars", "max_file_mb", "max_scratch_mb"):
            if not getattr(self, field) > 0:
                raise ValueError(f"SandboxLimits.{field} must be > 0, got {getattr(self, field)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. exit_code is None when a signal ended the child."""

    stdout: str
    stderr: str
    exit_code: int | None
    killed: str | None
    """"wall_time" | "cpu_time" | "memory" | "output", or None when the code ended by itself."""
    truncated: bool
    seconds: float


class _Reader(threading.Thread):
    """Drains one pipe, keeping the first and the last `keep` bytes and counting the rest."""

    def __init__(self, fd: int, keep: int, kill_at: int, overflow: threading.Event):
        super().__init__(daemon=True)
        self.fd, self.keep, self.kill_at, self.overflow = fd, keep, kill_at, overflow
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def run(self):
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.total += len(chunk)
            if len(self.head) < self.keep:
                self.head += chunk[: self.keep - len(self.head)]
            self.tail += chunk
            if len(self.tail) > self.keep:
                del self.tail[: len(self.tail) - self.keep]
            if self.total > self.kill_at:
                self.overflow.set()

    def text(self, chars: int, prefer_tail: bool) -> tuple[str, bool]:
        """(decoded text of at most `chars` characters, whether anything was dropped)."""
        whole = self.total <= len(self.head)
        data = bytes(self.head if whole or not prefer_tail else self.tail)
        text = data.decode("utf-8", errors="replace")
        if len(text) > chars:
            text = text[-chars:] if prefer_tail else text[:chars]
            whole = False
        return text, not whole


class SandboxUnavailable(RuntimeError):
    """The kernel cannot confine the sandbox's reads and weaker containment was not accepted."""


_STAGE1 = pathlib.Path(sandbox_launcher.__file__).read_text(encoding="utf-8")
_STAGE2 = pathlib.Path(sandbox_guard.__file__).read_text(encoding="utf-8")
_PROBED: dict[str, tuple[bool, str | None]] = {}
"""python -> (the kernel confines reads, why not): one probe per interpreter and process."""
PROBE_TIMEOUT_S = 30.0
WEAK_HINT = ("PythonSandbox(allow_weak_containment=True), or task.search.python_tool_allow_weak_containment: true, "
             "runs it with the audit hook alone, where native code such as readline or sqlite3 reads any file "
             "the training user can")


class PythonSandbox:
    """Runs Python source in a fresh, limited child process (see the module docstring).

    allow_weak_containment: run even where the kernel cannot build the private root (the audit
    hook then is the only wall for reads); default False: such runs are refused.
    audit_hook: False runs without the second wall, only to test the kernel's alone."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable, *,
                 allow_weak_containment: bool = False, audit_hook: bool = True):
        self.limits, self.python = limits, python
        self.allow_weak_containment, self.audit_hook = bool(allow_weak_containment), bool(audit_hook)

    def _config(self, base: str) -> dict:
        lim = self.limits
        return {
            "scratch": os.path.join(base, "work"), "root": os.path.join(base, "root"), "nofile": NOFILE,
            "fsize": lim.max_file_mb * 2**20, "cpu": max(1, -int(-lim.cpu_s // 1)), "memory": lim.memory_mb * 2**20,
            "tasks": TASKS_IN_NAMESPACE, "scratch_size": [lim.max_scratch_mb * 2**20, SCRATCH_INODES],
            "stage2": _STAGE2, "allow_weak": self.allow_weak_containment,
            "audit_hook": self.audit_hook,
        }

    def containment(self) -> tuple[bool, str | None]:
        """(whether the kernel confines reads to scratch here, why not): probed once per interpreter."""
        if self.python not in _PROBED:
            base = _make_base()
            try:
                cmd = [self.python, "-I", "-S", "-B", "-c", _STAGE1, json.dumps(dict(self._config(base), probe=True))]
                proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=base,
                                      env=dict(ENV, HOME=base, TMPDIR=base), timeout=PROBE_TIMEOUT_S)
                answer = json.loads(proc.stdout) if proc.returncode == 0 else None
            except (OSError, ValueError, subprocess.TimeoutExpired) as e:
                answer, proc = None, e
            finally:
                shutil.rmtree(base, ignore_errors=True)
            if answer is None:
                return False, f"the probe failed: {getattr(proc, 'stderr', None) or proc}"
            _PROBED[self.python] = (bool(answer["confined"]), answer["why"])
        return _PROBED[self.python]

    def check(self) -> None:
        """Raises SandboxUnavailable where runs would be refused (the kernel cannot confine reads
        and weaker containment is not accepted)."""
        confined, why = self.containment()
        if not confined and not self.allow_weak_containment:
            raise SandboxUnavailable(f"{sandbox_launcher.REFUSED} ({why}); {WEAK_HINT}")

    def run(self, code: str) -> SandboxResult:
        """Runs `code`; never raises for anything the code does. Refused (exit code REFUSED_EXIT,
        the reason in stderr) where the kernel cannot confine reads, unless allow_weak_containment."""
        start = time.monotonic()
        base = _make_base()
        try:
            return self._run(code, base, start)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _run(self, code: str, base: str, start: float) -> SandboxResult:
        lim = self.limits
        cfg = self._config(base)
        scratch = cfg["scratch"]
        with open(os.path.join(scratch, sandbox_launcher.CODE_FILE), "w", encoding="utf-8",
                  errors="surrogatepass") as f:
            f.write(code)
        env = dict(ENV, HOME=scratch, TMPDIR=scratch)
        cmd = [self.python, "-I", "-S", "-B", "-c", _STAGE1, json.dumps(cfg)]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=scratch, env=env, start_new_session=True, close_fds=True)
        except OSError as e:
            return SandboxResult("", f"sandbox: cannot start {self.python}: {e}", None, None, False, 0.0)
        keep = 4 * lim.max_output_chars + 64
        overflow = threading.Event()
        readers = [_Reader(p.fileno(), keep, OUTPUT_KILL_FACTOR * keep + 2**20, overflow) for p in (proc.stdout, proc.stderr)]
        for r in readers:
            r.start()
        ours = self._wait(proc, start + lim.wall_s, overflow)
        seconds = time.monotonic() - start
        for r in readers:
            r.join(READER_JOIN_S)
        for p in (proc.stdout, proc.stderr):
            p.close()
        stdout, cut_out = readers[0].text(lim.max_output_chars, prefer_tail=False)
        stderr, cut_err = readers[1].text(lim.max_output_chars, prefer_tail=True)
        code_ = proc.returncode
        killed = ours or _classify(code_, stderr, seconds, lim)
        return SandboxResult(stdout, stderr, code_ if code_ >= 0 else None, killed, cut_out or cut_err, seconds)

    @staticmethod
    def _wait(proc: subprocess.Popen, deadline: float, overflow: threading.Event) -> str | None:
        """Waits for the child; kills its whole group on the deadline or on overflow. Returns why we killed."""
        ours = None
        while True:
            # WNOWAIT: the leader stays a zombie, so its group id cannot be reused before killpg
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                break
            if overflow.is_set() and ours is None:
                ours = "output"
            elif time.monotonic() >= deadline and ours is None:
                ours = "wall_time"
            if ours is not None:
                _killpg(proc.pid)
                time.sleep(0.005)
            else:
                overflow.wait(0.02)
        _killpg(proc.pid)  # anything left in the group
        proc.wait()
        return ours


def _make_base() -> str:
    """A fresh private directory holding the scratch directory (`work`) and the root's mount point."""
    base = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-"))
    os.mkdir(os.path.join(base, "work"), 0o700)
    os.mkdir(os.path.join(base, "root"), 0o700)
    return base


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(returncode: int, stderr: str, seconds: float, lim: SandboxLimits) -> str | None:
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode == -signal.SIGKILL:  # the hard CPU limit, or the kernel's OOM killer
        return "cpu_time" if seconds >= lim.cpu_s else "memory"
    lines = stderr.strip().splitlines()
    if returncode != 0 and lines and lines[-1].startswith("MemoryError"):
        return "memory"
    return None


class PythonTool:
    """The `python` tool of an agent: runs the code in a `PythonSandbox`, answers with its output."""

    name = "python"
    description = (
        "Run Python 3 code in a sandbox and return what it prints (use print). No network, no subprocesses, "
        "no files outside the working directory; limited CPU time, memory and output; state is not kept "
        "between calls."
    )
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, allow_weak_containment: bool = False):
        """Raises SandboxUnavailable where the kernel cannot confine reads and allow_weak_containment
        is False (see the module docstring)."""
        self.sandbox = PythonSandbox(limits, allow_weak_containment=allow_weak_containment)
        self.sandbox.check()

    def __call__(self, code: str) -> str:
        """stdout, then the error line or the stderr tail, then `[killed: why]` when a limit ended the run."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        r = self.sandbox.run(code)
        parts = [r.stdout.rstrip("\n")] if r.stdout else []
        err_lines = [line for line in r.stderr.splitlines() if line.strip()]
        if err_lines and r.exit_code not in (0, None):
            parts.append(err_lines[-1])
        elif err_lines:
            parts.append("\n".join(err_lines[-5:]))
        if r.truncated:
            parts.append("[output truncated]")
        if r.killed:
            parts.append(f"[killed: {r.killed}]")
        return "\n".join(parts)

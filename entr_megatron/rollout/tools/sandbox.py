"""A sandboxed `python` tool: model-written code runs in a throw-away child with hard limits.

    PythonSandbox().run("print(6*7)")   # SandboxResult(stdout="42\\n", exit_code=0, killed=None, ...)
    PythonTool()(code="1/0")            # "ZeroDivisionError: division by zero"

Layers, outermost first (each one is probed; what fails is skipped, the rest still hold):

- parent: a fresh scratch directory per run (cwd, HOME, TMPDIR; removed afterwards), a
  whitelisted environment (no inherited secrets), a new session killed as a whole
  (`killpg`) on the wall-clock limit or once the output is far past its cap; stdout and
  stderr are read by threads that keep a bounded head and tail, so the parent's memory
  stays bounded whatever the child prints;
- stage 1 (`_STAGE1`, a short-lived launcher): unprivileged user + network + mount + pid
  namespaces (`unshare`), so the child sees only a down loopback, every mount is remounted
  read-only except the scratch directory (itself nosuid, nodev, noexec), and every process
  it starts dies with it; rlimits (CPU, address space, file size, open files, no core,
  processes inside the namespace); then it execs stage 2 in the new pid namespace;
- stage 2 (`_STAGE2`, a fresh `python -I -S -B` that never loaded ctypes): a
  `sys.addaudithook` hook, which cannot be removed, refuses process creation and signals,
  sockets other than AF_UNIX pairs (no connect, bind, sendto, DNS), threads,
  sub-interpreters, ctypes/cffi (threads and `_posixsubprocess.fork_exec`, which raise no
  event, are replaced by stubs), extension modules outside the interpreter's own library,
  writes outside scratch and reads outside scratch and the standard library; then the code
  runs with fresh globals.

Not contained (audit hooks are not a security boundary, the Python docs say so; the kernel
layers above are what hold against hostile native code): reads of world-readable files by
native code, if some other route to native code exists in the interpreter; stat/existence
checks of any path (`os.stat` raises no audit event); CPU and memory taken by the child
within its limits; and without namespaces (kernel or policy forbids them) the network,
read-only mounts and pid-namespace kill rely on the audit hook alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["PythonSandbox", "PythonTool", "SandboxLimits", "SandboxResult"]

OUTPUT_KILL_FACTOR = 8
"""The child is killed once one stream exceeds this many times its kept size (plus 1 MiB)."""
NOFILE = 64
TASKS_IN_NAMESPACE = 16
"""RLIMIT_NPROC inside the user namespace: counts only the sandbox's own tasks there."""
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

    def __post_init__(self):
        for field in ("cpu_s", "wall_s", "memory_mb", "max_output_chars", "max_file_mb"):
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


_STAGE1 = r'''
import json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
USER, NET, NS, PID = 0x10000000, 0x40000000, 0x00020000, 0x20000000
flags = 0
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for f in (USER | NET | NS | PID, USER | NET | PID, USER | NET, 0):
        if f and libc.unshare(f) == 0:
            flags = f
            break
except Exception:
    libc = None
if flags & NS:
    BIND, REC, PRIVATE, REMOUNT, RDONLY = 4096, 16384, 1 << 18, 32, 1
    KEEP = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
            "relatime": 1 << 21, "strictatime": 1 << 24}
    s = cfg["scratch"].encode()
    libc.mount(None, b"/", None, REC | PRIVATE, None)
    if libc.mount(s, s, None, BIND, None) == 0:
        libc.mount(None, s, None, REMOUNT | BIND | 2 | 4 | 8, None)
        for line in open("/proc/self/mountinfo").read().splitlines():
            f = line.split()
            point = f[4].encode().decode("unicode_escape").encode("latin-1")
            if point == s:
                continue
            keep = sum(KEEP.get(o, 0) for o in f[5].split(","))
            libc.mount(None, point, None, REMOUNT | BIND | RDONLY | keep, None)
R = resource
def limit(kind, soft, hard=None):
    try:
        R.setrlimit(kind, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass
limit(R.RLIMIT_CORE, 0)
limit(R.RLIMIT_NOFILE, cfg["nofile"])
limit(R.RLIMIT_FSIZE, cfg["fsize"])
limit(R.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
limit(R.RLIMIT_AS, cfg["memory"])
if flags & USER:
    limit(R.RLIMIT_NPROC, cfg["tasks"])
os.chdir(cfg["scratch"])  # the cwd must be the bind mount, not the read-only directory under it
argv = [sys.executable, "-I", "-S", "-B", "-c", cfg.pop("stage2"), json.dumps(cfg)]
if not flags & PID:
    os.execv(sys.executable, argv)
def wait(pid):
    while True:
        try:
            got, status = os.waitpid(-1 if pid == 1 else pid, 0)
        except InterruptedError:
            continue
        if pid == 1 or got == pid:
            return got, status
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    # pid 1 of the namespace: the kernel drops default-action signals (SIGXCPU) sent to it, so
    # the code runs in its child; when this reaper ends, every process of the namespace dies
    os.close(r)
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL (had the launcher gone already, the
    child = os.fork()          # session kill of the parent still reaches us)
    if child == 0:
        os.close(w)
        os.execv(sys.executable, argv)
    while True:
        got, status = wait(1)
        if got == child:
            break
    os.write(w, str(status).encode())
    os._exit(0)
os.close(w)
del libc, ctypes
_, status = wait(pid)
report = os.read(r, 64)
status = int(report) if report else status
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
        limit(R.RLIMIT_CPU, R.RLIM_INFINITY)
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(status))
'''

_STAGE2 = r'''
import builtins, json, linecache, os, posix, sys, types, traceback
cfg = json.loads(sys.argv[1])
sys.argv = ["main.py"]
for stream in (sys.stdout, sys.stderr):
    stream.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
with open(os.path.join(cfg["scratch"], ".main.py"), encoding="utf-8") as f:
    SOURCE = f.read()
os.remove(os.path.join(cfg["scratch"], ".main.py"))
linecache.cache["main.py"] = (len(SOURCE), None, SOURCE.splitlines(True), "main.py")
stub = types.ModuleType("_posixsubprocess")  # the real one forks without an audit event
def _refused(*a, **k):
    raise PermissionError("sandbox: fork_exec refused")
stub.fork_exec = _refused
sys.modules["_posixsubprocess"] = stub
import _thread, pathlib, subprocess, threading  # before the hook; subprocess binds the stub
def _no_threads(*a, **k):  # 3.11 raises no audit event for a new thread
    raise PermissionError("sandbox: threads refused")
_thread.start_new_thread = _thread.start_new = threading._start_new_thread = _no_threads

def _install(scratch, roots, cfg_devices):
    from stat import S_ISDIR, S_ISLNK
    lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    # every name the hook uses is bound here: user code may patch os, posixpath or builtins
    decode, Err, str_, bytes_, int_, type_ = bytes.decode, PermissionError, str, bytes, int, type
    isinstance_, getattr_, any_, len_, bool_ = isinstance, getattr, any, len, bool
    paths = (pathlib.PosixPath, pathlib.PurePosixPath)
    roots = tuple(roots)
    read_devices = frozenset(cfg_devices)
    blocked_imports = frozenset(("ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "posix",
        "_testcapi", "_testinternalcapi", "_xxsubinterpreters", "_xxinterpchannels", "_imp", "_thread"))
    refused = frozenset(("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
        "subprocess.Popen", "os.kill", "os.killpg", "os.startfile", "pty.spawn", "_thread.start_new_thread",
        "cpython.PyInterpreterState_New", "resource.setrlimit", "resource.prlimit", "os.link", "os.symlink",
        "os.chmod", "os.lchmod", "os.chown", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
        "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
        "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.getnameinfo",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames", "webbrowser.open"))
    one_path = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 2, "os.truncate": None, "os.utime": 3,
                "shutil.rmtree": 1, "os.listdir": None, "os.scandir": None, "os.chdir": None}

    def deny(event, what):
        raise Err(f"sandbox: {event} refused ({what})")

    def real(event, path):
        """Absolute path with every symlink resolved, from the captured posix functions only."""
        if type_(path) in paths:
            path = str_(path)
        if type_(path) is bytes_:
            path = decode(path, "utf-8", "surrogateescape")
        if type_(path) is not str_:
            deny(event, f"path of type {type_(path).__name__}")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        todo, done, hops = [p for p in path.split("/") if p][::-1], "", 0
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":
                done = done.rsplit("/", 1)[0]
                continue
            candidate = done + "/" + name
            try:
                mode = lstat(candidate).st_mode
            except (OSError, ValueError):
                done = candidate
                continue
            if S_ISLNK(mode):
                hops += 1
                if hops > 40:
                    deny(event, "symlink loop")
                target = readlink(candidate)
                if target.startswith("/"):
                    done = ""
                todo.extend([p for p in target.split("/") if p][::-1])
            else:
                done = candidate
        return done or "/"

    def under(path, bases):
        for base in bases:
            if path == base or path.startswith(base + "/"):
                return True
        return False

    def check(event, path, write, dir_fd=None):
        if dir_fd is not None and dir_fd != -1:
            # relative to a directory fd: only a plain name (every directory fd is inside scratch)
            if type_(path) is not str_ or "/" in path or path in (".", ".."):
                deny(event, "dir_fd with a path")
            return
        p = real(event, path)
        if under(p, (scratch,)) or p == "/dev/null":
            return
        if not write and (under(p, roots) or p in read_devices):
            return
        deny(event, p)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if type_(path) is int_:
                return
            write = (type_(mode) is str_ and any_(c in mode for c in "wax+")) or bool_(flags & 0o3103)
            check(event, path, write)
            if mode is None:  # os.open: a directory fd outside scratch would defeat the checks
                p = real(event, path)
                try:
                    is_dir = S_ISDIR(stat(p).st_mode)
                except (OSError, ValueError):
                    is_dir = False
                if is_dir and not under(p, (scratch,)):
                    deny(event, f"directory {p}")
        elif event in refused:
            deny(event, "not allowed in the sandbox")
        elif event == "import":
            name, filename = args[0], args[1]
            if type_(name) is str_ and name.split(".")[0] in blocked_imports:
                deny(event, name)
            if filename is not None and not under(real(event, filename), roots):
                deny(event, f"extension module {filename}")
        elif event in one_path:
            path = args[0]
            if path is None or type_(path) is int_:
                if event == "os.chdir":
                    deny(event, "fchdir")
                return
            i = one_path[event]
            write = event not in ("os.listdir", "os.scandir")
            check(event, path, write, args[i] if i is not None and len_(args) > i else None)
        elif event == "os.rename":
            check(event, args[0], True, args[2])
            check(event, args[1], True, args[3])
        elif event == "socket.__new__":
            if args[1] != 1:  # AF_UNIX only (socketpair); connect/bind are refused anyway
                deny(event, f"address family {args[1]}")
        elif event in ("object.__setattr__", "object.__delattr__"):
            obj = args[0]
            if isinstance_(obj, type_) and getattr_(obj, "__module__", "") == "pathlib":
                deny(event, "patching pathlib")

    sys.addaudithook(hook)

real_roots = [os.path.realpath(p) for p in sys.path if p and os.path.exists(p)]
_install(os.path.realpath(cfg["scratch"]), real_roots, ("/dev/urandom", "/dev/random", "/dev/zero"))
del _install, stub, _refused, _no_threads
try:
    CODE = compile(SOURCE, "main.py", "exec")
except SyntaxError:
    traceback.print_exc(limit=0)
    sys.exit(1)
del SOURCE, cfg
exec(CODE, {"__name__": "__main__", "__builtins__": builtins})
'''


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


class PythonSandbox:
    """Runs Python source in a fresh, limited child process (see the module docstring)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable):
        self.limits, self.python = limits, python

    def _config(self, scratch: str) -> dict:
        lim = self.limits
        return {
            "scratch": scratch, "nofile": NOFILE, "fsize": lim.max_file_mb * 2**20, "cpu": max(1, -int(-lim.cpu_s // 1)),
            "memory": lim.memory_mb * 2**20, "tasks": TASKS_IN_NAMESPACE, "stage2": _STAGE2,
        }

    def run(self, code: str) -> SandboxResult:
        """Runs `code`; never raises for anything the code does."""
        start = time.monotonic()
        scratch = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-"))
        try:
            return self._run(code, scratch, start)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, code: str, scratch: str, start: float) -> SandboxResult:
        lim = self.limits
        with open(os.path.join(scratch, ".main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        env = dict(ENV, HOME=scratch, TMPDIR=scratch)
        cmd = [self.python, "-I", "-S", "-B", "-c", _STAGE1, json.dumps(self._config(scratch))]
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

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.sandbox = PythonSandbox(limits)

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

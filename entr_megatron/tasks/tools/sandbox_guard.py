"""Stage 2 of the sandboxed python tool: an audit hook, then the model's code.

Run as a script (importing it only defines names): `sandbox_launcher.py` execs this file's source as
`python -I -S -B -c SOURCE CONFIG_JSON` (a fresh interpreter that never loaded ctypes) inside the
private root. It reads the code from `.main.py` in the scratch directory (and removes it), installs
a `sys.addaudithook` hook (which cannot be removed) and runs the code with fresh globals.

The hook is the second wall, behind the kernel's: it refuses process creation and signals,
sockets other than AF_UNIX pairs (no connect, bind, sendto, DNS), threads, sub-interpreters,
ctypes/cffi (by any part of a module's name and by an extension file's own name: `_ctypes` loaded
as `x._ctypes` is refused; threads and `_posixsubprocess.fork_exec`, which raise no event, are
replaced by stubs), extension modules outside the interpreter's own library, writes outside scratch
and reads outside scratch and the standard library. Audit hooks are not a security boundary (native code such as
`readline` or `sqlite3` opens files without an event): the private root is what holds.
cfg["audit_hook"] False skips the hook (tests of the kernel wall alone).
"""

import builtins
import json
import linecache
import os
import posix
import sys
import traceback
import types

REFUSED_IMPORTS = frozenset((
    "ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "posix", "_testcapi", "_testinternalcapi",
    "_xxsubinterpreters", "_xxinterpchannels", "_imp", "_thread"))
REFUSED_EVENTS = frozenset((
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen", "os.kill",
    "os.killpg", "os.startfile", "pty.spawn", "_thread.start_new_thread", "cpython.PyInterpreterState_New",
    "resource.setrlimit", "resource.prlimit", "os.link", "os.symlink", "os.chmod", "os.lchmod", "os.chown",
    "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "socket.bind", "socket.connect", "socket.sendto",
    "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
    "socket.gethostbyaddr", "socket.getnameinfo", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sys._current_frames", "webbrowser.open"))
ONE_PATH = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 2, "os.truncate": None, "os.utime": 3,
            "shutil.rmtree": 1, "os.listdir": None, "os.scandir": None, "os.chdir": None}
"""Audit events on one path -> the index of their dir_fd argument (None: they have none)."""
READ_DEVICES = ("/dev/urandom", "/dev/random", "/dev/zero")


def stub_processes_and_threads():
    """Replaces what creates processes or threads without an audit event (3.11), before the hook."""
    stub = types.ModuleType("_posixsubprocess")

    def refused(*a, **k):
        raise PermissionError("sandbox: fork_exec refused")

    stub.fork_exec = refused
    sys.modules["_posixsubprocess"] = stub
    # lazy: after the stub, before the hook (their order is the wall; module docstring)
    import _thread
    import pathlib  # noqa: F401  (the hook reads its classes)
    import subprocess  # noqa: F401  (binds the stub)
    import threading

    def no_threads(*a, **k):
        raise PermissionError("sandbox: threads refused")

    _thread.start_new_thread = _thread.start_new = threading._start_new_thread = no_threads


def install(scratch, roots, read_devices):
    """Adds the audit hook (module docstring) for scratch `scratch` and readable `roots`."""
    # lazy: bound here, before the hook, for the hook alone (user code may patch the modules' names)
    import pathlib
    from stat import S_ISDIR, S_ISLNK

    lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    # every name the hook uses is bound here: user code may patch os, posixpath or builtins
    decode, Err, str_, bytes_, int_, type_ = bytes.decode, PermissionError, str, bytes, int, type
    isinstance_, getattr_, any_, len_, bool_ = isinstance, getattr, any, len, bool
    paths = (pathlib.PosixPath, pathlib.PurePosixPath)
    roots, read_devices = tuple(roots), frozenset(read_devices)
    blocked_imports, refused, one_path = REFUSED_IMPORTS, REFUSED_EVENTS, dict(ONE_PATH)

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
        elif event == "import":  # every part of the name, and an extension file's own name
            name, filename = args[0], args[1]
            if type_(name) is str_ and any_(part in blocked_imports for part in name.split(".")):
                deny(event, name)
            if filename is not None:
                path = real(event, filename)
                if not under(path, roots):
                    deny(event, f"extension module {filename}")
                if path.rsplit("/", 1)[-1].split(".")[0] in blocked_imports:
                    deny(event, f"{name} from {filename}")
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


def main():
    """Reads the code, walls it in, runs it as `main.py` with fresh globals."""
    cfg = json.loads(sys.argv[1])
    sys.argv = ["main.py"]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
    with open(os.path.join(cfg["scratch"], ".main.py"), encoding="utf-8") as f:
        source = f.read()
    os.remove(os.path.join(cfg["scratch"], ".main.py"))
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    stub_processes_and_threads()
    if cfg["audit_hook"]:
        roots = [os.path.realpath(p) for p in sys.path if p and os.path.exists(p)]
        install(os.path.realpath(cfg["scratch"]), roots, READ_DEVICES)
    try:
        code = compile(source, "main.py", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        sys.exit(1)
    del source, cfg
    exec(code, {"__name__": "__main__", "__builtins__": builtins})


if __name__ == "__main__":
    main()

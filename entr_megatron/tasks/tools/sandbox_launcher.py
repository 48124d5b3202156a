"""Stage 1 of the sandboxed python tool: namespaces, a private root, rlimits, a pid-1 reaper.

Run as a script (importing it only defines names): `PythonSandbox` runs this file's source as
`python -I -S -B -c SOURCE CONFIG_JSON` in the scratch directory, and this launcher execs stage 2
(`sandbox_guard.py`) once the child is walled in:

1. `unshare` user + network + mount + pid namespaces (fewer where the kernel refuses: then the
   private root below cannot be built);
2. a private root: a fresh tmpfs holding only, at their host paths, read-only binds of the
   interpreter, its standard library and the directories of the shared libraries it maps (plus
   the ELF interpreter; HIDDEN_MODULES' files covered by /dev/null), the devices null, zero,
   random and urandom, and at the scratch directory's path a tmpfs of its own (read-write,
   nosuid, nodev, noexec, of `scratch_size` bytes and inodes: the code's files in all) holding
   the code file; the root tmpfs is made read-only, `pivot_root` moves into it and the host's
   root is detached. Every other file of the host (/etc, /root, /home, /proc, the project) is
   absent to the kernel, whatever code opens it;
3. rlimits and no_new_privs; a seccomp filter refusing fork, vfork, clone, clone3 and
   io_uring_setup (`task_filter`): the code can start no process or thread, as the host's root
   too, whom RLIMIT_NPROC does not bind; in the pid namespace a reaper is pid 1 and the code runs
   as its child (the kernel drops default-action signals such as SIGXCPU sent to a pid 1), so
   every process of the namespace dies with it.

The user namespace maps the host's uid to a non-zero one (SANDBOX_ID): after the exec the child
holds no capability in it, so it can neither undo a mount nor leave the new root. If the private
root cannot be built, or the filter installed while the host user is root, the launcher writes
`REFUSED` and a reason to stderr and exits `REFUSED_EXIT`, unless the config allows weaker
containment (then the audit hook of stage 2 is the only wall for files).
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

REFUSED = "sandbox: refused: reads cannot be confined by the kernel here"
REFUSED_EXIT = 125
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
KEPT_FLAGS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
              os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
"""statvfs flag -> mount flag: a bind made in a user namespace must keep its source's locked flags."""
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
ROOT_TMPFS = b"mode=0755,size=1m"
HIDDEN_MODULES = ("_ctypes", "_ctypes_test", "_testcapi", "_testinternalcapi", "_xxsubinterpreters",
                  "_xxinterpchannels", "_posixsubprocess", "_cffi_backend")
"""Extension modules absent from the private root (their files covered by /dev/null, which cannot be
loaded): ctypes and its kin under any name, whatever loads them."""
SECCOMP_ARCH = {"x86_64": (0xC000003E, (57, 58, 56, 435, 425)), "aarch64": (0xC00000B7, (220, 435, 425))}
"""machine -> (its AUDIT_ARCH, the syscalls the code is refused: fork, vfork, clone, clone3 (threads
too), io_uring_setup (its workers are tasks), those the machine has). Other ABIs (x86's 32-bit
int 0x80 and x32) are refused every syscall."""
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
X32_SYSCALL_BIT = 0x40000000
CODE_FILE = ".main.py"
"""The code, written into scratch by the parent, read and removed by stage 2."""
SANDBOX_ID = 1000
"""The child's uid and gid inside its user namespace (the host's are mapped to it). Not 0: after the
exec it holds no capability there, so it can neither undo a mount nor leave the new root."""


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.syscall.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p]  # only pivot_root is called
    libc.syscall.restype = ctypes.c_long
    return libc, ctypes.get_errno


def _call(libc_fn, get_errno, what, *args):
    if libc_fn(*args) != 0:
        err = get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def elf_interpreter(path):
    """The PT_INTERP path of an ELF executable (the dynamic loader the kernel maps), or None."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return None
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        if wide:
            phoff, = struct.unpack_from(order + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
        else:
            phoff, = struct.unpack_from(order + "I", head, 28)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            entry = table[i * phentsize:(i + 1) * phentsize]
            kind, = struct.unpack_from(order + "I", entry, 0)
            if kind != 3:  # PT_INTERP
                continue
            # p_offset and p_filesz (p_vaddr and p_paddr between them)
            offset, size = struct.unpack_from(order + ("Q16xQ" if wide else "I8xI"), entry, 8 if wide else 4)
            f.seek(offset)
            return f.read(size).rstrip(b"\0").decode()
    return None


def read_only_paths(python):
    """What the interpreter needs to start and to load its own extension modules: the executable,
    its ELF loader, the standard library (sys.path under -I -S) and the directory of every shared
    object this launcher (the same interpreter) has mapped (libpython, libc, libffi, ...)."""
    paths = {python}
    loader = elf_interpreter(python)
    if loader:
        paths.add(loader)
    paths.update(p for p in sys.path if p and os.path.exists(p))
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            mapped = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if mapped.startswith("/") and not mapped.endswith("(deleted)") and os.path.realpath(mapped) != python:
                paths.add(os.path.dirname(mapped))  # not the executable's: only the file is needed
    if os.path.exists("/etc/ld.so.cache"):  # the loader's index of library paths: names only, public
        paths.add("/etc/ld.so.cache")
    return paths


def resolve(path):
    """(symlinks met on the way as (link, target), the real path), resolving one component at a time."""
    links, todo, done, hops = [], [p for p in path.split("/") if p][::-1], "", 0
    while todo:
        name = todo.pop()
        if name in (".", ""):
            continue
        if name == "..":
            done = done.rsplit("/", 1)[0]
            continue
        candidate = done + "/" + name
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise OSError(40, f"symlink loop at {candidate}")
            target = os.readlink(candidate)
            links.append((candidate, target))
            if target.startswith("/"):
                done = ""
            todo.extend([p for p in target.split("/") if p][::-1])
        else:
            done = candidate
    return links, done or "/"


def _under(path, bases):
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in bases)


class Root:
    """A private root under construction at `mnt` (a tmpfs in this mount namespace)."""

    def __init__(self, libc, get_errno, mnt):
        self.libc, self.get_errno, self.mnt = libc, get_errno, mnt

    def mount(self, what, src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        _call(self.libc.mount, self.get_errno, what, enc(src), enc(dst), enc(fstype), flags, data)

    def bind(self, src, flags):
        """Binds host path `src` at the same path in the new root, then remounts it with `flags`."""
        dst = self.mnt + src
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
        self.mount(f"bind {src}", src, dst, None, MS_BIND)
        kept = os.statvfs(src).f_flag
        flags |= sum(ms for st, ms in KEPT_FLAGS.items() if kept & st)
        self.mount(f"remount {src}", None, dst, None, MS_REMOUNT | MS_BIND | flags)

    def cover(self, path):
        """Puts /dev/null over the file `path` of a bind made already (its module cannot be loaded)."""
        self.mount(f"cover {path}", "/dev/null", self.mnt + path, None, MS_BIND)
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        kept = os.statvfs("/dev/null").f_flag
        flags |= sum(ms for st, ms in KEPT_FLAGS.items() if kept & st)
        self.mount(f"remount cover {path}", None, self.mnt + path, None, MS_REMOUNT | MS_BIND | flags)

    def scratch(self, scratch, size):
        """A tmpfs of `size` (bytes, inodes) at `scratch` holding only the host scratch's code file:
        the code's files count against that bound, in memory, never on the host's disk."""
        dst = self.mnt + scratch
        os.makedirs(dst, exist_ok=True)
        data = f"mode=0700,size={size[0]},nr_inodes={size[1]}".encode()
        self.mount("tmpfs scratch", "tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, data)
        code = os.path.join(scratch, CODE_FILE)
        if os.path.exists(code):
            with open(code, "rb") as src, open(dst + "/" + CODE_FILE, "wb") as out:
                out.write(src.read())

    def build(self, read_only, scratch, scratch_size):
        """Fills the tmpfs (see the module docstring), makes it read-only and pivots into it."""
        self.mount("make / private", None, "/", None, MS_REC | MS_PRIVATE)
        self.mount("tmpfs root", "tmpfs", self.mnt, "tmpfs", MS_NOSUID | MS_NODEV, ROOT_TMPFS)
        resolved = [resolve(p) for p in sorted(read_only)]
        binds = []
        for real in sorted({real for _, real in resolved}, key=lambda p: (p.count("/"), p)):
            if os.path.exists(real) and not _under(real, binds):
                binds.append(real)
                self.bind(real, MS_RDONLY | MS_NOSUID | MS_NODEV)
        for links, _ in resolved:
            for link, target in links:  # /lib64 -> usr/lib64 and the like, where no bind shows them
                if not _under(link, binds) and not os.path.lexists(self.mnt + link):
                    os.makedirs(os.path.dirname(self.mnt + link), exist_ok=True)
                    os.symlink(target, self.mnt + link)
        for dev in DEVICES:
            if os.path.exists(dev):
                self.bind(dev, MS_NOSUID | MS_NOEXEC)
        for path in hidden_files(sorted({real for _, real in resolved})):
            self.cover(path)
        self.scratch(scratch, scratch_size)
        self.mount("read-only root", None, self.mnt, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        number = SYS_PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            raise OSError(38, f"pivot_root: no syscall number known for {os.uname().machine}")
        os.chdir(self.mnt)
        _call(self.libc.syscall, self.get_errno, "pivot_root", number, b".", b".")
        _call(self.libc.umount2, self.get_errno, "detach the host root", b".", MNT_DETACH)
        os.chdir("/")


def hidden_files(dirs):
    """The files of HIDDEN_MODULES (NAME.*.so) in the directories `dirs`."""
    found = []
    for d in dirs:
        if os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                if name.split(".", 1)[0] in HIDDEN_MODULES and name.endswith(".so"):
                    found.append(os.path.join(d, name))
    return found


def task_filter(machine):
    """The seccomp program (a list of (code, jt, jf, k)) refusing SECCOMP_ARCH's syscalls with EPERM,
    and every syscall of another ABI; None on a machine without a table."""
    if machine not in SECCOMP_ARCH:
        return None
    arch, refused = SECCOMP_ARCH[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    checks = ([(jge, X32_SYSCALL_BIT)] if machine == "x86_64" else []) + [(jeq, nr) for nr in refused]
    prog = [(ld, 0, 0, 4), (jeq, 0, len(checks) + 2, arch), (ld, 0, 0, 0)]  # arch, else deny; the number
    for i, (code, k) in enumerate(checks):
        prog.append((code, len(checks) - i, 0, k))  # matched: deny (the last instruction)
    return prog + [(ret, 0, 0, SECCOMP_RET_ALLOW), (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM)]


def refuse_new_tasks(libc, get_errno):
    """Installs `task_filter` on this process (inherited by what it execs): no fork, clone or thread.
    Needs no_new_privs (set before). Raises OSError where the kernel or the machine has no filter."""
    prog = task_filter(os.uname().machine)
    if prog is None:
        raise OSError(38, f"no seccomp syscall table for {os.uname().machine}")
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    ulong = ctypes.c_ulong
    if libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), ulong(0), ulong(0)):
        err = get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")


def hold_tasks(libc, get_errno, host_uid):
    """None once new processes and threads are refused (`refuse_new_tasks`), or where RLIMIT_NPROC
    does it (a host uid other than root); else why not."""
    try:
        refuse_new_tasks(libc, get_errno)
    except OSError as e:
        if host_uid != 0:
            return None  # RLIMIT_NPROC (set_limits) binds every uid but the host's root
        return f"new processes cannot be refused to the host's root user ({e})"
    return None


def enter_namespaces(libc):
    """unshare the most namespaces the kernel allows; returns the flags that took effect. In a new
    user namespace our uid and gid become SANDBOX_ID (files we create in the tmpfs need a mapped
    owner; a non-zero one keeps no capability after the exec)."""
    uid, gid = os.getuid(), os.getgid()
    user_net = CLONE_NEWUSER | CLONE_NEWNET
    for flags in (user_net | CLONE_NEWNS | CLONE_NEWPID, user_net | CLONE_NEWPID, user_net):
        if libc.unshare(flags) == 0:
            try:
                for name, text in (("setgroups", "deny"), ("uid_map", f"{SANDBOX_ID} {uid} 1"),
                                   ("gid_map", f"{SANDBOX_ID} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            except OSError:
                pass  # unmapped: we run as the overflow uid; only the private root (tmpfs files) fails
            return flags
    return 0


def set_limits(cfg, flags):
    """CPU, address space, file size, open files, no core; processes only inside a user namespace."""
    def limit(kind, soft, hard=None):
        try:
            resource.setrlimit(kind, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, cfg["nofile"])
    limit(resource.RLIMIT_FSIZE, cfg["fsize"])
    limit(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
    limit(resource.RLIMIT_AS, cfg["memory"])
    if flags & CLONE_NEWUSER:
        limit(resource.RLIMIT_NPROC, cfg["tasks"])


def _wait(pid):
    while True:
        try:
            got, status = os.waitpid(-1 if pid == 1 else pid, 0)
        except InterruptedError:
            continue
        if pid == 1 or got == pid:
            return got, status


def exec_code(argv, hold):
    """Execs stage 2 once `hold()` refused new tasks; where it could not (its reason), refused."""
    why = hold()
    if why is not None:
        sys.stderr.write(f"{REFUSED} ({why})\n")
        sys.stderr.flush()
        os._exit(REFUSED_EXIT)
    os.execv(argv[0], argv)


def run_in_pid_namespace(libc, argv, hold):
    """Forks pid 1 of the namespace, which forks and reaps the code; ends as the code ended."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # had the launcher gone already, the
        child = os.fork()                                      # session kill still reaches us
        if child == 0:
            os.close(w)
            exec_code(argv, hold)
        while True:
            got, status = _wait(1)
            if got == child:
                break
        os.write(w, str(status).encode())
        os._exit(0)
    os.close(w)
    _, status = _wait(pid)
    report = os.read(r, 64)
    status = int(report) if report else status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
            # Lift our own CPU limit so it cannot end us first. Raising a hard limit needs a
            # privilege some kernels refuse here; our own CPU use is far below the limit anyway.
            try:
                resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except (ValueError, OSError):
                pass
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main():
    """Walls the child in (module docstring), then execs stage 2; cfg["probe"]: prints the
    containment reached as JSON and exits instead."""
    cfg = json.loads(sys.argv[1])
    python = os.path.realpath(sys.executable)
    host_uid = os.getuid()
    libc, get_errno = _libc()
    flags = enter_namespaces(libc)
    why = None
    if not flags & CLONE_NEWNS:
        why = "no mount namespace (unshare refused by the kernel or its policy)"
    else:
        try:
            Root(libc, get_errno, cfg["root"]).build(read_only_paths(python), cfg["scratch"], cfg["scratch_size"])
        except OSError as e:
            why = f"cannot build the private root: {e}"
    if cfg.get("probe"):
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        why = why or hold_tasks(libc, get_errno, host_uid)  # on the probe itself, which ends here
        print(json.dumps({"confined": why is None, "why": why}))
        return
    if why is not None and not cfg["allow_weak"]:
        sys.stderr.write(f"{REFUSED} ({why})\n")
        sys.stderr.flush()
        os._exit(REFUSED_EXIT)
    set_limits(cfg, flags)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(cfg["scratch"])  # inside the new root: the tmpfs, not the directory under it

    def hold():
        problem = hold_tasks(libc, get_errno, host_uid)
        return None if cfg["allow_weak"] else problem

    argv = [python, "-I", "-S", "-B", "-c", cfg.pop("stage2"), json.dumps(cfg)]
    if not flags & CLONE_NEWPID:
        exec_code(argv, hold)
    run_in_pid_namespace(libc, argv, hold)


if __name__ == "__main__":
    main()

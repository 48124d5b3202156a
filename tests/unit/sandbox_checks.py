"""The checks of tests/unit/test_sandbox_containment.py: code run in the sandbox and what it must
print. A module of its own without pytest: that test also imports it under the system's python as
an unprivileged user."""

from __future__ import annotations

FORKS = """
import os, time
made, why = 0, None
for _ in range(60):
    try:
        pid = os.fork()
    except OSError as e:
        why = type(e).__name__
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    made += 1
print(made, why)
"""
THREADS = """
import sys
del sys.modules["_thread"]  # stage 2 stubbed its start_new_thread; a fresh import has the real one
import _thread
try:
    _thread.start_new_thread(print, ("thread",))
    print("started")
except RuntimeError as e:
    print("RuntimeError", e)
"""
CTYPES_UNDER_ANOTHER_NAME = """
import importlib.util, os, sys
lib = [p for p in sys.path if p.endswith("lib-dynload")][0]
path = os.path.join(lib, [n for n in os.listdir(lib) if n.startswith("_ctypes.")][0])
spec = importlib.util.spec_from_file_location("x._ctypes", path)
try:
    module = importlib.util.module_from_spec(spec)
    print("loaded", hasattr(module, "dlopen"))
except (ImportError, OSError) as e:
    print(type(e).__name__ + (f": {e}" if isinstance(e, PermissionError) else ""))
"""
SCRATCH_TOTAL = """
import os
written, why = 0, None
for i in range(40):
    try:
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * (8 * 2**20))
        written += 1
    except OSError as e:
        why = os.strerror(e.errno)
        break
st = os.statvfs(".")
print(written, why, st.f_blocks * st.f_frsize // 2**20)
"""
INODES = """
import os
made, why = 0, None
for i in range(100_000):
    try:
        open(f"e{i}", "w").close()
        made += 1
    except OSError as e:
        why = os.strerror(e.errno)
        break
print(made < 100_000, why)
"""


def checks(run) -> dict[str, str]:
    """What each check printed, from `run(code, audit_hook)` -> (stdout, stderr)."""
    out = {}
    for name, code, hook in (("forks", FORKS, False), ("threads", THREADS, False),
                             ("ctypes_kernel", CTYPES_UNDER_ANOTHER_NAME, False),
                             ("ctypes_hook", CTYPES_UNDER_ANOTHER_NAME, True),
                             ("scratch", SCRATCH_TOTAL, False), ("inodes", INODES, False)):
        stdout, stderr = run(code, hook)
        out[name] = stdout.strip() or stderr.strip().splitlines()[-1]
    return out


EXPECTED = {
    "forks": "0 PermissionError",  # seccomp refuses fork/clone, for root too
    "threads": "RuntimeError can't start new thread",
    "ctypes_kernel": "ImportError",  # _ctypes is not in the private root: a device stands in its place
    "ctypes_hook": "PermissionError: sandbox: import refused (x._ctypes)",
    "scratch": "4 No space left on device 32",  # 32 MiB of scratch in all: four 8 MiB files
    "inodes": "True No space left on device",
}

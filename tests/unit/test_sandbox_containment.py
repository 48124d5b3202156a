"""The sandbox's containment list (docs/SANDBOX.md) holds for the host's root user and for a normal
user alike (issue 46): no new process or thread (RLIMIT_NPROC alone binds no root), no ctypes under
any name, scratch disk bounded in total, not only per file. Each check runs the real sandbox with its
audit hook off, where the kernel alone must answer, and the ctypes check also with the hook on.

This machine runs the tests as root: `test_*_as_a_normal_user` runs the same checks under
`setpriv` as uid 65534 with the system's python (the project's interpreter lives under /root,
which that user cannot enter), and skips where the machine does not allow it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from entr_megatron.tasks.tools.sandbox import PythonSandbox, SandboxLimits
from sandbox_checks import EXPECTED, checks

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")

REPO = pathlib.Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(cpu_s=4, wall_s=20, memory_mb=512)
NOBODY = 65534

def _assert_contained(seen: dict[str, str]) -> None:
    assert seen == EXPECTED, seen


def test_containment_holds_as_this_user():
    """Run as this machine's test user (root here: the case RLIMIT_NPROC does not bind)."""
    def run(code, hook):
        r = PythonSandbox(LIMITS, audit_hook=hook).run(code)
        return r.stdout, r.stderr

    _assert_contained(checks(run))


AS_NOBODY = """
import json, sys, types
for name in ("entr_megatron", "entr_megatron.rollout", "entr_megatron.tasks.tools"):
    module = types.ModuleType(name)  # the packages without their __init__ (torch is not installed here)
    module.__path__ = [sys.argv[1] + "/" + name.replace(".", "/")]
    sys.modules[name] = module
from entr_megatron.tasks.tools.sandbox import PythonSandbox, SandboxLimits
sys.path.insert(0, sys.argv[1] + "/tests/unit")
from sandbox_checks import checks

lim = SandboxLimits(cpu_s=4, wall_s=20, memory_mb=512)
assert PythonSandbox(lim).containment() == (True, None), PythonSandbox(lim).containment()

def run(code, hook):
    r = PythonSandbox(lim, audit_hook=hook).run(code)
    return r.stdout, r.stderr

print(json.dumps(checks(run)))
"""


def test_containment_holds_as_a_normal_user(tmp_path):
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.getuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("needs root (to become uid 65534), setpriv and a system python3")
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if subprocess.run([*as_nobody, "unshare", "--user", "--map-root-user", "true"]).returncode != 0:
        pytest.skip("a normal user cannot create a user namespace here")
    if subprocess.run([*as_nobody, python, "-c", f"import os; os.listdir({str(REPO)!r})"]).returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot read {REPO}")
    proc = subprocess.run([*as_nobody, python, "-I", "-c", AS_NOBODY, str(REPO)], capture_output=True, text=True,
                          timeout=600, cwd="/", env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_contained(json.loads(proc.stdout.strip().splitlines()[-1]))

"""The sandboxed python tool: limits end runaway code, and the host's files, network,
processes and environment stay out of reach."""

import os
import socket
import tempfile
import time

import pytest

from entr_megatron.rollout.tools import sandbox as sandbox_mod
from entr_megatron.rollout.tools.sandbox import PythonSandbox, PythonTool, SandboxLimits

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")

FAST = SandboxLimits(cpu_s=1, wall_s=1.5, memory_mb=256, max_output_chars=500)


@pytest.fixture
def scratches(monkeypatch):
    """Records every scratch directory the sandbox makes."""
    made, real = [], tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        path = real(*args, **kwargs)
        made.append(os.path.realpath(path))
        return path

    monkeypatch.setattr(sandbox_mod.tempfile, "mkdtemp", mkdtemp)
    return made


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line holds `text` (the launcher's holds the scratch path)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def run(code, limits=FAST):
    return PythonSandbox(limits).run(code)


def test_prints_stdout_and_exits_zero():
    r = run("print(6 * 7)\nprint('ok')")
    assert (r.stdout, r.exit_code, r.killed, r.truncated) == ("42\nok\n", 0, None, False)


def test_exception_gives_its_error_line():
    r = run("def f():\n    return 1 / 0\nf()")
    assert r.exit_code == 1 and r.killed is None
    assert r.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert PythonTool(FAST)(code="x = [1]\nx[5]") == "IndexError: list index out of range"


def test_tool_protocol_and_answer():
    tool = PythonTool(FAST)
    assert tool.name == "python" and tool.parameters["required"] == ["code"]
    assert tool.parameters["properties"]["code"]["type"] == "string"
    assert tool(code="print(sum(range(10)))") == "45"
    assert tool(code="import time\ntime.sleep(30)").endswith("[killed: wall_time]")


def test_busy_loop_is_ended_by_cpu_or_wall_limit(scratches):
    start = time.monotonic()
    r = run("while True: pass")
    assert time.monotonic() - start < FAST.wall_s + 2.0
    assert r.killed in ("cpu_time", "wall_time") and r.exit_code is None
    assert processes_mentioning(scratches[0]) == []


def test_sleep_is_ended_by_wall_time_and_leaves_nothing(scratches):
    r = run("import time\nprint('before', flush=True)\ntime.sleep(100)")
    assert r.killed == "wall_time" and r.stdout == "before\n"
    assert FAST.wall_s <= r.seconds < FAST.wall_s + 2.0
    assert processes_mentioning(scratches[0]) == [] and not os.path.exists(scratches[0])


def test_fork_bomb_is_refused_and_leaves_no_process(scratches):
    for code in (
        "import os\nwhile True: os.fork()",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        "import subprocess\nsubprocess._fork_exec()",
        "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
        "import pty\npty.fork()",
    ):
        r = run(code)
        assert r.exit_code == 1 and "PermissionError: sandbox:" in r.stderr, (code, r)
    time.sleep(0.1)
    assert all(processes_mentioning(s) == [] for s in scratches)


def test_memory_hog_is_stopped():
    r = run("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert r.killed == "memory" and "allocated" not in r.stdout
    assert PythonTool(FAST)(code="x = bytearray(2 * 1024**3)").splitlines()[-1] == "[killed: memory]"


def vm_hwm_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.parametrize("code", ['print("x" * 10**8)', 'while True: print("y" * 100)'])
def test_huge_output_is_truncated_and_parent_memory_bounded(code):
    before = vm_hwm_kb()
    r = run(code, SandboxLimits(cpu_s=2, wall_s=3, memory_mb=512, max_output_chars=500))
    assert r.truncated and r.killed == "output"
    assert 400 <= len(r.stdout) <= 500 and set(r.stdout) <= {"x", "y", "\n"}
    assert vm_hwm_kb() - before < 50 * 1024


def test_reads_outside_scratch_are_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-42")
    for code in (
        "print(open('/etc/passwd').read())",
        f"print(open({str(secret)!r}).read())",
        f"import pathlib\nprint(pathlib.Path({str(secret)!r}).read_text())",
        f"import os\nos.chdir('/')\nprint(open({str(secret)[1:]!r}).read())",
        # patched helpers do not fool the hook: it holds its own references
        "import os, builtins\nos.path.realpath = lambda p, **k: os.getcwd()\nos.getcwd = lambda: '/'\n"
        f"builtins.type = lambda o: str\nprint(open({str(secret)!r}).read())",
        f"import os\nprint(os.listdir({str(tmp_path)!r}))",
    ):
        r = run(code)
        assert r.exit_code == 1 and "PermissionError: sandbox:" in r.stderr, (code, r)
        assert "TOPSECRET" not in r.stdout + r.stderr and "root:" not in r.stdout + r.stderr


def test_writes_outside_scratch_are_refused(tmp_path):
    target = tmp_path / "out.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('pwned')",
        f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('pwned')",
        f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nopen('out.txt', 'w', opener=lambda p, f: os.open(p, f, dir_fd=fd))",
    ):
        r = run(code)
        assert r.exit_code == 1 and r.killed is None, (code, r)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_files_inside_scratch_work_and_scratch_is_removed(scratches):
    r = run(
        "import os, pathlib, shutil, tempfile\n"
        "open('a.txt', 'w').write('hello')\n"
        "os.makedirs('d/e')\npathlib.Path('d/e/b.txt').write_text('there')\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f: f.write('!')\n"
        "print(open('a.txt').read(), pathlib.Path('d/e/b.txt').read_text(), open(f.name).read())\n"
        "shutil.rmtree('d')\nprint(sorted(n for n in os.listdir('.') if not n.startswith('tmp')))\n"
        "print(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])"
    )
    assert r.exit_code == 0, r
    assert r.stdout == "hello there !\n['a.txt']\nTrue\n"
    assert len(scratches) == 1 and not os.path.exists(scratches[0])


def test_socket_connection_is_refused():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            f"import _socket\ns = _socket.socket(2, 1)\ns.connect(('127.0.0.1', {port}))",
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
            "import socket\nsocket.getaddrinfo('example.com', 80)",
        ):
            r = run(code)
            assert r.exit_code == 1 and "sandbox:" in r.stderr, (code, r)
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    assert run("import socket\na, b = socket.socketpair()\na.send(b'hi')\nprint(b.recv(2))").stdout == "b'hi'\n"


def test_processes_signals_and_native_code_are_refused():
    for code in (
        "import subprocess\nsubprocess.run(['ls'])",
        "import os\nos.system('ls')",
        "import os\nos.execv('/bin/ls', ['ls'])",
        "import os\nos.kill(os.getppid() or 1, 9)",
        "import ctypes",
        "import _ctypes",
        "import threading\nthreading.Thread(target=print).start()",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
        "import gc\ngc.get_objects()",
    ):
        r = run(code)
        assert r.exit_code == 1 and "PermissionError: sandbox:" in r.stderr, (code, r)


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("SECRET_API_KEY", "sk-do-not-leak")
    r = run("import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ').read())")
    assert "SECRET_API_KEY" not in r.stdout and "sk-do-not-leak" not in r.stdout + r.stderr
    r = run("import os\nprint(sorted(os.environ))")
    assert r.stdout == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']\n"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)


def test_missing_interpreter_does_not_raise(scratches):
    r = PythonSandbox(FAST, python="/nonexistent/python").run("print(1)")
    assert r.exit_code is None and "cannot start" in r.stderr and not os.path.exists(scratches[0])

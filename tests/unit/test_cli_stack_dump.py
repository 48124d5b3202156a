"""`kill -USR1` of an `entr-megatron` command writes every thread's stack to its stderr and the
command goes on (cli/main.py); called in-process with a stderr that has no file descriptor (pytest's
capture, an embedding program), main() runs without it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, signal, sys, time
from entr_megatron.cli import main as cli

class Args:
    command = "wait"
    @staticmethod
    def func(args):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print("went on", flush=True)

cli.build_parser = lambda: type("Parser", (), {"parse_args": lambda self, argv: Args()})()
sys.exit(cli.main(["wait"]))
"""


def test_sigusr1_writes_the_stacks_and_the_command_goes_on():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "went on"
    assert "(most recent call first)" in proc.stderr and "in func" in proc.stderr, proc.stderr


def test_main_in_process_with_a_captured_stderr(monkeypatch, capsys):
    from entr_megatron.cli import main as cli

    class Args:
        command = "noop"

        @staticmethod
        def func(args):
            print("ran")

    monkeypatch.setattr(cli, "build_parser", lambda: type("Parser", (), {"parse_args": lambda self, argv: Args()})())
    assert cli.main(["noop"]) == 0  # pytest's captured stderr has no fileno: no stack dump, no error
    assert capsys.readouterr().out == "ran\n"

"""The `entr-megatron` command line.

This module imports only the standard library at its top: the commands are imported inside `main`,
so a Ctrl-C while they load ends the command with one line, as it does later. Building the parser
imports each command's face (cli/<command>.py: flags, defaults, manual), never torch: a command
imports its implementation, and torch with it, when it runs (tests/unit/test_cli_help.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import threading

from entr_megatron import __version__


def build_parser() -> argparse.ArgumentParser:
    """The `entr-megatron` parser: every command's flags, each command's `func` set (nothing heavy imported)."""
    # lazy: inside main's try, so a Ctrl-C while the commands load is one line
    from entr_megatron.cli import checkpoint, convert, demo, generate, plan, score, study, train

    parser = argparse.ArgumentParser(prog="entr-megatron", description="Megatron-scale asynchronous RL with ENTR.")
    parser.add_argument("--version", action="version", version=f"entr-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parsers(sub)
    demo.add_parser(sub)
    score.add_parser(sub)
    generate.add_parser(sub)
    study.add_parser(sub)
    plan.add_parser(sub)
    checkpoint.add_parser(sub)
    convert.add_parser(sub)
    return parser


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)  # for the message, before parsing
    # SIGTERM unwinds like Ctrl-C (engines and ranks stopped on the way out); during RL steps the
    # job's StopFlag makes it finish the step and save first.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        # `kill -USR1 PID` writes every thread's stack to stderr and the command goes on: what a
        # job that seems stuck is waiting for, without a debugger
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, OSError, ValueError):  # a stderr with no file descriptor (called in-process)
            pass
    try:  # the imports too: a Ctrl-C while torch loads is one line, not a traceback
        from entr_megatron.utils.megatron_warnings import quiet_megatron_fallbacks  # lazy: inside the try

        quiet_megatron_fallbacks()  # before any command imports megatron; the job says once what is missing
        args = build_parser().parse_args(argv)
        command = args.command
        args.func(args)
    except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM, or a grace period over: stopped at once
        print(f"entr-megatron{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

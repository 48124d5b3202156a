"""Time `entr-megatron [COMMAND ...] --help` for every command and subcommand of the parser.

    python tools/bench_cli_help.py [--repeat 3] [--exe .venv/bin/entr-megatron] [--baseline]

Each --help runs as its own process, `--repeat` times; prints each command's times, their median
and range, and the median over all commands. With --baseline, `python -c pass` is timed the same
way first: the interpreter's own start, which no change of ours can remove. What a --help imports
is checked by tests/unit/test_cli_help.py; this tool only reports seconds (machine dependent).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

from entr_megatron.cli.main import build_parser


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser: ("train",), ("study", "run"), ..."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(*prefix, name), *commands(sub, (*prefix, name))]
    return found


def timed(argv: list[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--exe", default=shutil.which("entr-megatron", path=os.path.dirname(sys.executable)),
                   help="the entr-megatron script (default: the one beside this interpreter)")
    p.add_argument("--baseline", action="store_true", help="time `python -c pass` first")
    args = p.parse_args()
    rows = []
    if args.baseline:
        rows.append(("(python -c pass)", timed([sys.executable, "-c", "pass"], args.repeat)))
    for argv in [(), *commands(build_parser())]:
        rows.append((" ".join(argv) or "(entr-megatron)", timed([args.exe, *argv, "--help"], args.repeat)))
    print(f"{'command':<26}{'median s':>9}{'range s':>16}   times")
    for name, times in rows:
        print(f"{name:<26}{statistics.median(times):>9.2f}{min(times):>8.2f}-{max(times):<7.2f}  "
              + " ".join(f"{t:.2f}" for t in times))
    helps = [statistics.median(t) for name, t in rows if not name.startswith("(python")]
    print(f"median over the {len(helps)} --help: {statistics.median(helps):.2f} s, slowest {max(helps):.2f} s")


if __name__ == "__main__":
    main()

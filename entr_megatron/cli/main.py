"""The `entr-megatron` command line."""

from __future__ import annotations

import argparse
import sys

from entr_megatron import __version__
from entr_megatron.cli import demo, generate, plan, score, study, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="entr-megatron", description="Megatron-scale asynchronous RL with ENTR.")
    parser.add_argument("--version", action="version", version=f"entr-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parsers(sub)
    demo.add_parser(sub)
    score.add_parser(sub)
    generate.add_parser(sub)
    study.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

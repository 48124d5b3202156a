"""`entr-megatron --help`, and the --help of every command and subcommand, import no heavy package.

Building the parser imports each command's face (cli/<command>.py: its manual, flags and defaults);
the implementation, and torch with it, is imported when the command runs (docs/CONTRIBUTING.md,
"Imports at the top"). Asserted on what a fresh process has imported, not on seconds: the time
depends on the machine (tools/bench_cli_help.py prints it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("torch", "megatron", "transformers", "ray", "sglang", "numpy", "safetensors", "tokenizers", "pandas",
         "matplotlib", "scipy", "wandb")
"""Packages a --help must not import (numpy: torch's, pandas' and the others' first import)."""

COMMANDS = {"train", "sft", "eval", "score", "generate", "demo", "study", "study run", "study report", "plan",
            "checkpoint", "checkpoint verify", "convert", "convert hf-to-megatron", "convert megatron-to-hf",
            "convert verify"}

_PROBE = textwrap.dedent("""
    import argparse, contextlib, io, json, sys

    from entr_megatron.cli.main import build_parser, main

    for module in sys.argv[1:]:
        __import__(module)

    def commands(parser, prefix=()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield (*prefix, name)
                    yield from commands(sub, (*prefix, name))

    found = sorted(" ".join(c) for c in commands(build_parser()))
    helps = {}
    for argv in [[], *(c.split() for c in found)]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
        helps[" ".join(argv)] = out.getvalue()
    heavy = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(input())))
    print(json.dumps({"commands": found, "helps": helps, "heavy": heavy}))
""")


def _probe(*first: str) -> dict:
    """What a fresh process that imports `first`, then prints every --help, has imported."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *first], input=json.dumps(HEAVY), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_help_imports_no_heavy_package():
    seen = _probe()
    assert set(seen["commands"]) == COMMANDS, seen["commands"]  # a new command is checked here too
    for argv, text in seen["helps"].items():
        assert text.startswith("usage: entr-megatron"), (argv, text[:200])
    assert "--batch-tokens BATCH_TOKENS" in seen["helps"]["score"]  # the command's own flags, not just usage
    assert "--emit-score-input" in seen["helps"]["generate"]
    assert seen["heavy"] == [], f"--help imported {seen['heavy']}"


def test_the_probe_sees_a_heavy_import():
    """The same probe, with a command's implementation imported first, reports torch (the check can fail)."""
    assert "torch" in _probe("entr_megatron.cli.demo_simulation")["heavy"]

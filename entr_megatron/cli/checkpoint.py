"""`entr-megatron checkpoint verify PATH`: every checkpoint checked against its manifest.

    entr-megatron checkpoint verify runs/demo                  # a run directory (its checkpoints/)
    entr-megatron checkpoint verify runs/demo/checkpoints      # a checkpoint root
    entr-megatron checkpoint verify runs/demo/checkpoints/iter_0000100 [--sizes-only]

Prints one line per checkpoint (ok, or what is missing, resized or damaged), what `latest`
says, and the step `train` would resume from. Exit status: 0 when every checkpoint is good,
1 when one is not (the resume step is still printed when there is one), 2 when PATH holds
no checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from entr_megatron.checkpoint.directory import LATEST_FILE, CheckpointError, iter_dir, list_steps
from entr_megatron.checkpoint.manifest import choose_checkpoint, read_manifest, verify_checkpoint

__all__ = ["add_parser"]


def _root_and_steps(path: Path) -> tuple[Path, list[int] | None]:
    if path.name.startswith("iter_") and path.is_dir():
        return path.parent, [int(path.name.split("_", 1)[1])]
    for root in (path / "checkpoints", path):
        if (root / LATEST_FILE).exists() or list_steps(root):
            return root, None
    return path, None


def verify(args) -> None:
    path = Path(args.path)
    if not path.exists():
        print(f"entr-megatron checkpoint: {path} does not exist", file=sys.stderr)
        sys.exit(2)
    root, only = _root_and_steps(path)
    steps = only or list_steps(root)
    latest = (root / "latest").read_text(errors="replace").strip() if (root / "latest").exists() else None
    if not steps:
        print(f"entr-megatron checkpoint: no checkpoint in {path} (no iter_* directory"
              f"{'' if latest is None else f'; latest says {latest!r}'})", file=sys.stderr)
        sys.exit(2)
    bad = 0
    for step in steps:
        directory = iter_dir(root, step)
        problems = verify_checkpoint(directory, checksums=not args.sizes_only)
        try:
            manifest = read_manifest(directory)
        except CheckpointError:
            manifest = None
        size = f"{manifest['total_bytes'] / 2**20:.1f} MiB, {len(manifest['files'])} files" if manifest else "no manifest"
        print(f"{directory}: {'ok' if not problems else 'NOT USABLE'} ({size})")
        for problem in problems:
            print(f"    {problem}")
        bad += bool(problems)
    if only is None:
        print(f"latest: {latest if latest is not None else 'missing'}")
        try:
            choice = choose_checkpoint(root, checksums=not args.sizes_only)
            print(f"train resumes from step {choice.step}")
        except CheckpointError as e:
            print(f"train cannot resume: {str(e).splitlines()[0]} (see above; --restart-from-scratch starts over)")
            bad += 1
    sys.exit(1 if bad else 0)


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect learner checkpoints (verify)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    v = actions.add_parser("verify", help="check every checkpoint's files against its manifest",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("path", metavar="PATH", help="a run directory, a checkpoint root or one iter_* directory")
    v.add_argument("--sizes-only", action="store_true", help="compare sizes, skip the checksums (fast)")
    v.set_defaults(func=verify)

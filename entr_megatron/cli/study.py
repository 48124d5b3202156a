"""`entr-megatron study run | report`: scaling studies over any config field.

    entr-megatron study run SPEC.yaml [--out DIR] [--launcher local|ray] [--jobs N] [--dry-run] [--warmups-only]
    entr-megatron study report DIR [--out REPORT_DIR]

`run` validates the whole spec (every cell's config) before anything starts, then runs each
cell as an ordinary `train` run directory under DIR/cells/ (default DIR: runs/studies/<name>).
Rerunning skips finished cells and resumes interrupted ones; a failed cell is recorded with its
error message and the others go on (the exit code is 1 when any failed). One `run` at a time per
DIR: a second one exits 2 at once, naming the first (pid, host, start time). `report` writes the
results table (Parquet, CSV), plots and report.md (default: DIR/report; an --out that is DIR, lies
in DIR/cells or contains DIR is refused), listing every cell of the spec: those never run as
pending; a damaged study.json is an error naming it, a metrics line that is not UTF-8 or not JSON
a warning naming it (the cell's other lines are kept). The spec format: study/spec.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from entr_megatron.config.launcher import check_ray_reachable
from entr_megatron.study.spec import SpecError, load_spec
from entr_megatron.utils.outputs import check_output
from entr_megatron.utils.ray_connect import RayConnectError

__all__ = ["add_parser"]


def _fail(msg: str, code: int = 2) -> None:
    print(f"entr-megatron study: {msg}", file=sys.stderr)
    sys.exit(code)


def run(args) -> None:
    from entr_megatron.study.runner import StudyLockedError, WarmupError, WarmupStopped, run_study  # lazy: torch

    try:
        spec = load_spec(args.spec)
    except (SpecError, FileNotFoundError) as e:
        _fail(f"invalid spec: {e}")
    out = Path(args.out) if args.out else Path("runs") / "studies" / spec.name
    if args.dry_run:
        try:
            cells = spec.select(spec.cells(), args.only)
        except SpecError as e:
            _fail(str(e))
        print(f"{len(cells)} cells, axes {spec.axes}, into {out}:")
        for cell in cells:
            print(f"  {cell.id}")
        return
    ray_address = None
    if args.launcher == "ray":
        ray_address = spec.base_raw.get("launcher", {}).get("ray_address")
        try:  # before Ray's half-minute of connection retries
            check_ray_reachable(ray_address, "base.launcher.ray_address")
        except ValueError as e:
            _fail(str(e))
    try:
        result = run_study(spec, out, launcher=args.launcher, jobs=args.jobs, ray_address=ray_address,
                           only=args.only, warmups_only=args.warmups_only)
    except (SpecError, StudyLockedError, RayConnectError, WarmupError) as e:
        _fail(str(e))
    except WarmupStopped as e:
        print(f"[study] {e}", file=sys.stderr, flush=True)
        sys.exit(130)
    print(json.dumps({"out": result["out"], "done": len(result["done"]), "skipped": len(result["skipped"]),
                      "failed": result["failed"], "interrupted": result["interrupted"]}))
    if result["interrupted"]:
        sys.exit(128 + result["signal"])
    if result["failed"]:
        sys.exit(1)


def report(args) -> None:
    # lazy: pandas (and matplotlib when it plots)
    from entr_megatron.study.report import write_report
    from entr_megatron.study.results import StudyDirError

    study = Path(args.dir)
    if not (study / "study.json").is_file():
        _fail(f"{study} is not a study directory (no study.json); give the --out of `study run`")
    try:  # the report goes beside the study's files (DIR/report by default), never among them
        if args.out:
            check_output("--out", args.out, [("DIR", study)], refused=("is", "contains"))
            check_output("--out", args.out, [("DIR/cells", study / "cells")])
    except ValueError as e:
        _fail(str(e))
    try:
        path = write_report(study, Path(args.out) if args.out else None, table=args.table)
    except StudyDirError as e:  # a damaged study.json
        _fail(str(e))
    print(json.dumps({"report": str(path)}))


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="scaling studies: run a grid of train runs, then report on them",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    study = p.add_subparsers(dest="study_command", required=True, metavar="STUDY_COMMAND")
    r = study.add_parser("run", help="run (or resume) every cell of a spec")
    r.add_argument("spec", metavar="SPEC.yaml")
    r.add_argument("--out", default=None, metavar="DIR", help="study directory (default: runs/studies/<name>)")
    r.add_argument("--launcher", choices=("local", "ray"), default="local",
                   help="cells as local processes or Ray tasks (default: local)")
    r.add_argument("--jobs", type=int, default=1, metavar="N", help="cells at a time (default: 1)")
    r.add_argument("--only", action="append", default=[], metavar="AXIS=V1[,V2...]",
                   help="run only the cells with these axis values (repeat to narrow further), "
                        "e.g. --only seed=1 --only inter_lag=0,16,64")
    r.add_argument("--dry-run", action="store_true", help="validate the spec and list its cells; run nothing")
    r.add_argument("--warmups-only", action="store_true",
                   help="run the spec's warm-ups (each seed's with warmup.per_seed), then stop: to measure what the "
                        "cells start from before any cell runs")
    r.set_defaults(func=run)
    q = study.add_parser("report", help="results table, plots and report.md of a study directory")
    q.add_argument("dir", metavar="DIR")
    q.add_argument("--out", default=None, metavar="REPORT_DIR", help="default: DIR/report")
    q.add_argument("--table", choices=("key", "all"), default="key",
                   help="results table columns: the key metrics (default, small enough to commit) or all")
    q.set_defaults(func=report)

"""`entr-megatron plan`: predicted step time, throughput, idle fractions and policy lag of each
controller mode, from a cluster description or a run directory (study/planner.py).

    entr-megatron plan CLUSTER.yaml [--modes sync,fully_async] [--steps N]
    entr-megatron plan --from-run RUN_DIR [--engine-costs FILE.yaml | --measure-engine] [--response-sigma S]

A cluster YAML has `costs`: the time costs in seconds, every one required (>= 0; write 0 for one
that does not apply): decode_base_s, decode_per_seq_s, prefill_per_token_s, train_per_token_s,
train_overhead_s, push_s, swap_s; and the engines' shape (defaults in brackets): engines [1] in
[1, 4096], max_batch_size [64] in [1, 1048576], prompt_len [16] in [0, 1048576], response_median
[64] in [0, 1048576], response_sigma [0] in [0, 10], max_new_tokens [128] in [1, 1048576]. And
optionally `workload` (defaults in brackets): prompts_per_step [8] in [1, 65536], n [8] in
[1, 1024], max_policy_lag [4] in [0, 1024] (train's bound; >= 1 for one_step_off and
fully_async), steps [50] in [1, 100000], max_inflight_groups [null] >= 1, inter_lag [0] and
intra_lag [0] in [0, 1024], seed [0] >= 0; steps x prompts_per_step x n at most 1000000 (each
sequence is simulated: some 15 s per mode at that bound). Every value is checked before anything
is simulated; an error names the field and its valid range (exit status 2). With --from-run the
learner's costs, the push time, the response lengths and the workload come from the run; the
engine's decode costs from --engine-costs (a YAML mapping of decode_base_s, decode_per_seq_s,
prefill_per_token_s) or --measure-engine (times the embedded engine on the run's model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from entr_megatron.config.loader import load_config, read_yaml
from entr_megatron.config.validate import FieldError
from entr_megatron.controller.job.run_dir import RunPaths
from entr_megatron.study.planner import (MODES, Costs, SimulationBoundError, Workload, costs_from_run, measure_engine,
                                         read_engine_costs, simulate)

__all__ = ["add_parser"]


def _fail(msg: str) -> None:
    print(f"entr-megatron plan: {msg}", file=sys.stderr)
    sys.exit(2)


def _read_yaml(path: str) -> dict:
    try:
        return read_yaml(path)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def run(args) -> None:
    modes = args.modes.split(",") if args.modes else list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        _fail(f"--modes: unknown mode(s) {bad}; valid: {list(MODES)}")
    if args.steps is not None and args.steps < 1:
        _fail(f"--steps must be an integer >= 1, got {args.steps}")
    try:
        if args.from_run:
            run_dir = Path(args.from_run)
            if not (run_dir / "metrics.jsonl").exists() or not (run_dir / "config.yaml").exists():
                _fail(f"--from-run: {run_dir} is not a run directory (needs config.yaml and metrics.jsonl)")
            if args.engine_costs:
                engine = read_engine_costs(_read_yaml(args.engine_costs), f"--engine-costs {args.engine_costs}")
            elif args.measure_engine:
                model = RunPaths(run_dir).latest_model()
                if model is None:
                    _fail(f"--measure-engine: {run_dir} holds no model to time")
                cfg = load_config(run_dir / "config.yaml")
                engine = measure_engine(str(model), dtype=cfg.rollout.dtype,
                                        num_threads=cfg.rollout.embedded.num_threads,
                                        max_batch_size=cfg.rollout.embedded.max_batch_size)
                print(f"[plan] measured engine: {json.dumps(engine)}", file=sys.stderr)
            else:
                _fail("--from-run needs the engine's decode costs: --engine-costs FILE or --measure-engine")
            costs, workload = costs_from_run(str(run_dir), engine, response_sigma=args.response_sigma)
        else:
            if not args.cluster:
                _fail("give a cluster YAML or --from-run RUN_DIR")
            data = _read_yaml(args.cluster)
            unknown = sorted(set(data) - {"costs", "workload"}, key=str)
            if unknown or "costs" not in data:
                _fail(f"{args.cluster}: needs a `costs` mapping (and optionally `workload`); unknown: {unknown}")
            costs = Costs.from_dict(data["costs"], f"{args.cluster}: costs")
            workload = Workload.from_dict(data.get("workload") or {}, f"{args.cluster}: workload")
        if args.steps is not None:
            workload = dataclasses.replace(workload, steps=args.steps)
        for mode in modes:
            workload.check_mode(mode)
        rows = [simulate(costs, workload, mode).summary() for mode in modes]
    except FieldError as e:  # a field's value: say which file it came from
        _fail(f"{args.cluster or args.from_run}: {e}")
    except (ValueError, SimulationBoundError) as e:
        _fail(str(e))
    print(f"{'mode':<14}{'step_s':>9}{'tok/s':>10}{'learner idle':>14}{'engine idle':>13}{'lag mean':>10}{'lag max':>9}")
    for r in rows:
        print(f"{r['mode']:<14}{r['step_s']:>9.3f}{r['tokens_per_s']:>10.1f}{r['learner_idle']:>14.2f}"
              f"{r['engine_idle']:>13.2f}{r['lag_mean']:>10.2f}{r['lag_max']:>9.0f}")
    if "sync" in modes:
        base = next(r for r in rows if r["mode"] == "sync")["tokens_per_s"]
        for r in rows:
            if r["mode"] != "sync" and base > 0:
                print(f"{r['mode']}: {r['tokens_per_s'] / base:.2f}x the throughput of sync")
    print(json.dumps({"costs": dataclasses.asdict(costs), "workload": dataclasses.asdict(workload), "plans": rows}))


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict step time, throughput, idle time and lag of each controller mode",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", nargs="?", default=None, metavar="CLUSTER.yaml")
    p.add_argument("--from-run", default=None, metavar="RUN_DIR", help="costs and workload of a run directory")
    p.add_argument("--engine-costs", default=None, metavar="FILE.yaml", help="engine decode costs (with --from-run)")
    p.add_argument("--measure-engine", action="store_true", help="time the embedded engine on the run's model")
    p.add_argument("--response-sigma", type=float, default=0.0, help="lognormal spread of response lengths")
    p.add_argument("--modes", default=None, help="comma-separated (default: all four)")
    p.add_argument("--steps", type=int, default=None, help="simulated steps (default: the workload's)")
    p.set_defaults(func=run)

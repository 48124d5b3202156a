"""`entr-megatron plan`: predicted step time, throughput, idle fractions and policy lag of each
controller mode, from a cluster description or a run directory (study/planner.py).

    entr-megatron plan CLUSTER.yaml [--modes sync,fully_async] [--steps N]
    entr-megatron plan --from-run RUN_DIR [--engine-costs FILE.yaml | --measure-engine] [--response-sigma S]

A cluster YAML has `costs` (Costs fields: decode_base_s, decode_per_seq_s, prefill_per_token_s,
train_per_token_s, train_overhead_s, push_s, swap_s, engines, max_batch_size, prompt_len,
response_median, response_sigma, max_new_tokens) and `workload` (prompts_per_step, n,
max_policy_lag, steps, max_inflight_groups, inter_lag, intra_lag, seed). With --from-run the
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

__all__ = ["add_parser"]


def _fail(msg: str) -> None:
    print(f"entr-megatron plan: {msg}", file=sys.stderr)
    sys.exit(2)


def _read_yaml(path: str) -> dict:
    from entr_megatron.config.loader import read_yaml

    try:
        return read_yaml(path)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def run(args) -> None:
    from entr_megatron.study.planner import MODES, Costs, Workload, costs_from_run, measure_engine, simulate

    modes = args.modes.split(",") if args.modes else list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        _fail(f"--modes: unknown mode(s) {bad}; valid: {list(MODES)}")
    try:
        if args.from_run:
            run_dir = Path(args.from_run)
            if not (run_dir / "metrics.jsonl").exists() or not (run_dir / "config.yaml").exists():
                _fail(f"--from-run: {run_dir} is not a run directory (needs config.yaml and metrics.jsonl)")
            if args.engine_costs:
                engine = _read_yaml(args.engine_costs)
            elif args.measure_engine:
                from entr_megatron.controller.run_dir import RunPaths

                model = RunPaths(run_dir).latest_model()
                if model is None:
                    _fail(f"--measure-engine: {run_dir} holds no model to time")
                from entr_megatron.config.loader import load_config

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
            unknown = sorted(set(data) - {"costs", "workload"})
            if unknown or "costs" not in data:
                _fail(f"{args.cluster}: needs a `costs` mapping (and optionally `workload`); unknown: {unknown}")
            costs = Costs.from_dict(data["costs"], f"{args.cluster}: costs")
            known = {f.name for f in dataclasses.fields(Workload)}
            wl = data.get("workload") or {}
            if set(wl) - known:
                _fail(f"{args.cluster}: workload: unknown key(s) {sorted(set(wl) - known)}; valid: {sorted(known)}")
            workload = Workload(**wl)
    except ValueError as e:
        _fail(str(e))
    if args.steps:
        workload = dataclasses.replace(workload, steps=args.steps)
    rows = [simulate(costs, workload, mode).summary() for mode in modes]
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

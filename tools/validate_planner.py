"""The throughput planner against measured runs: predicted vs measured mean step time and mean
policy lag for sync, one_step_off and fully_async, per configuration.

    python tools/validate_planner.py runs/studies/modes [--out TABLE.md]

The study (examples/studies/modes.yaml) has one cell per mode x configuration x seed; the seeds
are also repeats of the timing (this machine's speed drifts by 10-20% between minutes). For each
configuration and seed the costs come from its *sync* cell only (learner cost fitted from its
steps, push time from its logs) plus the embedded engine timed on the configuration's model
(`measure_engine`); the other modes of that seed are then predicted, not fitted. A row gives the
means over the seeds and the range of the per-run errors. Steps before --skip are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd

from entr_megatron.config.loader import load_config
from entr_megatron.controller.job.run_dir import RunPaths
from entr_megatron.study.planner import costs_from_run, measure_engine, simulate
from entr_megatron.utils.run_log import read_metrics

MODES = ("sync", "one_step_off", "fully_async")


def measured(cell: Path, skip: int) -> tuple[float, float, int]:
    rows = read_metrics(cell / "metrics.jsonl")[skip:]
    return (sum(r["timing/step_s"] for r in rows) / len(rows),
            sum(r["policy_lag/mean"] for r in rows) / len(rows), len(rows))


def _label(axis: str, config) -> str:
    return f"{axis}={config}" if config != "" else "(one configuration)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip", type=int, default=3, help="leading steps left out (default 3)")
    parser.add_argument("--axis", default="rollout.prompts_per_step",
                        help="the configuration axis (a study without it has one configuration)")
    args = parser.parse_args()
    cells = {}
    for cell_json in sorted((args.study / "cells").glob("*/cell.json")):
        info = json.loads(cell_json.read_text())
        axes = info["axes"]
        config = axes.get(args.axis, "")  # "": the study's one configuration
        cells[(axes["controller.mode"], config, axes.get("controller.seed", 0))] = cell_json.parent
    configs = sorted({c for _, c, _ in cells})
    seeds = sorted({s for _, _, s in cells})
    rows = []  # one per cell: measured and predicted mean step time and lag
    for config in configs:
        engine = None
        for seed in seeds:
            sync = cells.get(("sync", config, seed))
            if sync is None:
                continue
            if engine is None:  # the engine's shape, timed once per configuration on its model
                cfg = load_config(sync / "config.yaml")
                rough, _ = costs_from_run(str(sync), {"decode_base_s": 1.0, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0}, skip_steps=args.skip)
                engine = measure_engine(str(RunPaths(sync).latest_model()), dtype=cfg.rollout.dtype,
                                        prompt_len=rough.prompt_len, tokens=max(cfg.rollout.sampling.max_new_tokens, 8) * 2,
                                        num_threads=cfg.rollout.embedded.num_threads,
                                        max_batch_size=cfg.rollout.embedded.max_batch_size, repeats=5)
            costs, _ = costs_from_run(str(sync), engine, skip_steps=args.skip)
            print(f"[validate] {_label(args.axis, config)} seed {seed}: {json.dumps(dataclasses.asdict(costs))}",
                  file=sys.stderr)
            for mode in MODES:
                cell = cells.get((mode, config, seed))
                if cell is None:
                    continue
                _, workload = costs_from_run(str(cell), engine, skip_steps=args.skip)
                step_s, lag, steps = measured(cell, args.skip)
                plan = simulate(costs, dataclasses.replace(workload, steps=steps + args.skip), mode)
                predicted_s = sum(plan.step_s[args.skip:]) / len(plan.step_s[args.skip:])
                lags = plan.step_lag_mean[args.skip:]  # per step, as the measured policy_lag/mean
                rows.append({"config": config, "mode": mode, "step_s": step_s, "predicted_s": predicted_s,
                             "lag": lag, "predicted_lag": sum(lags) / len(lags)})
    table = pd.DataFrame(rows)
    table["error"] = table.predicted_s / table.step_s - 1
    by_row = dict(list(table.groupby(["config", "mode"])))
    lines = ["| config | mode | runs | measured step s | predicted step s | error | error per run | "
             "measured lag | predicted lag | lag error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst_time, worst_lag = 0.0, 0.0
    for config in configs:
        for mode in MODES:
            got = by_row.get((config, mode))
            if got is None:
                continue
            m = got.mean(numeric_only=True)
            err = m.predicted_s / m.step_s - 1  # of the means, not the mean of the per-run errors
            worst_time, worst_lag = max(worst_time, abs(err)), max(worst_lag, abs(m.predicted_lag - m.lag))
            lines.append(f"| {_label(args.axis, config)} | {mode} | {len(got)} | {m.step_s:.3f} | {m.predicted_s:.3f} | {err:+.0%} "
                         f"| {got.error.min():+.0%} .. {got.error.max():+.0%} "
                         f"| {m.lag:.2f} | {m.predicted_lag:.2f} | {m.predicted_lag - m.lag:+.2f} |")
    lines.append("")
    lines.append(f"Largest step-time error {worst_time:.0%}; largest lag error {worst_lag:.2f} versions "
                 f"(means over {len(seeds)} run(s) per row, each run predicted from the sync run of its seed).")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

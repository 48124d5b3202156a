"""The same RL run in several controller modes: wall-clock per step, ratio against `sync`.

    python tools/compare_modes.py --config examples/cpu_demo.yaml --steps 30 [--model SFT_DIR] [key=value ...]

Every mode starts from the same model (`--model`, e.g. a run's `sft/model`; default:
a warm-up is run once with the config's `sft` section into the output directory)
and trains `--steps` steps with identical settings except `controller.mode`. The
baseline (`sync`: generate, train, push, one after the other) is measured in the
same invocation. Printed per mode: mean and median step time (metrics.jsonl
`timing/step_s`, first step excluded: process warm-up), RL wall time, time spent
waiting for rollouts, reward and the largest policy lag seen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entr_megatron.utils.run_log import read_metrics  # noqa: E402

MODES = ("sync", "one_step_off", "fully_async")


def cli(*args: str, env: dict | None = None) -> str:
    """What `entr-megatron args...` prints; a failure ends this tool with its stderr's tail."""
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", *args], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        sys.exit(f"entr-megatron {args[0]} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def warmup_model(config: str, out: Path, overrides: list[str]) -> str:
    """The config's SFT warm-up, run into OUT/warmup; returns the HF directory of its model."""
    print(f"warm-up (sft) into {out / 'warmup'} ...", file=sys.stderr, flush=True)
    cli("sft", "--config", config, "--run-dir", str(out / "warmup"), *overrides)
    return str(out / "warmup" / "sft" / "model")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default=None, help="HF directory every mode starts from (default: run the config's SFT)")
    p.add_argument("--modes", nargs="+", default=["sync", "fully_async"], choices=MODES)
    p.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.modes[0] != "sync":
        args.modes = ["sync"] + [m for m in args.modes if m != "sync"]
    out = Path(args.out or tempfile.mkdtemp(prefix="compare_modes_"))
    model = args.model or warmup_model(args.config, out, args.overrides)
    rows = []
    for mode in args.modes:
        run_dir = out / mode
        print(f"{mode}: {args.steps} steps into {run_dir} ...", file=sys.stderr, flush=True)
        result = json.loads(cli(
            "train", "--config", args.config, "--run-dir", str(run_dir), "--max-steps", str(args.steps),
            *args.overrides, f"model.path={model}", "model.architecture=null", "sft=null",
            f"controller.mode={mode}", f"controller.train_steps={args.steps}", "controller.checkpoint_interval=0",
            "task.eval_size=8", "logging.progress_bar=false",
        ).strip().splitlines()[-1])
        metrics = read_metrics(run_dir / "metrics.jsonl")
        steps = [m["timing/step_s"] for m in metrics[1:]]
        rows.append({
            "mode": mode, "mean": statistics.mean(steps), "median": statistics.median(steps), "wall": result["wall_s"],
            "wait": statistics.mean(m["timing/wait_rollout_s"] for m in metrics[1:]),
            "reward": statistics.mean(m["reward/mean"] for m in metrics), "lag": max(m["policy_lag/max"] for m in metrics),
        })
    base = rows[0]
    print(f"\n{args.steps} steps per mode, from {model}\n")
    print("| mode | step time mean | median | vs sync (mean) | RL wall time | vs sync | rollout wait / step | reward mean | max lag |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['mean']:.3f} s | {r['median']:.3f} s | {r['mean'] / base['mean']:.3f}x | "
              f"{r['wall']:.1f} s | {r['wall'] / base['wall']:.3f}x | {r['wait']:.3f} s | {r['reward']:.3f} | {r['lag']:.0f} |")


if __name__ == "__main__":
    main()

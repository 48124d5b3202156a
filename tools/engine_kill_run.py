"""A `train` run whose embedded engine is killed (SIGKILL) every N steps, against undisturbed runs.

    python tools/engine_kill_run.py --config examples/studies/base.yaml --every 20 --seeds 0 1 2 \\
        --out runs/engine_kills [key=value ...]

For each seed: one undisturbed run and (seed 0 only, or --kill-all-seeds) one run whose engine
process ("entr-engine") is killed whenever metrics.jsonl reaches a multiple of --every steps
below controller.train_steps (kills stop before the last step: the final held-out evaluation's
engine replacement is tested on its own, tests/unit/test_controller_replacing.py).
Prints, per run: exit code, steps in metrics.jsonl (each exactly once?), engines/restarts at the
end, held-out sampled accuracy before and after RL (eval.json), wall time; then the killed run's
accuracy against the undisturbed seeds' range. Run directories are kept under --out.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def run(config: str, run_dir: Path, overrides: list[str], every: int | None, last: int = 0) -> dict:
    cmd = [sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", config, "--run-dir", str(run_dir),
           *overrides]
    t0, kills = time.monotonic(), []
    with open(run_dir.with_suffix(".log"), "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while job.poll() is None:
            time.sleep(0.2)
            done = len(_steps(run_dir))
            if every and done and done % every == 0 and done < last and done not in kills:
                engines = [p for p in psutil.Process(job.pid).children(recursive=True) if p.name() == "entr-engine"]
                for p in engines:
                    p.send_signal(signal.SIGKILL)
                kills.append(done)
                print(f"  {run_dir.name}: killed {len(engines)} engine(s) after step {done}", flush=True)
    steps = _steps(run_dir)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]) if steps else {}
    evals = json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").exists() else {}
    return {"run": run_dir.name, "exit": job.returncode, "steps": len(steps),
            "each_once": steps == list(range(len(steps))), "kills": len(kills),
            "restarts": last.get("engines/restarts"), "wall_s": round(time.monotonic() - t0, 1),
            "before": evals.get("before_rl", {}).get("eval/sampled_accuracy"),
            "after": evals.get("after_rl", {}).get("eval/sampled_accuracy")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", default="runs/engine_kills")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kill-all-seeds", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from entr_megatron.config.loader import load_config

    steps = load_config(args.config, args.overrides).controller.train_steps  # kills stop before the last step
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        over = [*args.overrides, f"controller.seed={seed}"]
        for killed in ([False, True] if seed == args.seeds[0] or args.kill_all_seeds else [False]):
            name = f"seed{seed}_{'killed' if killed else 'undisturbed'}"
            if (out / name / "eval.json").exists():
                print(f"  {name}: exists, reusing", flush=True)
                rows.append(run(args.config, out / name, over, None))
                continue
            rows.append(run(args.config, out / name, over, args.every if killed else None, steps))
            print(json.dumps(rows[-1]), flush=True)
    calm = [r["after"] for r in rows if "undisturbed" in r["run"] and r["after"] is not None]
    print("\n| run | exit | steps | each once | kills | engines/restarts | acc before | acc after | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['exit']} | {r['steps']} | {r['each_once']} | {r['kills']} | {r['restarts']} | "
              f"{r['before']} | {r['after']} | {r['wall_s']} |")
    if calm:
        print(f"\nundisturbed seeds: held-out sampled accuracy {min(calm):.3f}..{max(calm):.3f}")


if __name__ == "__main__":
    main()

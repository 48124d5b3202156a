"""The demo's job on one node and on a 3-node Ray cluster of loopback addresses, back to back.

    python tools/many_nodes_demo.py --config examples/cpu_demo.yaml --out runs/many_nodes [--repeats 2]
        [--modes sync fully_async] [--steps N] [key=value ...]

One SFT warm-up (the config's `sft` section, local) gives the model every run starts from (same
seeds: controller.seed as configured). Then, per repeat and mode, the same job twice, one right
after the other: on one node (launcher.kind local: processes) and on a Ray cluster of this machine
(utils/ray_nodes.py): the head 127.0.0.2 runs the controller only, node A 127.0.0.3 the learner's
TP 2 ranks ({learner: 2}), nodes B 127.0.0.4 and C 127.0.0.5 one engine each ({engine: 2} each).
Both layouts get parallel.tp=2, rollout.num_engines=2 and one torch thread per rank and engine
(the cores are the machine's either way). The cluster starts once (its start-up is reported, not
counted in a run's wall time).

Written to OUT/results.json and printed as a table: per run the wall time of `train` (the process,
from start to exit), RL wall time (`wall_s` of its result), held-out accuracy after RL (greedy and
sampled, `eval_size` problems) and the push per weight version (metrics `weight_sync/transfer_s`:
the sender's transfer of one version; median and range over the run's steps), with the machine's
load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entr_megatron.utils.ray_nodes import LoopbackCluster, RayNode  # noqa: E402
from entr_megatron.utils.run_log import read_metrics  # noqa: E402

NODES = [RayNode("head", "127.0.0.2", cpus=0), RayNode("a", "127.0.0.3", cpus=2, resources={"learner": 2}),
         RayNode("b", "127.0.0.4", cpus=2, resources={"engine": 2}), RayNode("c", "127.0.0.5", cpus=2, resources={"engine": 2})]
COMMON = ["parallel.tp=2", "launcher.nproc_per_node=2", "rollout.num_engines=2", "launcher.cpu_threads_per_rank=1",
          "rollout.embedded.num_threads=1", "logging.progress_bar=false"]


def train(config: str, run_dir: Path, overrides: list[str], env: dict | None = None) -> dict:
    """One `train` run; its result JSON, wall time and metrics."""
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", config,
                               "--run-dir", str(run_dir), *overrides], stdout=subprocess.PIPE, stderr=log, text=True,
                              env={**os.environ, **(env or {})})
    wall = time.monotonic() - t0
    if proc.returncode:
        sys.exit(f"train failed (exit {proc.returncode}); see {run_dir}.log")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = read_metrics(run_dir / "metrics.jsonl")
    push = [r["weight_sync/transfer_s"] for r in rows if r.get("weight_sync/transfer_s")]
    return {"wall_s": wall, "rl_wall_s": result["wall_s"], "steps": result["steps"], "load_before": load,
            "greedy_before": result["eval_before"]["eval/accuracy"],
            "sampled_before": result["eval_before"]["eval/sampled_accuracy"],
            "greedy_after": result["eval_after"]["eval/accuracy"],
            "sampled_after": result["eval_after"]["eval/sampled_accuracy"],
            "push_s_median": statistics.median(push) if push else None,
            "push_s_min": min(push, default=None), "push_s_max": max(push, default=None),
            "gbytes_per_s_median": statistics.median([r["weight_sync/gbytes_per_s"] for r in rows
                                                      if r.get("weight_sync/gbytes_per_s")] or [0.0]),
            "lag_max": max(r["policy_lag/max"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/cpu_demo.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["sync", "fully_async"])
    p.add_argument("--steps", type=int, default=None, help="controller.train_steps (default: the config's)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [*COMMON, *args.overrides] + ([f"controller.train_steps={args.steps}"] if args.steps else [])
    model = out / "warmup" / "sft" / "model"
    if not (model / "config.json").exists():
        print("warm-up (sft) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "sft", "--config", args.config, "--run-dir",
                        str(out / "warmup"), *args.overrides], check=True, stdout=subprocess.DEVNULL)
    start = [f"model.path={model}", "model.architecture=null", *extra]
    results = []
    t0 = time.monotonic()
    with LoopbackCluster(NODES) as cluster:
        startup = time.monotonic() - t0
        print(f"3-node cluster up in {startup:.1f} s at {cluster.address}", file=sys.stderr, flush=True)
        ray = ["launcher.kind=ray", f"launcher.ray_address={cluster.address}", "launcher.ray_learner_resources={learner: 1}",
               "launcher.ray_engine_resources={engine: 1}"]
        for rep in range(args.repeats):
            for mode in args.modes:
                layouts = [("1 node", [], None), ("3 nodes", ray, cluster.driver_env)]
                for layout, more, env in layouts[::-1] if rep % 2 else layouts:  # which runs first alternates
                    run_dir = out / f"{mode}_{layout.replace(' ', '')}_{rep}"
                    if run_dir.exists():  # this tool's own earlier run: `train` would resume it (0 steps)
                        shutil.rmtree(run_dir)
                    print(f"repeat {rep}: {mode} on {layout} ...", file=sys.stderr, flush=True)
                    r = train(args.config, run_dir, [*start, f"controller.mode={mode}", *more], env)
                    results.append({"repeat": rep, "mode": mode, "layout": layout, **r})
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                    (out / "results.json").write_text(json.dumps({"cluster_startup_s": startup, "runs": results},
                                                                 indent=1))
    print("| mode | layout | repeat | wall (s) | RL wall (s) | greedy after | sampled after | push per version (s): "
          "median [min, max] | load before |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['layout']} | {r['repeat']} | {r['wall_s']:.0f} | {r['rl_wall_s']:.0f} | "
              f"{r['greedy_after']:.3f} | {r['sampled_after']:.3f} | {r['push_s_median']:.4f} "
              f"[{r['push_s_min']:.4f}, {r['push_s_max']:.4f}] | {r['load_before']:.1f} |")


if __name__ == "__main__":
    main()

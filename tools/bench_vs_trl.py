"""Our `train` against TRL's GRPOTrainer on the same job, side by side, in one run.

    EXTRAS=dev,peers bash scripts/setup.sh     # TRL, pinned, beside the CPU torch
    python tools/bench_vs_trl.py [--config examples/cpu_demo.yaml] [--steps 250] [--seeds 0 1 2]
        [--systems trl sync one_step_off fully_async] [--out DIR] [--model SFT_DIR] [key=value ...]

Every system starts from the same model (`--model`; default: the config's SFT warm-up, run once
into `--out`) and trains `--steps` GRPO steps on the same prompts: prompt i of seed s is the
i-th of our `PromptStream(task, prompts_per_step, s)` for both, `prompts_per_step` prompts x
`rollout.sampling.n` samples per step. Runs are interleaved (each seed runs every system, the
order rotated from seed to seed) so that a slow spell of the machine does not fall on one system.

The same job: the config's learning rate, warm-up steps and constant schedule, gradient clip,
Adam betas and eps, PPO clip widths (`algorithm.clip_range`: 0.2 / 0.28 in the demo), no KL,
token-mean loss (TRL's `dapo` on one process), GRPO advantages with the group std, temperature /
top-p / top-k, max new tokens, one optimizer step per batch (`num_iterations=1`, one mini-batch).
What differs, and why it is fair:
- TRL runs one process with a torch thread per core this process may use (its affinity mask);
  ours puts the same cores where its config says (`controller/wiring.cpu_threads`: unset fields
  give the waiting side's cores to the working side in sync mode, split them when both work).
- TRL's gradient checkpointing (on by default) is turned off: ours does not recompute activations.
- Our correction (`algorithm.correction`, ENTR in the demo) runs in ours; TRL has no off-policy
  correction (it is on-policy). In sync mode ours is on-policy too and the mask is idle.
Held-out accuracy of every final model is measured by our evaluation (`controller/job/evaluation.py`:
greedy and sampled, `task.eval_size` test problems drawn with the run's seed), for TRL by
`entr-megatron eval --model`, for ours by `train`'s own eval after RL: the same function, problems
and seed.

Printed: per system, median over seeds (and the range) of RL steps per second and trained tokens
(prompt + response) per second, as ratios against TRL; the RL wall time (the training loop only:
`trainer.train()` / `Controller.run`), the start-up (process start to the first RL step, our
held-out evaluation before RL taken out: TRL's runs in its own process) and the process wall time
(start to exit); held-out accuracy before and after.

`--scale 0.8M 3M 12M` runs the job at each model size (SCALES: the demo's architecture widened,
every size with its own warm-up to the same target accuracy; `--models 12M=DIR` reuses one), with
the system `sync_1thread` (sync mode, one thread per side) beside the others, and adds:
- the step's time budget per size: generation and the learner step with 2 threads each (sync) and
  with 1 each (sync_1thread), the push, the rest;
- the ceiling of overlap on this machine: fully_async runs generation and training at once on one
  core each, so its step is at best max(gen_1, learn_1), where a sequential step on both cores
  takes gen_2 + learn_2; the ratio of the two is the most fully_async can gain over one process
  that runs both phases on both cores in turn (TRL);
- the learner's arithmetic against HF transformers' fwd + bwd + AdamW on the same shapes
  (`tools/bench_learner.py --hf-baseline`, TP=1, both cores);
- OUT/scale.csv (one row per size and system) and OUT/scale.png (steps/s against TRL by size), over
  every size under OUT (OUT/SIZE/scale_rows.json): a size run later into the same OUT joins them.

    python tools/bench_vs_trl.py --scale 0.8M 3M 12M --seeds 0 1 2 --out runs/bench_scale
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_modes import cli, warmup_model  # noqa: E402  (tools/, this script's directory)

OURS = ("sync", "one_step_off", "fully_async", "sync_1thread")
SYSTEMS = ("trl", *OURS)
ONE_THREAD = ["rollout.embedded.num_threads=1", "launcher.cpu_threads_per_rank=1"]

# name: (Qwen3 fields set over the config's `model.architecture`, RL steps per run by default).
# 0.8M is the demo's model; the others widen it (4 layers each), so that a 2-core run takes minutes.
SCALES = {
    "0.8M": ({}, 100),
    "3M": ({"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 32}, 50),
    "12M": ({"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 64}, 20),
    "40M": ({"hidden_size": 768, "intermediate_size": 2304, "num_attention_heads": 12, "num_key_value_heads": 4,
             "head_dim": 64, "num_hidden_layers": 6}, 20),
}
TIMINGS = ("step_s", "wait_rollout_s", "learner_step_s", "push_s")


def _cli(*args: str, env: dict | None = None) -> tuple[dict, float]:
    """The last JSON line `entr-megatron args...` prints, and the process's wall time."""
    t0 = time.perf_counter()
    stdout = cli(*args, env=env)
    return json.loads(stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def _job_overrides(model: str, steps: int, seed: int) -> list[str]:
    return [f"model.path={model}", "model.architecture=null", "sft=null", f"controller.train_steps={steps}",
            f"controller.seed={seed}", "controller.checkpoint_interval=0", "controller.eval_interval=0",
            "logging.progress_bar=false"]


def run_ours(args: argparse.Namespace, system: str, model: str, seed: int, out: Path) -> dict:
    from entr_megatron.utils.run_log import read_metrics

    run_dir = out / f"{system}-seed{seed}"
    mode, threads = ("sync", ONE_THREAD) if system == "sync_1thread" else (system, [])
    launched = time.time()
    result, process_s = _cli("train", "--config", args.config, "--run-dir", str(run_dir), "--max-steps",
                             str(args.steps), *args.overrides, *_job_overrides(model, args.steps, seed),
                             f"controller.mode={mode}", *threads)
    rows = read_metrics(run_dir / "metrics.jsonl")
    steady = rows[min(2, len(rows) - 1):]  # the first steps warm caches and threads up
    return {"rl_s": result["wall_s"], "process_s": process_s, "steps": result["steps"],
            "startup_s": result["rl_started_unix"] - launched - result["eval_before_s"],
            "tokens": sum(r["rollout/tokens"] for r in rows),
            "timing": {key: statistics.median(r[f"timing/{key}"] for r in steady) for key in TIMINGS},
            "before": result["eval_before"], "after": result["eval_after"]}


def run_trl(args: argparse.Namespace, model: str, seed: int, out: Path) -> dict:
    run_dir = out / f"trl-seed{seed}"
    launched, t0 = time.time(), time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", "--config", args.config, "--model", model,
                           "--steps", str(args.steps), "--seeds", str(seed), "--out", str(run_dir), *args.overrides],
                          capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"the TRL run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["startup_s"] = result.pop("rl_started_unix") - launched
    evals = {}
    for name, path in (("before", model), ("after", str(run_dir / "final_model"))):
        evals[name], _ = _cli("eval", "--config", args.config, "--model", path, *args.overrides,
                              *_job_overrides(model, args.steps, seed))
    return {**result, "process_s": process_s, **evals}


def trl_worker(args: argparse.Namespace) -> None:
    """One TRL GRPOTrainer run in this process (see the module docstring); prints its JSON result."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.rl.interfaces import PromptStream
    from entr_megatron.controller.job.model_init import build_task
    from entr_megatron.tasks import load_tokenizer
    from entr_megatron.types import Sample
    from entr_megatron.utils.spawn import available_cores

    [seed] = args.seeds
    cfg = load_config(args.config, [*args.overrides, *_job_overrides(args.model, args.steps, seed)])
    tokenizer = load_tokenizer(args.model)
    task = build_task(cfg, tokenizer)
    r, opt, alg = cfg.rollout, cfg.learner.optim, cfg.algorithm
    clip_low, clip_high = alg.clip_range(alg.policy_loss)
    if (cfg.learner.mini_batches, cfg.learner.epochs, opt.lr_decay_style, alg.policy_loss, alg.loss_agg_mode,
            alg.advantage_estimator) != (1, 1, "constant", "ppo_clip", "token-mean", "grpo"):
        sys.exit("bench_vs_trl compares TRL's GRPO: one optimizer step per batch at a constant learning rate after "
                 "warm-up, PPO-clip, token-mean (learner.mini_batches=1, learner.epochs=1, "
                 "learner.optim.lr_decay_style=constant, algorithm.policy_loss=ppo_clip, "
                 "algorithm.loss_agg_mode=token-mean, algorithm.advantage_estimator=grpo)")
    stream = PromptStream(task, r.prompts_per_step, cfg.controller.seed)
    prompts, references = [], []
    for i in range(args.steps * r.prompts_per_step):
        ids, reference = stream.get(i)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if tokenizer(text)["input_ids"] != list(ids):
            sys.exit(f"prompt {i}: {text!r} does not tokenize back to our prompt ids {ids}")
        prompts.append(text)
        references.append(reference)
    counted = {"tokens": 0}

    def reward(prompts, completions, completion_ids, reference, **_):
        out = []
        for prompt, ids, index in zip(prompts, completion_ids, reference):
            ref = references[index]  # the dataset holds indices: a task's references need not be Arrow types
            prompt_ids = tokenizer(prompt)["input_ids"]
            counted["tokens"] += len(prompt_ids) + len(ids)
            sample = Sample(prompt_ids, list(ids), [0.0] * len(ids), [0] * len(ids),
                            finish_reason="stop" if tokenizer.eos_token_id in ids else "length")
            out.append(float(task.reward(sample, ref)))
        return out

    threads = available_cores()
    torch.set_num_threads(threads)
    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=r.prompts_per_step * r.sampling.n,
        num_generations=r.sampling.n, max_completion_length=r.sampling.max_new_tokens,
        temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=max(r.sampling.top_k, 0),
        learning_rate=opt.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=opt.lr_warmup_steps,
        max_grad_norm=opt.clip_grad, adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_epsilon=opt.adam_eps,
        weight_decay=opt.weight_decay, beta=0.0, epsilon=clip_low, epsilon_high=clip_high, loss_type="dapo",
        scale_rewards="group",
        num_iterations=1, shuffle_dataset=False, use_cpu=True, bf16=False, gradient_checkpointing=False,
        save_strategy="no", report_to="none", logging_steps=max(args.steps // 10, 1), seed=seed,
        dataloader_pin_memory=False, disable_dropout=True,
    )
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts, "reference": list(range(len(prompts)))}))
    started_unix, t0 = time.time(), time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - t0
    trainer.save_model(str(Path(args.out) / "final_model"))
    tokenizer.save_pretrained(str(Path(args.out) / "final_model"))
    print(json.dumps({"rl_s": rl_s, "steps": args.steps, "tokens": counted["tokens"], "threads": threads,
                      "rl_started_unix": started_unix}))


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(runs: dict[str, list[dict]], steps: int, model: str) -> None:
    base = runs.get("trl")
    print(f"\n{steps} RL steps per run, {len(next(iter(runs.values())))} seeds, from {model}. "
          "Medians over seeds (range); ratios are of the medians, against TRL.\n")
    print("| system | steps/s | vs TRL | tokens/s | vs TRL | RL wall s | start-up s | process wall s "
          "| greedy before -> after | sampled before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for system, rows in runs.items():
        sps = [r["steps"] / r["rl_s"] for r in rows]
        tps = [r["tokens"] / r["rl_s"] for r in rows]
        vs = ((f"{statistics.median(sps) / statistics.median([r['steps'] / r['rl_s'] for r in base]):.2f}x",
               f"{statistics.median(tps) / statistics.median([r['tokens'] / r['rl_s'] for r in base]):.2f}x")
              if base else ("-", "-"))
        acc = {key: (statistics.median(r["before"][f"eval/{key}"] for r in rows),
                     _spread([r["after"][f"eval/{key}"] for r in rows])) for key in ("accuracy", "sampled_accuracy")}
        print(f"| {system} | {_spread(sps, 2)} | {vs[0]} | {_spread(tps, 0)} | {vs[1]} | "
              f"{_spread([r['rl_s'] for r in rows], 1)} | {_spread([r['startup_s'] for r in rows], 1)} | "
              f"{_spread([r['process_s'] for r in rows], 1)} | "
              f"{acc['accuracy'][0]:.3f} -> {acc['accuracy'][1]} | "
              f"{acc['sampled_accuracy'][0]:.3f} -> {acc['sampled_accuracy'][1]} |")


def bench(args: argparse.Namespace, model: str, out: Path) -> dict[str, list[dict]]:
    """Every system on every seed from `model`, interleaved (module docstring); saves OUT/bench_vs_trl.json."""
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for k, seed in enumerate(args.seeds):
        order = args.systems[k % len(args.systems):] + args.systems[:k % len(args.systems)]
        for system in order:
            print(f"seed {seed}: {system} ...", file=sys.stderr, flush=True)
            row = run_trl(args, model, seed, out) if system == "trl" else run_ours(args, system, model, seed, out)
            runs[system].append(row)
            print(f"  {row['steps'] / row['rl_s']:.2f} steps/s, RL {row['rl_s']:.1f} s, "
                  f"start-up {row['startup_s']:.1f} s, process {row['process_s']:.1f} s, "
                  f"greedy {row['after']['eval/accuracy']:.3f}",
                  file=sys.stderr, flush=True)
    (out / "bench_vs_trl.json").write_text(json.dumps(runs, indent=1))
    return runs


def learner_vs_hf(arch: dict) -> dict:
    """tools/bench_learner.py at TP=1 with --hf-baseline on the scale's shapes: the demo's 64
    sequences (8 prompts x 8 samples) of ~10 prompt and ~8 response tokens."""
    cmd = [sys.executable, str(Path(__file__).with_name("bench_learner.py")), "--tp", "1", "--hf-baseline", "--json",
           "--hidden", str(arch["hidden_size"]), "--layers", str(arch["num_hidden_layers"]),
           "--heads", str(arch["num_attention_heads"]), "--kv-heads", str(arch["num_key_value_heads"]),
           "--vocab", str(arch["vocab_size"]), "--seqs", "64", "--prompt-len", "10", "--response-len", "8",
           "--microbatch-tokens", "4096", "--steps", "7", "--warmup", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_learner failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    [ours] = result["rows"]
    return {"ours_s": ours["step_s"], "hf_s": result["hf"]["step_s"], "tokens": ours["tokens"]}


def _params(model: str) -> tuple[dict, int]:
    """The model's HF config and its parameter count (tied embeddings counted once)."""
    from safetensors import safe_open

    arch = json.loads((Path(model) / "config.json").read_text())
    n = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return arch, n


def scale_rows(name: str, params: int, runs: dict[str, list[dict]], hf: dict) -> list[dict]:
    """One row per system of one size: medians over seeds, ratios against TRL, the derived ceiling."""
    med = statistics.median
    trl_sps = med(r["steps"] / r["rl_s"] for r in runs["trl"]) if "trl" in runs else None
    phases = {}
    for system, key in (("sync", "2"), ("sync_1thread", "1")):
        if system in runs:
            phases[f"gen_{key}"] = med(r["timing"]["wait_rollout_s"] for r in runs[system])
            phases[f"learn_{key}"] = med(r["timing"]["learner_step_s"] for r in runs[system])
    ceiling = ((phases["gen_2"] + phases["learn_2"]) / max(phases["gen_1"], phases["learn_1"])
               if len(phases) == 4 else None)
    rows = []
    for system, rs in runs.items():
        sps = [r["steps"] / r["rl_s"] for r in rs]
        row = {"size": name, "params_m": params / 1e6, "system": system, "seeds": len(rs), "steps": rs[0]["steps"],
               "steps_per_s": med(sps), "steps_per_s_min": min(sps), "steps_per_s_max": max(sps),
               "vs_trl": med(sps) / trl_sps if trl_sps else None,
               "startup_s": med(r["startup_s"] for r in rs),
               "greedy_before": med(r["before"]["eval/accuracy"] for r in rs),
               "greedy_after": med(r["after"]["eval/accuracy"] for r in rs),
               "greedy_after_min": min(r["after"]["eval/accuracy"] for r in rs),
               "greedy_after_max": max(r["after"]["eval/accuracy"] for r in rs),
               "sampled_before": med(r["before"]["eval/sampled_accuracy"] for r in rs),
               "sampled_after": med(r["after"]["eval/sampled_accuracy"] for r in rs),
               "sampled_after_min": min(r["after"]["eval/sampled_accuracy"] for r in rs),
               "sampled_after_max": max(r["after"]["eval/sampled_accuracy"] for r in rs),
               **{f"{k}_s": v for k, v in phases.items()}, "overlap_ceiling": ceiling,
               "learner_ours_s": hf["ours_s"], "learner_hf_s": hf["hf_s"], "learner_vs_hf": hf["ours_s"] / hf["hf_s"]}
        if system != "trl":
            for key in TIMINGS:
                row[f"{key}_median"] = med(r["timing"][key] for r in rs)
        rows.append(row)
    return rows


def scale_report(rows: list[dict], out: Path) -> None:
    """Tables on stdout, OUT/scale.csv and OUT/scale.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(out / "scale.csv", index=False, float_format="%.4g")
    print("\n| size | system | steps/s (range) | vs TRL | start-up s | greedy before -> after (range) "
          "| sampled before -> after (range) |")
    print("|---|---|---|---|---|---|---|")
    for r in df.itertuples():
        vs = f"{r.vs_trl:.2f}x" if pd.notna(r.vs_trl) else "-"
        print(f"| {r.size} ({r.params_m:.1f} M) | {r.system} | {r.steps_per_s:.2f} ({r.steps_per_s_min:.2f}-"
              f"{r.steps_per_s_max:.2f}) | {vs} | {r.startup_s:.1f} | {r.greedy_before:.3f} -> {r.greedy_after:.3f} "
              f"({r.greedy_after_min:.3f}-{r.greedy_after_max:.3f}) | {r.sampled_before:.3f} -> {r.sampled_after:.3f} "
              f"({r.sampled_after_min:.3f}-{r.sampled_after_max:.3f}) |")
    sizes = df.drop_duplicates("size")
    print("\n| size | gen 2 thr s | learn 2 thr s | gen 1 thr s | learn 1 thr s | overlap ceiling "
          "| fully_async / sync measured | learner ours / HF |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sizes.itertuples():
        per = df[df["size"] == r.size].set_index("system")["steps_per_s"]
        measured = per["fully_async"] / per["sync"] if {"fully_async", "sync"} <= set(per.index) else float("nan")
        print(f"| {r.size} | {r.gen_2_s:.3f} | {r.learn_2_s:.3f} | {r.gen_1_s:.3f} | {r.learn_1_s:.3f} | "
              f"{r.overlap_ceiling:.2f}x | {measured:.2f}x | {r.learner_vs_hf:.2f}x |")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    trl = df[df["system"] == "trl"].set_index("size")["steps_per_s"]
    for system, part in df[df["system"].isin(["sync", "fully_async"])].groupby("system"):
        base = part["size"].map(trl)
        ax.errorbar(part["params_m"], part["steps_per_s"] / base,
                    yerr=[(part["steps_per_s"] - part["steps_per_s_min"]) / base,
                          (part["steps_per_s_max"] - part["steps_per_s"]) / base], marker="o", capsize=3, label=system)
    sync = df[df["system"] == "sync"].set_index("size")["steps_per_s"]
    ax.plot(sizes["params_m"], sizes["overlap_ceiling"] * sizes["size"].map(sync) / sizes["size"].map(trl), "k--",
            label="fully_async's ceiling: sync x overlap ceiling")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(sizes["params_m"], [f"{m:.1f} M" for m in sizes["params_m"]])
    ax.minorticks_off()
    ax.set_xlabel("parameters")
    ax.set_ylabel("RL steps/s, ours / TRL")
    ax.set_title("Same job as TRL's GRPOTrainer on 2 CPU cores\n(median over seeds, bars: range)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=120)
    print(f"\n{out / 'scale.csv'}, {out / 'scale.png'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/cpu_demo.yaml")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 250; with --scale, SCALES')")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                   help="default: trl sync one_step_off fully_async; with --scale, trl sync sync_1thread fully_async")
    p.add_argument("--model", default=None, help="HF directory every system starts from (default: the config's SFT)")
    p.add_argument("--scale", nargs="+", default=None, choices=list(SCALES), help="model sizes to run (SCALES)")
    p.add_argument("--models", nargs="+", default=[], metavar="SIZE=DIR",
                   help="with --scale: warmed-up models to reuse instead of running a size's warm-up")
    p.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides, applied to every system")
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    if args.systems is None:
        args.systems = ["trl", "sync", "sync_1thread", "fully_async"] if args.scale else \
            ["trl", "sync", "one_step_off", "fully_async"]
    if "trl" in args.systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed: EXTRAS=dev,peers bash scripts/setup.sh (or drop 'trl' from --systems)")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    if not args.scale:
        args.steps = args.steps or 250
        model = args.model or warmup_model(args.config, out, args.overrides)
        return report(bench(args, model, out), args.steps, model)
    reuse = {}
    for item in args.models:
        size, sep, path = item.partition("=")
        if not sep or size not in SCALES or not (Path(path) / "config.json").is_file():
            sys.exit(f"--models {item!r}: give SIZE=DIR with SIZE one of {', '.join(SCALES)} and DIR an HF model "
                     "directory (with config.json)")
        reuse[size] = path
    base_overrides, fixed_steps = list(args.overrides), args.steps
    for size in args.scale:
        arch, default_steps = SCALES[size]
        args.steps = fixed_steps or default_steps
        args.overrides = base_overrides + [f"model.architecture.{k}={v}" for k, v in arch.items()]
        size_out = out / size
        size_out.mkdir(parents=True, exist_ok=True)
        print(f"== {size}: {args.steps} RL steps x {len(args.seeds)} seeds, systems {' '.join(args.systems)}",
              file=sys.stderr, flush=True)
        model = reuse.get(size) or warmup_model(args.config, size_out, args.overrides)
        hf_arch, params = _params(model)
        print(f"{size}: {params / 1e6:.2f} M parameters; the learner against HF on these shapes ...",
              file=sys.stderr, flush=True)
        hf = learner_vs_hf(hf_arch)
        runs = bench(args, model, size_out)
        report(runs, args.steps, model)
        (size_out / "scale_rows.json").write_text(json.dumps(scale_rows(size, params, runs, hf), indent=1))
        # every size under OUT so far, this run's and earlier ones' (a size can be added later)
        scale_report(sorted((row for f in out.glob("*/scale_rows.json") for row in json.loads(f.read_text())),
                            key=lambda row: row["params_m"]), out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

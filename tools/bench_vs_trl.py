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
`trainer.train()` / `Controller.run`) and the process wall time (start to exit, model loading and
process start included, evaluation excluded where it can be); held-out accuracy before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_modes import cli, warmup_model  # noqa: E402  (tools/, this script's directory)

OURS = ("sync", "one_step_off", "fully_async")
SYSTEMS = ("trl", *OURS)


def _cli(*args: str, env: dict | None = None) -> tuple[dict, float]:
    """The last JSON line `entr-megatron args...` prints, and the process's wall time."""
    t0 = time.perf_counter()
    stdout = cli(*args, env=env)
    return json.loads(stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def _job_overrides(model: str, steps: int, seed: int) -> list[str]:
    return [f"model.path={model}", "model.architecture=null", "sft=null", f"controller.train_steps={steps}",
            f"controller.seed={seed}", "controller.checkpoint_interval=0", "controller.eval_interval=0",
            "logging.progress_bar=false"]


def run_ours(args: argparse.Namespace, mode: str, model: str, seed: int, out: Path) -> dict:
    from entr_megatron.utils.run_log import read_metrics

    run_dir = out / f"{mode}-seed{seed}"
    result, process_s = _cli("train", "--config", args.config, "--run-dir", str(run_dir), "--max-steps",
                             str(args.steps), *args.overrides, *_job_overrides(model, args.steps, seed),
                             f"controller.mode={mode}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {"rl_s": result["wall_s"], "process_s": process_s, "steps": result["steps"],
            "tokens": sum(r["rollout/tokens"] for r in rows),
            "before": result["eval_before"], "after": result["eval_after"]}


def run_trl(args: argparse.Namespace, model: str, seed: int, out: Path) -> dict:
    run_dir = out / f"trl-seed{seed}"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", "--config", args.config, "--model", model,
                           "--steps", str(args.steps), "--seeds", str(seed), "--out", str(run_dir), *args.overrides],
                          capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"the TRL run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
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
    t0 = time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - t0
    trainer.save_model(str(Path(args.out) / "final_model"))
    tokenizer.save_pretrained(str(Path(args.out) / "final_model"))
    print(json.dumps({"rl_s": rl_s, "steps": args.steps, "tokens": counted["tokens"], "threads": threads}))


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(runs: dict[str, list[dict]], steps: int, model: str) -> None:
    base = runs.get("trl")
    print(f"\n{steps} RL steps per run, {len(next(iter(runs.values())))} seeds, from {model}. "
          "Medians over seeds (range); ratios are of the medians, against TRL.\n")
    print("| system | steps/s | vs TRL | tokens/s | vs TRL | RL wall s | process wall s | greedy before -> after "
          "| sampled before -> after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for system, rows in runs.items():
        sps = [r["steps"] / r["rl_s"] for r in rows]
        tps = [r["tokens"] / r["rl_s"] for r in rows]
        vs = ((f"{statistics.median(sps) / statistics.median([r['steps'] / r['rl_s'] for r in base]):.2f}x",
               f"{statistics.median(tps) / statistics.median([r['tokens'] / r['rl_s'] for r in base]):.2f}x")
              if base else ("-", "-"))
        acc = {key: (statistics.median(r["before"][f"eval/{key}"] for r in rows),
                     _spread([r["after"][f"eval/{key}"] for r in rows])) for key in ("accuracy", "sampled_accuracy")}
        print(f"| {system} | {_spread(sps, 2)} | {vs[0]} | {_spread(tps, 0)} | {vs[1]} | "
              f"{_spread([r['rl_s'] for r in rows], 1)} | {_spread([r['process_s'] for r in rows], 1)} | "
              f"{acc['accuracy'][0]:.3f} -> {acc['accuracy'][1]} | "
              f"{acc['sampled_accuracy'][0]:.3f} -> {acc['sampled_accuracy'][1]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/cpu_demo.yaml")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--model", default=None, help="HF directory every system starts from (default: the config's SFT)")
    p.add_argument("--out", default=None, help="run directories go here (default: a temporary directory)")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides, applied to every system")
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    if "trl" in args.systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed: EXTRAS=dev,peers bash scripts/setup.sh (or drop 'trl' from --systems)")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    model = args.model or warmup_model(args.config, out, args.overrides)
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for k, seed in enumerate(args.seeds):
        order = args.systems[k % len(args.systems):] + args.systems[:k % len(args.systems)]
        for system in order:
            print(f"seed {seed}: {system} ...", file=sys.stderr, flush=True)
            row = run_trl(args, model, seed, out) if system == "trl" else run_ours(args, system, model, seed, out)
            runs[system].append(row)
            print(f"  {row['steps'] / row['rl_s']:.2f} steps/s, RL {row['rl_s']:.1f} s,"
                  f" process {row['process_s']:.1f} s, greedy {row['after']['eval/accuracy']:.3f}",
                  file=sys.stderr, flush=True)
    (out / "bench_vs_trl.json").write_text(json.dumps(runs, indent=1))
    report(runs, args.steps, model)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

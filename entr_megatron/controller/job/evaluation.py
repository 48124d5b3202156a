"""Held-out accuracy of the policy the engines sample from.

    metrics = evaluate(engine, task, n=200, sampling=cfg.rollout.sampling, seed=0)
    held_out = HeldOut(cfg, task, engine, paths)   # a run's evaluations, kept in eval.json
    held_out.before_rl(fresh=True); held_out.during_rl(controller); held_out.after_rl()
"""

from __future__ import annotations

import dataclasses
from typing import Any

from entr_megatron.config.rollout import SamplingConfig
from entr_megatron.config.run import RunConfig
from entr_megatron.controller.job.run_dir import RunPaths, read_eval, save_eval
from entr_megatron.controller.rl.replacing import Recover, generate_replacing
from entr_megatron.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams, generate
from entr_megatron.utils.console import say
from entr_megatron.utils.seeding import mix_seed

__all__ = ["EVAL_TIMEOUT_S", "HeldOut", "evaluate"]

EVAL_TIMEOUT_S = 3600.0
"""The longest one evaluation pass (greedy or sampled) may take, however busy the engines are."""


def evaluate(engine: RolloutEngine, task: Any, n: int, sampling: SamplingConfig, seed: int = 0,
             samples_per_problem: int = 4, idle_timeout_s: float | None = None,
             timeout_s: float = EVAL_TIMEOUT_S, split: str = "test", recover: Recover | None = None) -> dict[str, float]:
    """Held-out accuracy on `n` problems of the test split: greedy (`eval/accuracy`), and the
    mean over `samples_per_problem` samples drawn as in training (`sampling`: the config's
    temperature, top-p, top-k), i.e. the accuracy of the policy RL optimises
    (`eval/sampled_accuracy`). A sample is correct when its reward is 1.

    `idle_timeout_s` (a run's rollout.poll_timeout_s): silence that long gets the engines
    health-checked. A dead or stopped engine is replaced by `recover` (a training run's
    `Controller.recover`) and the pass generated again with the same seeds (replacing.py);
    without it, it ends the evaluation with EngineError. `split` "train": the same on training
    problems (what RL optimised)."""
    pairs = task.prompts(split, n, seed=seed)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=sampling.max_new_tokens, n=1)
    sampled = SamplingParams.from_config(sampling, n=samples_per_problem)
    out: dict[str, float] = {"eval/num_problems": float(len(pairs))}
    for name, params in (("accuracy", greedy), ("sampled_accuracy", sampled)):
        requests = [GenerateRequest(ids, dataclasses.replace(params, seed=mix_seed(seed, i)))
                    for i, (ids, _) in enumerate(pairs)]
        if recover is None:
            results = generate(engine, requests, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
        else:
            results = generate_replacing(engine, requests, recover, timeout_s=timeout_s, idle_timeout_s=idle_timeout_s)
        refs = [ref for _, ref in pairs for _ in range(params.n)]
        rewards = [float(task.reward(r.to_sample(), ref)) for r, ref in zip(results, refs)]
        out[f"eval/{name}"] = sum(r == 1.0 for r in rewards) / len(rewards)
    return out


class HeldOut:
    """A run's held-out evaluations on `task.eval_size` problems (0: none at all): before RL
    (once per run directory), every `controller.eval_interval` steps, and after the last step."""

    def __init__(self, cfg: RunConfig, task: Any, engine: RolloutEngine, paths: RunPaths,
                 recover: Recover | None = None):
        """`recover`: replaces failed engines (the run's `Controller.recover`); None: a failure ends it."""
        self.enabled = cfg.task.eval_size > 0
        self.task, self.engine, self.paths, self.recover = task, engine, paths, recover
        self.n, self.sampling, self.seed = cfg.task.eval_size, cfg.rollout.sampling, cfg.controller.seed
        self.idle_timeout_s = cfg.rollout.poll_timeout_s

    def _evaluate(self) -> dict[str, float]:
        return evaluate(self.engine, self.task, self.n, self.sampling, self.seed, idle_timeout_s=self.idle_timeout_s,
                        recover=self.recover)

    def before_rl(self, fresh: bool) -> dict | None:
        """eval.json's "before_rl", measured now when the run is `fresh` (not resumed) and has none."""
        if self.enabled and fresh and not self.paths.eval.exists():
            before = self._evaluate()
            save_eval(self.paths, "before_rl", before)
            say(f"held-out accuracy before RL: greedy {before['eval/accuracy']:.3f}, sampled "
                f"{before['eval/sampled_accuracy']:.3f} ({int(before['eval/num_problems'])} problems)")
        return read_eval(self.paths, "before_rl")

    def during_rl(self, ctl: Any) -> dict:
        """The controller's `on_eval` hook (it has drained the engines)."""
        return self._evaluate() if self.enabled else {}

    def after_rl(self) -> dict | None:
        """Measured now and saved as eval.json's "after_rl"; None when evaluation is off."""
        if not self.enabled:
            return None
        after = self._evaluate()
        save_eval(self.paths, "after_rl", after)
        return after

    @staticmethod
    def report(before: dict | None, after: dict | None) -> None:
        """The before -> after line on stderr."""
        if after is None:
            return
        before, nan = before or {}, float("nan")
        say(f"held-out accuracy, {int(after['eval/num_problems'])} problems: greedy "
            f"{before.get('eval/accuracy', nan):.3f} before RL -> {after['eval/accuracy']:.3f} after; "
            f"sampled as in training {before.get('eval/sampled_accuracy', nan):.3f} -> "
            f"{after['eval/sampled_accuracy']:.3f}")

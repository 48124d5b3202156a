"""The controller: one loop, three modes, a hard policy-lag bound.

    PromptStream ──prompt i──> RolloutEngine ──GenerateResult (logprobs, per-token versions)──┐
         ^  (regenerate)            ^                                                          v
         └────────── StalenessBuffer <── reward (Task) <── whole group of n samples ───────────┘
                       │ take(P groups, version): stale groups dropped / regenerated
                       v
      advantages (GRPO) -> TrainBatch -> Learner.train(batch, version) -> version += 1
                                                                          │
                       RolloutEngine.update_weights <── WeightPusher.push(version)

| mode         | trainer waits for                      | engines wait for                       | push           | lag        |
|--------------|----------------------------------------|----------------------------------------|----------------|------------|
| sync         | all P groups of this step              | the push after each train step         | waited         | 0          |
| one_step_off | the P groups submitted one step ago    | push (only while idle), then next step | waited, idle   | 1          |
| fully_async  | any P fresh groups in the buffer       | nothing: kept busy with in-flight work | in flight      | <= max lag |

fully_async: engines continue unfinished generations across updates (their
per-token versions record it). After each version bump, a group still in flight
that was submitted when the engine was at a version older than
``version - max_policy_lag`` may already hold a token that can never be
trained on: it is aborted and handled like a stale group (regenerated or
dropped). Groups that finish in time but wait too long in the buffer are
evicted when the trainer takes. Checkpoints first drain in-flight requests
(no new submissions) so the saved state resumes exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from entr_megatron.algorithm.advantages import ADVANTAGE_ESTIMATORS, AdvantageFn
from entr_megatron.config.controller import CONTROLLER_MODES
from entr_megatron.controller.buffer import Group, GroupRef, StalenessBuffer, lag_metrics
from entr_megatron.controller.interfaces import Learner, PromptStream, PushHandle, WeightPusher
from entr_megatron.rollout.engine import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from entr_megatron.types import TrainBatch
from entr_megatron.utils.seeding import mix_seed

__all__ = ["CONTROLLER_MODES", "Controller", "ControllerHooks", "ControllerOptions"]

POLL_TIMEOUT_S = 1.0
"""Longest single wait on the engine; the loop re-checks its state between polls."""

MAX_DISCARDED_PER_STEP = 64
"""Groups (x prompts_per_step) one step may filter or discard before the run gives up: a task whose
groups all get equal rewards (dynamic filtering) or never finish within the bound would spin forever."""


@dataclass(frozen=True)
class ControllerOptions:
    mode: str = "fully_async"
    max_policy_lag: int = 4
    stale_policy: str = "regenerate"
    prompts_per_step: int = 8
    """P: groups per training step."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(n=8))
    """Its n is the group size; its seed is replaced per group."""
    dynamic_filtering: bool = False
    max_inflight_groups: int | None = None
    """fully_async: groups kept in flight (None: 2 P); never more than P * (max_policy_lag + 1) minus the buffered."""
    abort_doomed: bool = True
    """fully_async: abort in-flight groups that may already hold a token older than the bound."""
    drain_on_checkpoint: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in CONTROLLER_MODES:
            raise ValueError(f"mode must be one of {CONTROLLER_MODES}, got {self.mode!r}")
        if self.mode != "sync" and self.max_policy_lag < 1:
            raise ValueError(f"max_policy_lag must be >= 1 for mode {self.mode!r}, got {self.max_policy_lag}")

    @classmethod
    def from_config(cls, run: Any, **overrides: Any) -> ControllerOptions:
        """From a validated `RunConfig` (its controller and rollout sections)."""
        c, r, s = run.controller, run.rollout, run.rollout.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, n=s.n)
        kwargs = dict(mode=c.mode, max_policy_lag=c.max_policy_lag, stale_policy=c.stale_policy,
                      prompts_per_step=r.prompts_per_step, sampling=params,
                      dynamic_filtering=r.dynamic_filtering, seed=c.seed)
        return cls(**{**kwargs, **overrides})


@dataclass
class ControllerHooks:
    """Side effects kept out of the loop: metrics writers, checkpoints."""

    on_step: list[Callable[[dict], None]] = field(default_factory=list)
    checkpoint_interval: int = 0
    """Call on_checkpoint every this many steps (0: never)."""
    on_checkpoint: Callable[[Controller], None] | None = None
    """Gets the controller (drained of in-flight work): saves `state_dict()` with the model."""
    eval_interval: int = 0
    """Call on_eval every this many steps (0: never), drained like a checkpoint."""
    on_eval: Callable[[Controller], dict] | None = None
    """Gets the drained controller (engines idle, at the learner's version); its metrics join the step's."""
    should_stop: Callable[[], bool] | None = None
    """Checked after every step (e.g. Ctrl-C was pressed): true ends `run` after a checkpoint."""


@dataclass
class _InFlight:
    ref: GroupRef
    reference: Any
    engine_version: int
    """Engine weight version when submitted: a lower bound on every token version of the group."""
    results: dict[int, GenerateResult] = field(default_factory=dict)


class Controller:
    """Drives engines and learner; owns the policy version, the buffer and the data position."""

    def __init__(self, engine: RolloutEngine, learner: Learner, pusher: WeightPusher, task: Any,
                 options: ControllerOptions, advantage_fn: AdvantageFn | str = "grpo",
                 hooks: ControllerHooks | None = None) -> None:
        self.engine, self.learner, self.pusher, self.task, self.opt = engine, learner, pusher, task, options
        self.advantage_fn = ADVANTAGE_ESTIMATORS[advantage_fn] if isinstance(advantage_fn, str) else advantage_fn
        self.hooks = hooks or ControllerHooks()
        self.buffer = StalenessBuffer(options.max_policy_lag, options.stale_policy, options.dynamic_filtering)
        self.prompts = PromptStream(task, options.prompts_per_step, options.seed)
        self.version = 0
        """Version of the learner's policy (the next batch is trained against it)."""
        self.step = 0
        self.next_group_id = 0
        self.aborted = 0
        self._inflight: dict[str, _InFlight] = {}
        self._ignored: dict[str, int] = {}  # request id of an aborted group -> results still to come
        self._resubmit: list[GroupRef] = []  # in-flight at save time, submitted again on resume
        self._push_handle: PushHandle | None = None
        self._pushed_version = 0
        self._discarded_this_step = 0

    # ---- the three loops -------------------------------------------------------------------------
    def run(self, num_steps: int) -> list[dict]:
        """Trains `num_steps` steps; returns one metrics dict per step."""
        step_fn = {"sync": self._step_sync, "one_step_off": self._step_one_step_off,
                   "fully_async": self._step_fully_async}[self.opt.mode]
        if self.engine.weight_version != self.version:  # fresh engines after a resume
            self.pusher.push(self.version).wait()
        self._pushed_version = self.version
        self._submit_refs(self._resubmit)
        self._resubmit = []
        history = []
        hooks = self.hooks
        for _ in range(num_steps):
            t0 = time.perf_counter()
            metrics = step_fn()
            metrics["timing/step_s"] = step_s = time.perf_counter() - t0
            metrics["throughput/tokens_per_s"] = metrics["rollout/tokens"] / step_s if step_s > 0 else 0.0
            stop = hooks.should_stop is not None and hooks.should_stop()
            if hooks.on_eval and hooks.eval_interval and self.step % hooks.eval_interval == 0:
                self.drain()
                metrics.update(hooks.on_eval(self))
            history.append(metrics)
            for hook in hooks.on_step:
                hook(metrics)
            every = hooks.checkpoint_interval
            if hooks.on_checkpoint and (stop or (every and self.step % every == 0)):
                if self.opt.drain_on_checkpoint:
                    self.drain()
                hooks.on_checkpoint(self)
            if stop:
                break
        return history

    def _step_sync(self) -> dict:
        groups, wait_s = self._collect(inflight_target=lambda: self.P - len(self.buffer))
        metrics = self._train(groups)
        self._push(wait=True)
        return {**metrics, "timing/wait_rollout_s": wait_s}

    def _step_one_step_off(self) -> dict:
        groups, wait_s = self._collect(inflight_target=lambda: self.P - len(self.buffer))
        self._push(wait=True)  # the engines are idle here: no request spans two versions
        self._submit_new(self.P)  # next step's prompts generate while this step trains
        return {**self._train(groups), "timing/wait_rollout_s": wait_s}

    def _step_fully_async(self) -> dict:
        groups, wait_s = self._collect(inflight_target=self._async_inflight_target)
        metrics = self._train(groups)  # engines keep generating meanwhile
        self._push(wait=False)  # swapped in flight; later tokens carry the new version
        if self.opt.abort_doomed:
            self._abort_doomed()
        return {**metrics, "timing/wait_rollout_s": wait_s}

    # ---- pieces ----------------------------------------------------------------------------------
    @property
    def P(self) -> int:
        return self.opt.prompts_per_step

    def _async_inflight_target(self) -> int:
        target = self.opt.max_inflight_groups or 2 * self.P
        cap = self.P * (self.opt.max_policy_lag + 1) - len(self.buffer)  # no more than the bound can consume
        return max(min(target, cap), self.P - len(self.buffer))

    def _collect(self, inflight_target: Callable[[], int]) -> tuple[list[Group], float]:
        """Submits (regenerations first) up to the target and receives until P fresh groups exist."""
        t0, self._discarded_this_step = time.perf_counter(), 0
        while True:
            self.buffer.evict_stale(self.version)
            refs = self.buffer.pop_regenerations()
            room = max(inflight_target() - len(self._inflight), 0)
            # a regenerated prompt is a new group: late results of the old one are ignored by request id
            self._submit_refs([GroupRef(self._new_group_id(), r.prompt_index, r.attempt) for r in refs[:room]])
            self.buffer.push_regenerations_front(refs[room:])
            self._submit_new(max(inflight_target() - len(self._inflight), 0))
            if groups := self.buffer.take(self.P, self.version):
                break
            if not self._inflight and not self._ignored:
                raise RuntimeError("controller has nothing in flight and too few groups to train on")
            self._receive()
            if self._discarded_this_step > MAX_DISCARDED_PER_STEP * self.P:
                raise RuntimeError(
                    f"step {self.step}: {self._discarded_this_step} groups filtered or discarded without "
                    f"finding {self.P} usable ones (all rewards equal, or responses too slow for the lag bound)")
        return groups, time.perf_counter() - t0

    def _submit_new(self, num_groups: int) -> None:
        self._submit_refs([GroupRef(self._new_group_id(), self.prompts.take_index()) for _ in range(num_groups)])

    def _new_group_id(self) -> int:
        self.next_group_id += 1
        return self.next_group_id - 1

    def _submit_refs(self, refs: list[GroupRef]) -> None:
        if not refs:
            return
        requests, records = [], []
        engine_version = self.engine.weight_version
        for ref in refs:
            prompt_ids, reference = self.prompts.get(ref.prompt_index)
            seed = mix_seed(self.opt.seed, ref.group_id, modulus=2**31)
            params = dataclasses.replace(self.opt.sampling, seed=seed)
            requests.append(GenerateRequest(prompt_ids, params, group_id=ref.group_id,
                                            metadata={"prompt_index": ref.prompt_index}))
            records.append(_InFlight(ref, reference, engine_version))
        for rid, record in zip(self.engine.submit(requests), records):
            self._inflight[rid] = record

    def _receive(self, timeout: float | None = POLL_TIMEOUT_S) -> None:
        """Polls once; completed groups get their rewards and enter the buffer."""
        for result in self.engine.poll(timeout=timeout):
            rid = result.request_id
            if rid in self._ignored:
                self._ignored[rid] -= 1
                if not self._ignored[rid]:
                    del self._ignored[rid]
                continue
            record = self._inflight[rid]
            record.results[result.sample_index] = result
            if len(record.results) < self.opt.sampling.n:
                continue
            del self._inflight[rid]
            samples = []
            for index in sorted(record.results):
                sample = record.results[index].to_sample()
                sample.reward = float(self.task.reward(sample, record.reference))
                samples.append(sample)
            ref = record.ref
            if not self.buffer.put(Group(ref.group_id, ref.prompt_index, samples, ref.attempt)):
                self._discarded_this_step += 1

    def _abort_doomed(self) -> None:
        """Aborts in-flight groups that may hold a token the bound already excludes."""
        oldest_allowed = self.version - self.opt.max_policy_lag
        doomed = [rid for rid, r in self._inflight.items() if r.engine_version < oldest_allowed]
        if not doomed:
            return
        for rid in doomed:
            record = self._inflight.pop(rid)
            self._ignored[rid] = self.opt.sampling.n - len(record.results)
            self.buffer.discard(record.ref)
        self._ignored = {rid: k for rid, k in self._ignored.items() if k > 0}
        self.aborted += len(doomed)
        self._discarded_this_step += len(doomed)
        self.engine.abort(doomed)

    def _train(self, groups: list[Group]) -> dict:
        samples = [s for g in groups for s in g.samples]
        rewards_B = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        group_ids_B = torch.tensor([s.group_id for s in samples], dtype=torch.long)
        batch = TrainBatch.from_samples(samples, self.advantage_fn(rewards_B, group_ids_B))
        metrics = {"step": self.step, "policy_version": self.version, **lag_metrics(samples, self.version),
                   "reward/mean": rewards_B.mean().item(),
                   "rollout/response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
                   "rollout/tokens": float(batch.cu_seqlens[-1])}
        t0 = time.perf_counter()
        metrics.update(self.learner.train(batch, self.version))
        metrics["timing/train_s"] = time.perf_counter() - t0
        self.version += 1
        self.step += 1
        metrics.update(self.buffer.counters())
        metrics.update({"controller/aborted": float(self.aborted), "controller/inflight_groups": float(len(self._inflight))})
        return metrics

    def _push(self, wait: bool) -> None:
        """Publishes the learner's version; at most one push in flight."""
        if self._push_handle is not None:
            self._push_handle.wait()
            self._push_handle = None
        if self._pushed_version == self.version:
            return
        self._push_handle, self._pushed_version = self.pusher.push(self.version), self.version
        if wait:
            self._push_handle.wait()
            self._push_handle = None

    # ---- checkpoint / resume ---------------------------------------------------------------------
    def drain(self) -> None:
        """Waits for every in-flight group, submitting nothing new, then brings the engines to the
        learner's version: a checkpoint holds only the learner's current weights, so this is the
        engine state a resumed run can reproduce."""
        while self._inflight or self._ignored:
            self._receive()
        self._push(wait=True)

    def state_dict(self) -> dict:
        """Plain Python state: version, step, data position, buffer, in-flight groups to resubmit.
        Partial results of in-flight groups are not saved: those groups are sampled again on resume."""
        return {
            "version": self.version, "step": self.step, "next_prompt_index": self.prompts.next_index,
            "next_group_id": self.next_group_id, "aborted": self.aborted,
            "buffer": self.buffer.state_dict(),
            "inflight": [dataclasses.asdict(r) for r in [x.ref for x in self._inflight.values()] + self._resubmit],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a fresh controller (nothing in flight); resubmission happens when `run` starts."""
        assert not self._inflight, "load_state_dict needs a controller with nothing in flight"
        self.version, self.step, self.aborted = state["version"], state["step"], state["aborted"]
        self.prompts.next_index, self.next_group_id = state["next_prompt_index"], state["next_group_id"]
        self.buffer.load_state_dict(state["buffer"])
        self._resubmit = [GroupRef(**r) for r in state["inflight"]]

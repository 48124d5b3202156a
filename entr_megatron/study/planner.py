"""A throughput planner: a discrete-event model of the controller's four modes.

    plan = simulate(costs, workload, mode="fully_async")   # -> Plan: step time, throughput, idle, lag

The model (what it keeps and what it leaves out):

- Engines decode with continuous batching: one decode step of b running sequences takes
  ``decode_base_s + decode_per_seq_s * b`` and gives each a token; at most
  ``max_batch_size`` run, the rest wait (FIFO); admitting a sequence costs its prompt's
  prefill (``prefill_per_token_s`` per prompt token, added to that step). Response lengths are
  drawn from ``responses`` (seeded): the long tail is what makes synchronous steps slow.
- The learner trains a batch of T tokens in ``train_overhead_s + train_per_token_s * T``.
- A weight push takes ``push_s`` on the learner side; engines stall ``swap_s`` when they
  swap. sync / one_step_off / fixed_lag wait for it (engines idle), fully_async does not.
- The controller logic is the loop's: sync generates P groups then trains; one_step_off trains
  step k while step k+1 generates (push while engines are idle); fully_async keeps
  ``max_inflight_groups`` (default 2P, capped by P(max_policy_lag+1) minus the buffered) in
  flight, trains on the oldest P received groups, drops groups over the bound and regenerates
  them, aborts in-flight groups submitted before ``version - max_policy_lag``. As in the loop,
  the controller receives finished groups only while it collects (not while it trains) and
  counts those it has not received as in flight, so engines get new work only then; fixed_lag has
  sync's timing (generation ahead is sequential) and lag K..K+J by construction.
- Left out: network contention, learner/engine interference on shared cores, the variance of
  step costs, multi-turn tools.

Costs come from a YAML description of a cluster (`Costs.from_dict`) or a run directory
(`costs_from_run`: the learner's cost fitted from the run's own steps, engine costs given or
measured with `measure_engine`).

Where things are: the validated inputs and the output (`Costs`, `Workload`, `Plan`) in
workload.py, the simulation (`simulate`, bounded by an event count) in simulation.py, costs from
measurements here. Every name is importable from this module.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from entr_megatron.config.controller import SEQUENTIAL_MODES
from entr_megatron.config.loader import load_config
from entr_megatron.study.simulation import SimulationBoundError, default_max_events, simulate
from entr_megatron.study.workload import COST_FIELDS, MODES, Costs, Plan, Workload
from entr_megatron.utils.run_log import read_metrics

__all__ = ["COST_FIELDS", "ENGINE_COST_FIELDS", "MODES", "Costs", "Plan", "SimulationBoundError", "Workload",
           "costs_from_run", "default_max_events", "fit_line", "measure_engine", "read_engine_costs", "simulate"]

ENGINE_COST_FIELDS = ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s")
"""The engine's costs that a run directory cannot give (`measure_engine` or a cluster's numbers)."""


def read_engine_costs(data: Any, where: str = "engine costs") -> dict[str, float]:
    """The engine's decode costs from a mapping (an --engine-costs YAML): exactly ENGINE_COST_FIELDS,
    each a finite number >= 0; a missing or unknown key is an error naming it."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping of {list(ENGINE_COST_FIELDS)}, got {type(data).__name__}")
    missing = [k for k in ENGINE_COST_FIELDS if k not in data]
    unknown = sorted(set(data) - set(ENGINE_COST_FIELDS), key=str)
    if missing or unknown:
        raise ValueError(f"{where}: needs exactly {list(ENGINE_COST_FIELDS)} (seconds, >= 0); "
                         f"missing {missing}, unknown {unknown}")
    return dict(data)


# ---- costs from measurements ---------------------------------------------------------------------
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs, both clamped at >= 0 (a single x: through 0)."""
    n = len(xs)
    if n == 0:
        raise ValueError("fit_line needs at least one point")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, max(my / mx, 0.0) if mx else 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if intercept < 0:  # costs are never negative: refit through the origin
        return 0.0, max(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0)
    if slope < 0:
        return my, 0.0
    return intercept, slope


def measure_engine(model_dir: str, dtype: str = "float32", prompt_len: int = 16, tokens: int = 32,
                   batch_sizes: tuple[int, ...] = (1, 8, 32, 64), num_threads: int | None = 1,
                   max_batch_size: int = 64, repeats: int = 3) -> dict[str, float]:
    """Decode cost of the embedded engine on `model_dir`: b sequences decoding `tokens` tokens each
    (EOS ignored) for every b in `batch_sizes`, timed (the median of `repeats`); the line
    step_s = base + per_seq * b fitted. Returns {"decode_base_s", "decode_per_seq_s", "prefill_per_token_s"}."""
    # lazy: torch (the engine), only when --measure-engine times one
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate

    config = EmbeddedEngineConfig(model_dir=model_dir, dtype=dtype, init="pretrained", num_threads=num_threads,
                                  max_batch_size=max_batch_size, max_model_len=prompt_len + tokens + 1)
    prompt = [1 + (i % 7) for i in range(prompt_len)]
    per_step, prefill = [], []
    with EmbeddedEngine(config) as engine:
        generate(engine, [GenerateRequest(prompt, SamplingParams(n=2, max_new_tokens=4, ignore_eos=True, seed=0))])
        def timed(params: SamplingParams) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                generate(engine, [GenerateRequest(prompt, params)])
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        for b in batch_sizes:
            params = SamplingParams(n=b, max_new_tokens=tokens, ignore_eos=True, seed=b)
            full, one = timed(params), timed(dataclasses.replace(params, max_new_tokens=1))
            per_step.append((full - one) / (tokens - 1))
            prefill.append(max(one - per_step[-1], 0.0) / (b * prompt_len))
    base, per_seq = fit_line([float(b) for b in batch_sizes], per_step)
    return {"decode_base_s": base, "decode_per_seq_s": per_seq, "prefill_per_token_s": sum(prefill) / len(prefill)}


def costs_from_run(run_dir: str, engine_costs: dict[str, float], skip_steps: int = 2,
                   response_sigma: float = 0.0, calibrate_engine: bool = True) -> tuple[Costs, Workload]:
    """The learner's costs fitted from a run directory's steps (train time against tokens), the
    push time it logged, its response lengths and its workload; the engine's decode costs given
    (`measure_engine`, or a cluster's numbers) and, for a sync or fixed_lag run, scaled to the
    run's measured generation time (`calibrate_engine`)."""
    root = Path(run_dir)
    cfg = load_config(root / "config.yaml")
    rows = read_metrics(root / "metrics.jsonl")[skip_steps:]
    if len(rows) < 3:
        raise ValueError(f"{root / 'metrics.jsonl'}: needs at least {skip_steps + 3} steps to fit the learner's cost")
    r, c = cfg.rollout, cfg.controller
    seqs = r.prompts_per_step * r.sampling.n
    tokens = [float(row["rollout/tokens"]) for row in rows]
    overhead, per_token = fit_line(tokens, [float(row["timing/train_s"]) for row in rows])
    response = sum(float(row["rollout/response_len_mean"]) for row in rows) / len(rows)
    prompt = max(round(sum(tokens) / len(tokens) / seqs - response), 1)
    pushes = [float(row["weight_sync/learner_blocked_s"]) + float(row.get("weight_sync/wait_s", 0.0))
              for row in rows if "weight_sync/learner_blocked_s" in row]
    swaps = [float(row["weight_sync/engine_blocked_s"]) for row in rows if "weight_sync/engine_blocked_s" in row]
    costs = Costs(train_per_token_s=per_token, train_overhead_s=overhead, push_s=sum(pushes) / len(pushes) if pushes else 0.0,
                  swap_s=sum(swaps) / len(swaps) if swaps else 0.0,
                  engines=r.num_engines, max_batch_size=r.embedded.max_batch_size, prompt_len=prompt,
                  response_median=response, response_sigma=response_sigma, max_new_tokens=r.sampling.max_new_tokens,
                  **read_engine_costs(engine_costs))
    workload = Workload(prompts_per_step=r.prompts_per_step, n=r.sampling.n, max_policy_lag=c.max_policy_lag,
                        max_inflight_groups=c.max_inflight_groups, inter_lag=c.inter_lag, intra_lag=c.intra_lag,
                        seed=c.seed)
    if calibrate_engine and c.mode in SEQUENTIAL_MODES:
        costs = _calibrated(costs, workload, [float(row["timing/wait_rollout_s"]) for row in rows])
    return costs, workload


def _calibrated(costs: Costs, workload: Workload, generation_s: list[float]) -> Costs:
    """The engine's decode costs scaled by one factor so that a modelled synchronous step generates
    in the run's measured mean generation time (a microbenchmark misses the engine's per-request
    overheads inside a real run; the shape, base vs per-sequence vs prefill, stays measured)."""
    plan = simulate(costs, dataclasses.replace(workload, steps=5), "sync")
    modelled = (plan.wall_s - plan.learner_busy_s) / 5 - costs.push_s - costs.swap_s
    measured = sum(generation_s) / len(generation_s)
    if modelled <= 0 or measured <= 0:
        return costs
    scale = measured / modelled
    return dataclasses.replace(costs, decode_base_s=costs.decode_base_s * scale,
                               decode_per_seq_s=costs.decode_per_seq_s * scale,
                               prefill_per_token_s=costs.prefill_per_token_s * scale)

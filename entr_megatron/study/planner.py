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
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODES", "Costs", "Plan", "Workload", "costs_from_run", "fit_line", "measure_engine", "simulate"]

MODES = ("sync", "one_step_off", "fully_async", "fixed_lag")


@dataclass(frozen=True)
class Costs:
    """Per-operation costs in seconds (see the module docstring)."""

    decode_base_s: float
    decode_per_seq_s: float
    train_per_token_s: float
    train_overhead_s: float = 0.0
    prefill_per_token_s: float = 0.0
    push_s: float = 0.0
    swap_s: float = 0.0
    engines: int = 1
    max_batch_size: int = 64
    prompt_len: int = 16
    response_median: float = 64.0
    """Response lengths: lognormal with this median and `response_sigma`, clipped to [1, max_new_tokens]."""
    response_sigma: float = 0.0
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"costs.{f.name} must be a finite number >= 0, got {value!r}")
        for name in ("engines", "max_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1 or int(getattr(self, name)) != getattr(self, name):
                raise ValueError(f"costs.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError("costs.decode_base_s + costs.decode_per_seq_s must be > 0 (a decode step takes time)")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "costs") -> Costs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(known)}")
        return cls(**data)

    def response_lengths(self, count: int, rng: random.Random) -> list[int]:
        if self.response_sigma == 0:  # floor or ceil of the median, in the proportion that keeps the mean
            low = math.floor(self.response_median)
            return [max(1, min(self.max_new_tokens, low + (rng.random() < self.response_median - low)))
                    for _ in range(count)]
        mu = math.log(max(self.response_median, 1.0))
        return [max(1, min(self.max_new_tokens, round(rng.lognormvariate(mu, self.response_sigma))))
                for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 8
    n: int = 8
    max_policy_lag: int = 4
    steps: int = 50
    max_inflight_groups: int | None = None
    inter_lag: int = 0
    intra_lag: int = 0
    seed: int = 0


@dataclass
class Plan:
    mode: str
    step_s: list[float]
    response_tokens: int
    wall_s: float
    learner_busy_s: float
    engine_busy_s: float
    engines: int
    lag_tokens: dict[int, int] = field(repr=False)
    """Trained tokens per policy lag."""
    step_lag_mean: list[float] = field(repr=False)
    """Mean token lag of each step's batch (the controller's policy_lag/mean)."""
    dropped: int = 0

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_lag(self) -> float:
        total = sum(self.lag_tokens.values())
        return sum(lag * n for lag, n in self.lag_tokens.items()) / total if total else 0.0

    @property
    def max_lag(self) -> int:
        return max(self.lag_tokens, default=0)

    def summary(self) -> dict[str, float]:
        return {"mode": self.mode, "step_s": self.mean_step_s, "tokens_per_s": self.tokens_per_s,
                "learner_idle": 1 - self.learner_busy_s / self.wall_s if self.wall_s else 0.0,
                "engine_idle": 1 - self.engine_busy_s / (self.wall_s * self.engines) if self.wall_s else 0.0,
                "lag_mean": self.mean_lag, "lag_max": float(self.max_lag), "dropped_groups": float(self.dropped)}


class _Group:
    __slots__ = ("id", "left", "tokens", "versions", "submit_version", "aborted")

    def __init__(self, gid: int, n: int, submit_version: int):
        self.id, self.left, self.tokens = gid, n, 0
        self.versions: list[list[int]] = []
        """Runs [version, tokens] of the group's tokens."""
        self.submit_version, self.aborted = submit_version, False

    def add(self, version: int, count: int) -> None:
        self.tokens += count
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += count
        else:
            self.versions.append([version, count])

    @property
    def oldest(self) -> int:
        return min(v for v, _ in self.versions)


class _Seq:
    __slots__ = ("group", "remaining", "prompt")

    def __init__(self, group: _Group, length: int, prompt: int):
        self.group, self.remaining, self.prompt = group, length, prompt


class _Engine:
    """Continuous batching, advanced in macro-steps: k decode steps with the same running set
    (until the first sequence finishes), one event each. Weights arriving during a macro-step
    take effect from the next decode step that starts after them (the swap is between steps)."""

    def __init__(self, costs: Costs):
        self.c, self.running, self.waiting = costs, [], deque()
        self.version, self.busy, self.busy_s, self.stall = 0, False, 0.0, 0.0
        self.k, self.start, self.first, self.step = 0, 0.0, 0.0, 0.0
        self.old: tuple[int, int] | None = None
        """(steps at the old version, old version) when weights arrived during the macro-step."""

    def plan(self, now: float) -> float:
        """Admits waiting sequences; returns the duration of the next macro-step (0: idle)."""
        prefill = 0
        self.running = [q for q in self.running if not q.group.aborted]
        while self.waiting and len(self.running) < self.c.max_batch_size:
            seq = self.waiting.popleft()
            if seq.group.aborted:
                continue
            self.running.append(seq)
            prefill += seq.prompt
        if not self.running:
            return 0.0
        self.step = self.c.decode_base_s + self.c.decode_per_seq_s * len(self.running)
        self.first = self.step + self.c.prefill_per_token_s * prefill + self.stall
        self.stall, self.start, self.old = 0.0, now, None
        self.k = min(q.remaining for q in self.running)
        return self.first + (self.k - 1) * self.step

    def new_weights(self, now: float, version: int) -> None:
        if version <= self.version:
            return
        if self.busy and self.old is None:
            elapsed = now - self.start  # decode steps started before now keep the old weights
            started = 1 if elapsed <= self.first else 1 + math.ceil((elapsed - self.first) / self.step)
            self.old = (min(started, self.k), self.version)
        self.version = version

    def finish(self) -> list[_Group]:
        """The macro-step's k tokens per running sequence (at the versions they were decoded with);
        the groups completed."""
        done, still = [], []
        for seq in self.running:
            if seq.group.aborted:
                continue
            if self.old is not None:
                seq.group.add(self.old[1], self.old[0])
                if self.k > self.old[0]:
                    seq.group.add(self.version, self.k - self.old[0])
            else:
                seq.group.add(self.version, self.k)
            seq.remaining -= self.k
            if seq.remaining == 0:
                seq.group.left -= 1
                if seq.group.left == 0:
                    done.append(seq.group)
            else:
                still.append(seq)
        self.running, self.old = still, None
        return done


def simulate(costs: Costs, workload: Workload, mode: str) -> Plan:
    """The modelled run of `workload.steps` steps in `mode` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return _Simulation(costs, workload, mode).run()


class _Simulation:
    def __init__(self, costs: Costs, w: Workload, mode: str):
        self.c, self.w, self.mode = costs, w, mode
        self.rng = random.Random(w.seed)
        self.engines = [_Engine(costs) for _ in range(costs.engines)]
        self.now, self.version, self.next_gid, self.rr = 0.0, 0, 0, 0
        self.inflight: dict[int, _Group] = {}
        """Groups submitted and not yet received by the controller (finished ones included)."""
        self.arrived: deque[_Group] = deque()
        """Groups the engines finished that the controller has not received yet."""
        self.finished: deque[_Group] = deque()
        """The controller's buffer: received groups not yet trained on."""
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.dropped = 0
        self.pushed_version = 0

    # ---- engines ---------------------------------------------------------------------------------
    def submit(self, count: int) -> None:
        for _ in range(count):
            group = _Group(self.next_gid, self.w.n, self.version)
            self.next_gid += 1
            self.inflight[group.id] = group
            engine = self.engines[self.rr % len(self.engines)]
            self.rr += 1
            for length in self.c.response_lengths(self.w.n, self.rng):
                engine.waiting.append(_Seq(group, length, self.c.prompt_len))
        for engine in self.engines:  # one submit call: its requests start decoding together
            self._kick(engine)

    def _kick(self, engine: _Engine) -> None:
        if not engine.busy:
            t = engine.plan(self.now)
            if t > 0:
                engine.busy = True
                engine.busy_s += t
                self._at(self.now + t, "decode", engine)

    def _at(self, t: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def advance(self) -> None:
        """Processes the next event (a macro-step's end or a weight arrival)."""
        t, _, kind, payload = heapq.heappop(self.events)
        self.now = t
        if kind == "decode":
            engine = payload
            engine.busy = False
            self.arrived.extend(g for g in engine.finish() if not g.aborted)
            self._kick(engine)
        elif kind == "weights":  # an in-flight swap stalls the next decode step; a waited one is in the wait
            version, in_flight = payload
            for engine in self.engines:
                engine.new_weights(self.now, version)
                engine.stall += self.c.swap_s if in_flight else 0.0

    def wait_until(self, condition) -> None:
        while not condition():
            if not self.events:
                raise RuntimeError("planner: nothing in flight and the condition cannot become true")
            self.advance()

    def wait_time(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            self.advance()
        self.now = max(self.now, until)

    # ---- the loops -------------------------------------------------------------------------------
    def run(self) -> Plan:
        step_s, tokens, learner_busy = [], 0, 0.0
        lags: dict[int, int] = {}  # token lag -> tokens
        step_lag: list[float] = []
        P = self.w.prompts_per_step
        if self.mode == "one_step_off":
            self.submit(P)
        for _ in range(self.w.steps):
            t0 = self.now
            if self.mode in ("sync", "fixed_lag"):
                self.submit(P)
                batch = self._collect_all(P)
            elif self.mode == "one_step_off":
                batch = self._collect_all(P)
                self._push(wait=True)
                self.submit(P)
            else:
                batch = self._collect_async()
            train_s = self.c.train_overhead_s + self.c.train_per_token_s * sum(
                g.tokens + self.w.n * self.c.prompt_len for g in batch)
            learner_busy += train_s
            self.wait_time(self.now + train_s)
            if self.mode == "fixed_lag":  # by construction: segment j of a response is K + J - j old
                K, J = self.w.inter_lag, self.w.intra_lag
                stride = max(self.c.max_new_tokens // (J + 1), 1)
                for g in batch:
                    for i in range(g.tokens // self.w.n):
                        lag = min(self.version, K + J - min(J, i // stride))
                        lags[lag] = lags.get(lag, 0) + self.w.n
            else:
                for g in batch:
                    for version, count in g.versions:
                        lags[self.version - version] = lags.get(self.version - version, 0) + count
            tokens += sum(g.tokens for g in batch)
            step_lag.append(sum((self.version - v) * c for g in batch for v, c in g.versions)
                            / max(sum(g.tokens for g in batch), 1) if self.mode != "fixed_lag" else
                            min(self.version, self.w.inter_lag + self.w.intra_lag / 2))
            self.version += 1
            if self.mode in ("sync", "fixed_lag"):
                self._push(wait=True)
            elif self.mode == "fully_async":
                self._push(wait=False)
                self._abort_doomed()
            step_s.append(self.now - t0)
        busy = sum(e.busy_s for e in self.engines)
        return Plan(self.mode, step_s, tokens, self.now, learner_busy, min(busy, self.now * len(self.engines)),
                    len(self.engines), lags, step_lag, self.dropped)

    def _push(self, wait: bool) -> None:
        if self.version == self.pushed_version:  # the controller pushes only a new version
            return
        self.pushed_version = self.version
        arrive = self.now + self.c.push_s
        self._at(arrive, "weights", (self.version, not wait))
        if wait:
            self.wait_time(arrive + self.c.swap_s)

    def _receive(self) -> None:
        """The controller's poll: waits for a finished group when none has arrived, then takes
        every one that has (the loop receives only while it collects, not while it trains)."""
        self.wait_until(lambda: bool(self.arrived))
        while self.arrived:
            group = self.arrived.popleft()
            del self.inflight[group.id]
            self.finished.append(group)

    def _collect_all(self, count: int) -> list[_Group]:
        while len(self.finished) < count:
            self._receive()
        return [self.finished.popleft() for _ in range(count)]

    def _collect_async(self) -> list[_Group]:
        """The loop's `_collect` with its fully_async in-flight target: groups not yet received
        count as in flight, so the engines get new work only once the controller has received."""
        P, lag = self.w.prompts_per_step, self.w.max_policy_lag
        target = self.w.max_inflight_groups or 2 * P
        while True:
            fresh = [g for g in self.finished if g.oldest >= self.version - lag]
            stale = len(self.finished) - len(fresh)
            if stale:
                self.dropped += stale
                self.finished = deque(fresh)
            cap = P * (lag + 1) - len(self.finished)
            want = max(min(target, cap), P - len(self.finished)) - len(self.inflight)
            if want > 0:
                self.submit(want)
            if len(self.finished) >= P:
                return [self.finished.popleft() for _ in range(P)]
            self._receive()

    def _abort_doomed(self) -> None:
        oldest = self.version - self.w.max_policy_lag
        for gid, group in list(self.inflight.items()):
            if group.submit_version < oldest:  # finished but not received: aborted all the same
                group.aborted = True
                del self.inflight[gid]
                self.dropped += 1
        self.arrived = deque(g for g in self.arrived if not g.aborted)


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
    import time

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
    from pathlib import Path

    from entr_megatron.config.loader import load_config
    from entr_megatron.utils.run_log import read_metrics

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
                  **engine_costs)
    workload = Workload(prompts_per_step=r.prompts_per_step, n=r.sampling.n, max_policy_lag=c.max_policy_lag,
                        max_inflight_groups=c.max_inflight_groups, inter_lag=c.inter_lag, intra_lag=c.intra_lag,
                        seed=c.seed)
    if calibrate_engine and c.mode in ("sync", "fixed_lag"):
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

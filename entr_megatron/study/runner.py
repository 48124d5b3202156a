"""Runs a study: every cell an ordinary `train` run directory, N at a time, locally or on Ray.

    OUT/
      .lock                        held by the one `study run` working on OUT (pid, host, start time)
      study.json, spec.yaml        what the study is (axes, report grouping, every cell's id and axes)
                                   and the spec as given
      warmup/                      the shared SFT run (warmup/sft/model), when the spec has one;
                                   with warmup.per_seed one per seed (warmup/seed=N/sft/model)
      cells/<cell id>/
        cell.json                  its axes and config hash (what it computes)
        cell.yaml                  its config, as `train --config` reads it
        status.json                pending | running | done | failed | interrupted, error (a failed
                                   attempt's message: cell_log.py), wall_s, attempts, ran_on (the
                                   last attempt's launcher, host and process)
        train.log                  the train command's output (appended per attempt)
        metrics.jsonl, eval.json, checkpoints/, ...   the train run directory

Rerunning skips cells whose status is done (a finished study reruns in seconds) and runs the
others again: a cell that was running when the study was killed resumes from its last
checkpoint (`train` resumes its run directory), a failed one is retried. A failed cell is
recorded with its error and does not stop the others. A cell whose config changed since it ran
is refused (its results would mix two configs): use another OUT or delete the cell. One runner
at a time works on an OUT: a second one is refused at once (StudyLockedError, naming the holder);
the kernel drops the lock of a runner that died, however it died.

Local cells are subprocesses of this one: Ctrl-C or SIGTERM (a scheduler's preemption) starts no
more cells and stops the running ones at their next step with a checkpoint (train's own SIGINT
handling; SIGTERM is forwarded to them as SIGINT); they are recorded as interrupted (also when
the stop reached them while they were still starting) and resume on the next run. On
Ray (`--launcher ray`, `ray_address` from the base config's launcher section or a local
cluster), each cell is a task with the spec's `resources`; OUT must be on a file system every
node sees.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from entr_megatron.study.cell_log import cell_error
from entr_megatron.study.spec import SEED_KEY, Cell, SpecError, StudySpec, flatten_config
from entr_megatron.utils.jsonl import atomic_output
from entr_megatron.utils.ray_connect import connect_ray
from entr_megatron.utils.run_lock import RunLock, RunLockedError
from entr_megatron.utils.spawn import die_with_parent

__all__ = ["INTERRUPTED_CODES", "StudyLockedError", "StudyResult", "WarmupError", "WarmupStopped", "run_study"]

INTERRUPTED_CODES = (130, -signal.SIGINT, -signal.SIGTERM)
"""Exit codes of a cell stopped by a signal before it could checkpoint: `entr-megatron` returns 130
on an interrupt it did not turn into a step-end stop (e.g. during start-up), or the process died
of SIGINT / SIGTERM itself."""


class StudyLockedError(RunLockedError):
    """Another `study run` is working on the study directory (the message names it)."""


def _write_json(path: Path, data: Any) -> None:
    with atomic_output(str(path)) as f:
        json.dump(data, f, indent=2, default=str)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_yaml(path: Path, raw: dict) -> None:
    with atomic_output(str(path)) as f:
        yaml.safe_dump(raw, f, sort_keys=False)


_RUNNING: set[subprocess.Popen] = set()
"""Cell processes of this study process (for forwarding a stop)."""
_RUNNING_LOCK = threading.Lock()


CELL_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Set for every cell and warm-up unless the environment sets them. Cells share cores (N at a
time, each with a driver, learner ranks and engines), and an OpenMP thread that spins at a barrier
burns the core another process is waiting for: a warm-up sharing 2 cores with other jobs ran
about 10x slower per step with OpenMP's default (spin, then sleep) than with PASSIVE (sleep at
once). Results are unchanged; only how threads wait differs."""


def run_command(args: list[str], log_path: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs `entr-megatron ARGS` with its output appended to `log_path`; (exit code, last stdout line).
    The child dies with this process (Linux: PR_SET_PDEATHSIG), so a killed study leaves no orphans.
    Its environment is `env` (default: this process's) with CELL_ENV_DEFAULTS where unset."""
    env = {**CELL_ENV_DEFAULTS, **(os.environ if env is None else env)}
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} entr-megatron {' '.join(args)}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", *args], stdout=subprocess.PIPE,
                                stderr=log, text=True, env=env, preexec_fn=die_with_parent)
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            last = ""
            for line in proc.stdout:
                log.write(line)
                if line.strip():
                    last = line.strip()
            return proc.wait(), last
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)


class StopRequest:
    """SIGTERM (a scheduler's preemption) or SIGINT to the study: start no more cells. SIGTERM is
    forwarded to the running cells as SIGINT, so each stops at its next step with a checkpoint
    (a terminal's Ctrl-C reaches them itself). Handlers are restored on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        first = self.signal is None
        self.signal = signum
        if signum == signal.SIGTERM and first:
            with _RUNNING_LOCK:
                for proc in _RUNNING:
                    proc.send_signal(signal.SIGINT)
        print(f"[study] {signal.Signals(signum).name}: no more cells start; running ones stop at their next "
              "step with a checkpoint; run the same command to resume", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _cell_attempt(cell_dir: str) -> dict[str, Any]:
    """One attempt at a cell: `train` on its directory (resuming it). Runs in a thread or a Ray task;
    the outcome names the host and the process that ran it."""
    t0 = time.time()
    code, last = run_command(["train", "--config", str(Path(cell_dir) / "cell.yaml"), "--run-dir", cell_dir],
                             str(Path(cell_dir) / "train.log"))
    out: dict[str, Any] = {"returncode": code, "wall_s": time.time() - t0, "host": socket.gethostname(),
                           "pid": os.getpid()}
    if code == 0:
        try:
            out["result"] = json.loads(last)
        except json.JSONDecodeError:
            out["result"] = None
    else:
        out["error"] = cell_error((Path(cell_dir) / "train.log").read_text(errors="replace"), code)
    return out


class StudyResult(dict):
    """{"done": [ids], "failed": [ids], "skipped": [ids], "interrupted": bool (the study was stopped),
    "signal": int | None, "out": str}."""


class Progress:
    """One line per change for the whole study: done / running / failed of N, ETA."""

    def __init__(self, total: int, done: int, jobs: int):
        self.total, self.done, self.failed, self.running, self.jobs = total, done, 0, 0, jobs
        self.t0, self.durations, self.lock = time.time(), [], threading.Lock()

    def update(self, started: int = 0, finished: str | None = None, wall_s: float | None = None, cell: str = "") -> None:
        with self.lock:
            self.running += started - (finished is not None)
            if finished == "done":
                self.done += 1
                self.durations.append(wall_s or 0.0)
            elif finished == "failed":
                self.failed += 1
            left = self.total - self.done - self.failed
            eta = ""
            if self.durations and left:
                per = sum(self.durations) / len(self.durations)
                eta = f", eta {_minutes(per * left / max(min(self.jobs, left), 1))}"
            what = f" [{finished or 'started'}: {cell}]" if cell else ""
            print(f"[study] {self.done}/{self.total} done, {self.running} running, {self.failed} failed, "
                  f"elapsed {_minutes(time.time() - self.t0)}{eta}{what}", file=sys.stderr, flush=True)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _prepare(spec: StudySpec, out: Path, jobs: int = 1, stop: StopRequest | None = None,
             seeds: set[int] | None = None) -> Path | dict[int, Path] | None:
    """Writes study.json (every cell of the spec: a partly run study's report lists the cells never
    run) and the spec; runs the shared warm-up once, or with `warmup.per_seed` each seed's (`jobs` at
    a time), or checks `warmup.model` for `seeds` (None: all; the seeds of the cells to run). Returns
    its model, {seed: model}, or None. A failed warm-up, or a stop signal, starts no further one."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cells").mkdir(exist_ok=True)
    _write_json(out / "study.json", {"name": spec.name, "spec": str(spec.path), "axes": spec.axes,
                                     "report": spec.report, "resources": spec.resources,
                                     "cells": [{"id": cid, "axes": axes} for cid, axes in spec.cell_axes()]})
    with atomic_output(str(out / "spec.yaml")) as f:
        f.write(spec.path.read_text())
    if spec.warmup is not None and "model" in spec.warmup:
        return spec.warmup_models(seeds)
    if spec.warmup_config() is None:
        return None
    if not spec.per_seed_warmup:
        return _warm_up(spec.warmup_config(), out / "warmup", "the shared warm-up", stop)
    warmups = {seed: (spec.warmup_config(seed), out / "warmup" / f"seed={seed}") for seed in spec.seeds}
    for seed, (raw, warm) in warmups.items():  # every one checked before any runs
        _check_warmup_config(raw, warm, f"seed {seed}'s warm-up")
    gave_up = threading.Event()  # set by the first warm-up that fails: no other starts after it

    def one(seed: int) -> Path | None:
        if gave_up.is_set():
            return None
        try:
            return _warm_up(*warmups[seed], f"seed {seed}'s warm-up", stop)
        except BaseException:
            gave_up.set()
            raise

    with cf.ThreadPoolExecutor(max_workers=min(jobs, len(spec.seeds))) as pool:
        futures = {seed: pool.submit(one, seed) for seed in warmups}
        cf.wait(futures.values())
    for future in futures.values():  # the first failure in seed order; a warm-up not started had none
        if future.exception() is not None:
            raise future.exception()
    return {seed: f.result() for seed, f in futures.items()}


class WarmupError(RuntimeError):
    """A warm-up (`sft`) failed; the message names its log."""


class WarmupStopped(RuntimeError):
    """A stop signal reached the study during its warm-ups; the same command resumes them."""


def _check_warmup_config(raw: dict, warm: Path, what: str) -> None:
    """Refuses a warm-up directory made with another config (a changed spec or base: its model, or
    its partial SFT run, would be taken for this one's), naming the fields that differ."""
    before = _read_yaml(warm / "warmup.yaml")
    if before is None or _without_run_dir(before) == _without_run_dir(raw):
        return
    old, new = flatten_config(_without_run_dir(before)), flatten_config(_without_run_dir(raw))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k, "<unset>") != new.get(k, "<unset>"))
    shown = ", ".join(f"{k}: {old.get(k, '<unset>')!r} there, {new.get(k, '<unset>')!r} in the spec"
                      for k in changed[:5])
    raise SpecError(f"{what} in {warm} was made with another config ({shown}{', ...' if len(changed) > 5 else ''}); "
                    "use another --out, or move that directory away to run the warm-up again")


def _warm_up(raw: dict, warm: Path, what: str, stop: StopRequest | None = None) -> Path:
    """Runs one warm-up (`sft`) in `warm` unless its model is there; returns warm/sft/model."""
    _check_warmup_config(raw, warm, what)
    model = warm / "sft" / "model"
    if (model / "config.json").exists():
        return model
    if stop is not None and stop.signal is not None:
        raise WarmupStopped(f"{what} not started: the study was stopped; run the same command to resume")
    warm.mkdir(parents=True, exist_ok=True)
    raw = {**raw, "logging": {**raw.get("logging", {}), "run_dir": str(warm)}}
    _write_yaml(warm / "warmup.yaml", raw)
    print(f"[study] {what} (SFT) in {warm}", file=sys.stderr, flush=True)
    code, _ = run_command(["sft", "--config", str(warm / "warmup.yaml"), "--run-dir", str(warm)], str(warm / "sft.log"))
    if stop is not None and stop.signal is not None and not (model / "config.json").exists():
        raise WarmupStopped(f"{what} stopped (exit {code}); run the same command to resume")
    if code != 0 or not (model / "config.json").exists():
        raise WarmupError(f"{what} failed (exit {code}); see {warm / 'sft.log'}")
    return model


def _recorded_by_older_version(cell: Cell, cell_dir: Path, known: dict) -> bool:
    """True when `known` (the cell's cell.json) records the computation of `cell` under an older
    set of config fields (fields added since, at their defaults, do not count); False when it
    records exactly this config. Raises SpecError naming the fields whose values differ. A
    cell.json without the fields (an older runner) is judged by the raw config (cell.yaml)."""
    digest = cell.config_hash()
    if known.get("config_hash") == digest:
        return False
    fields, before = cell.config_fields(), known.get("config")
    if isinstance(before, dict):
        changed = [k for k in fields if k in before and before[k] != fields[k]]
        if changed:
            shown = ", ".join(f"{k}: {before[k]!r} -> {fields[k]!r}" for k in changed[:5])
            raise SpecError(f"cell {cell.id} in {cell_dir} was run with another config ({shown}"
                            f"{', ...' if len(changed) > 5 else ''}); use another --out, or delete that cell's "
                            "directory to rerun it")
    else:
        old_raw = _read_yaml(cell_dir / "cell.yaml")
        if old_raw is None or _without_run_dir(old_raw) != _without_run_dir(cell.raw):
            raise SpecError(f"cell {cell.id} in {cell_dir} was run with another config (the spec or its base "
                            "changed); use another --out, or delete that cell's directory to rerun it")
    return True


def _without_run_dir(raw: dict) -> dict:
    logging_section = {k: v for k, v in (raw.get("logging") or {}).items() if k != "run_dir"}
    return {**raw, "logging": logging_section}


def _read_yaml(path: Path) -> dict | None:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _place(cell: Cell, out: Path, upgraded: list[str] | None = None) -> tuple[Path, bool]:
    """The cell's directory with cell.json and cell.yaml; True when it is already done. A cell run
    by an earlier version whose config only gained fields is kept, its cell.json rewritten and its
    id appended to `upgraded`."""
    cell_dir = out / "cells" / cell.id
    known = _read_json(cell_dir / "cell.json")
    if known is not None and _recorded_by_older_version(cell, cell_dir, known):
        if upgraded is not None:
            upgraded.append(cell.id)
        known = None
    cell_dir.mkdir(parents=True, exist_ok=True)
    if known is None:
        _write_json(cell_dir / "cell.json", {"id": cell.id, "axes": cell.axes, "config_hash": cell.config_hash(),
                                             "config": cell.config_fields()})
    raw = {**cell.raw, "logging": {**cell.raw.get("logging", {}), "run_dir": str(cell_dir)}}
    _write_yaml(cell_dir / "cell.yaml", raw)
    status = _read_json(cell_dir / "status.json") or {}
    if not status:
        _write_json(cell_dir / "status.json", {"state": "pending", "error": None, "wall_s": None, "attempts": 0})
    return cell_dir, status.get("state") == "done"


def run_study(spec: StudySpec, out: str | os.PathLike, launcher: str = "local", jobs: int = 1,
              ray_address: str | None = None, only: list[str] | None = None, warmups_only: bool = False) -> StudyResult:
    """Runs every cell not yet done (see the module docstring), or of those the ones `only` selects
    (StudySpec.select), or with `warmups_only` only the warm-ups; returns what happened."""
    if jobs < 1:
        raise SpecError(f"--jobs must be >= 1, got {jobs}")
    if launcher not in ("local", "ray"):
        raise SpecError(f"--launcher must be 'local' or 'ray', got {launcher!r}")
    out = Path(out).resolve()
    # a bad filter is refused before the warm-up runs; only the chosen cells' warm-ups must exist
    seeds = {cell.axes[SEED_KEY] for cell in spec.select(spec.cells(), only)} if only else None
    try:
        lock = RunLock(out, command="study run", flag="--out").acquire()
    except RunLockedError as e:
        raise StudyLockedError(str(e).replace("another job", "another study run", 1)) from None
    try:
        if warmups_only:
            with StopRequest() as stop:
                _prepare(spec, out, jobs, stop)
            return StudyResult(done=[], failed=[], skipped=[], interrupted=False, out=str(out))
        return _run_locked(spec, out, launcher, jobs, ray_address, only, seeds)
    finally:
        lock.release()


def _run_locked(spec: StudySpec, out: Path, launcher: str, jobs: int, ray_address: str | None,
                only: list[str] | None, seeds: set[int] | None) -> StudyResult:
    with StopRequest() as stop:
        model = _prepare(spec, out, jobs, stop, seeds)
    cells = spec.cells(warmup_model=model)
    if only:
        cells = spec.select(cells, only)
    todo, skipped, upgraded = [], [], []
    for cell in cells:
        cell_dir, done = _place(cell, out, upgraded)
        (skipped if done else todo).append((cell, cell_dir))
    if upgraded:
        print(f"[study] {len(upgraded)} cells were recorded by an earlier version with the same settings (config "
              "fields added since are at their defaults): kept", file=sys.stderr, flush=True)
    result = StudyResult(done=[], failed=[], skipped=[c.id for c, _ in skipped], interrupted=False, out=str(out))
    progress = Progress(len(cells), len(skipped), jobs)
    if not todo:
        print(f"[study] all {len(cells)} cells done ({out})", file=sys.stderr, flush=True)
        return result
    submit = _ray_submitter(spec, ray_address) if launcher == "ray" else None

    def attempt(cell_dir: Path) -> dict[str, Any]:  # in a worker thread: runs the cell, records nothing
        try:
            return submit(str(cell_dir)) if submit else _cell_attempt(str(cell_dir))
        except Exception as e:  # the launcher itself failed (e.g. a Ray task died): record, go on
            return {"returncode": -1, "wall_s": 0.0, "error": f"{type(e).__name__}: {e}"}

    def start(cell: Cell, cell_dir: Path) -> None:
        status = _read_json(cell_dir / "status.json") or {}
        status.update(state="running", attempts=status.get("attempts", 0) + 1, started=time.time())
        _write_json(cell_dir / "status.json", status)
        progress.update(started=1, cell=cell.id)
        running[pool.submit(attempt, cell_dir)] = (cell, cell_dir)

    def record(cell: Cell, cell_dir: Path, outcome: dict[str, Any]) -> None:
        status = _read_json(cell_dir / "status.json") or {}
        code = outcome["returncode"]
        ok = code == 0 and (outcome.get("result") or {}).get("stopped") is not True
        # stopped at a step end (exit 0, "stopped"), or by the stop before it could checkpoint
        interrupted = not ok and (code == 0 or code in INTERRUPTED_CODES or stop.signal is not None)
        state = "done" if ok else "interrupted" if interrupted else "failed"
        status.update(state=state, error=None if ok or interrupted else outcome.get("error"),
                      wall_s=(status.get("wall_s") or 0.0) + outcome["wall_s"], result=outcome.get("result"),
                      ran_on={"launcher": launcher, "host": outcome.get("host"), "pid": outcome.get("pid")})
        _write_json(cell_dir / "status.json", status)
        if state != "interrupted":
            result[state].append(cell.id)
        progress.update(finished=state, wall_s=outcome["wall_s"], cell=cell.id)

    # The main thread starts and records every cell: a stop signal's handler runs there, before the
    # outcome it may explain is recorded and before another cell could start (a worker thread taking
    # the next cell itself would race the handler).
    running: dict[cf.Future, tuple[Cell, Path]] = {}
    queue = iter(todo)
    with StopRequest() as stop, cf.ThreadPoolExecutor(max_workers=jobs) as pool:
        for cell, cell_dir in itertools.islice(queue, jobs):
            start(cell, cell_dir)
        while running:
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for future in finished:
                record(*running.pop(future), future.result())
                following = next(queue, None) if stop.signal is None else None
                if following is not None:
                    start(*following)
    result["interrupted"] = stop.signal is not None
    result["signal"] = stop.signal
    return result


def _ray_submitter(spec: StudySpec, ray_address: str | None):
    """A function running one cell attempt as a Ray task with the spec's resources, blocking for it."""
    ray = connect_ray(ray_address, "base.launcher.ray_address", "--launcher ray", log_to_driver=False)
    options = {"num_cpus": spec.resources.get("num_cpus", 1), "num_gpus": spec.resources.get("num_gpus", 0),
               "max_retries": 0}
    remote = ray.remote(**options)(_cell_attempt)
    return lambda cell_dir: ray.get(remote.remote(cell_dir))

"""Faults injected on purpose into `entr-megatron train` runs (subprocesses, real ranks and engines).

Each test asserts the outcome the job promises and that metrics.jsonl holds every step exactly
once afterwards:

    fault                                 outcome
    two jobs on one run directory         the second exits 2 at once, naming the holder's pid
    SIGTERM (preemption)                  the step finishes, a checkpoint is saved, exit 0, no process left
    a flipped byte in the newest ckpt,
    and `latest` deleted                  both named; resume from the one before, not from step 0
    garbage `latest`, truncated or
    deleted shard                         named by `checkpoint verify`; resume from the newest good one
    every checkpoint damaged              exit 2 naming each, nothing overwritten; --restart-from-scratch
                                          starts over with the old ones kept aside
    full disk (a small tmpfs)             checked before start (exit 2, the numbers); a save that fails
                                          says ENOSPC and leaves no partial files (test_learner_checkpoint)
    read-only run directory               exit 2 naming it, before anything starts
    kill -9, then SIGSTOP of the engine   each replaced by a new engine (the learner's weights, the lost
                                          groups again; engines/restarts 1, then 2), exit 0
    kill -9 of learner rank 0             with launcher.max_restarts 1: new ranks from the last checkpoint,
                                          the engines kept, exit 0
                                          (these three injected at fixed versions: utils/faults.py)
    an SGLang server given by URL dies    set aside, the run goes on with the other; restarted on its port:
                                          taken back with the learner's weights, exit 0
(a kill -9 of the engine in fixed_lag mode: tests/e2e/test_train.py, metrics equal to an undisturbed run's)

The tiny model trains from random weights (no warm-up: rewards need not vary for these checks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from entr_megatron.utils.faults import FAULT_DIR_ENV, FAULT_ENV
from test_train import base_config, cli

CKPT_EVERY = 2


def config(tmp: Path, name: str, **controller) -> tuple[Path, Path]:
    run_dir = tmp / name
    cfg = base_config(run_dir, controller={"mode": "fully_async", "train_steps": 6, "max_policy_lag": 2,
                                           "checkpoint_interval": CKPT_EVERY, **controller})
    cfg["task"]["eval_size"] = 4
    cfg["logging"] = {**cfg["logging"], "progress_bar": False, "tensorboard": False}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def steps_of(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_every_step_once(run_dir: Path, n: int) -> None:
    assert steps_of(run_dir) == list(range(n)), steps_of(run_dir)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of 6 steps with checkpoints at steps 4 and 6 (keep_last_checkpoints 2)."""
    tmp = tmp_path_factory.mktemp("faults")
    cfg, run_dir = config(tmp, "base")
    cli("train", "--config", str(cfg))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    assert_every_step_once(run_dir, 6)
    return run_dir


def copy_run(finished_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished run whose config asks for 2 more steps."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    cfg, _ = config(tmp_path, "run", train_steps=8)
    return cfg, run_dir


def test_second_job_is_refused_and_sigterm_saves_exits_0_and_leaves_no_process(tmp_path):
    cfg, run_dir = config(tmp_path, "long", train_steps=10_000, checkpoint_interval=0)
    job = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(cfg)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(steps_of(run_dir)) < 3:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.5)
        t0 = time.monotonic()
        second = cli("train", "--config", str(cfg), check=False)
        assert second.returncode == 2 and time.monotonic() - t0 < 60
        assert f"is in use by another job: pid {job.pid} on" in second.stderr, second.stderr[-2000:]
        family = psutil.Process(job.pid).children(recursive=True)
        assert len(family) >= 2  # an engine and a learner rank at least
        t0 = time.monotonic()
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["stopped"] is True and "SIGTERM: finishing this step" in err
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text())
    assert stopped_at == len(steps_of(run_dir)) and took < 25 + 10  # within stop_grace_s, plus the shutdown
    time.sleep(1)
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    # Resume: every step once.
    cli("train", "--config", str(cfg), "--max-steps", "2")
    assert_every_step_once(run_dir, stopped_at + 2)


def test_a_flipped_byte_and_a_deleted_latest_are_named_and_the_run_resumes_from_the_good_one(finished_run, tmp_path):
    cfg, run_dir = copy_run(finished_run, tmp_path)
    flip_byte(run_dir / "checkpoints" / "iter_0000006" / "__0_0.distcp")
    (run_dir / "checkpoints" / "latest").unlink()  # never a fresh start while checkpoints exist
    proc = cli("train", "--config", str(cfg))
    assert "latest: missing (deleted?)" in proc.stderr
    assert "skipping " + str(run_dir / "checkpoints" / "iter_0000006") + ": __0_0.distcp: SHA-256 differs" in proc.stderr
    assert "resumed from step 4" in proc.stderr
    assert_every_step_once(run_dir, 8)  # steps 4 and 5 redone (their old lines replaced), then 6 and 7


def test_checkpoint_verify_names_each_damage(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    ckpt = run_dir / "checkpoints"

    def verify(*args: str) -> tuple[int, str]:
        proc = cli("checkpoint", "verify", *args or (str(run_dir),), check=False)
        return proc.returncode, proc.stdout

    assert verify() == (0, f"{ckpt}/iter_0000004: ok ({_size(ckpt / 'iter_0000004')})\n"
                           f"{ckpt}/iter_0000006: ok ({_size(ckpt / 'iter_0000006')})\nlatest: 6\n"
                           "train resumes from step 6\n")
    shard = next((ckpt / "iter_0000006").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    code, out = verify()
    assert code == 1 and f"    {shard.name}: " in out and "(truncated or rewritten)" in out
    assert "train resumes from step 4" in out
    code, out = verify(str(ckpt / "iter_0000006"), "--sizes-only")
    assert code == 1 and "(truncated or rewritten)" in out and "latest" not in out
    (ckpt / "latest").write_text("banana")
    (ckpt / "iter_0000004" / "common.pt").unlink()
    code, out = verify()
    assert code == 1 and "common.pt: missing" in out and "latest: banana" in out
    assert "train cannot resume: no usable checkpoint" in out


def _size(path: Path) -> str:
    m = json.loads((path / "manifest.json").read_text())
    return f"{m['total_bytes'] / 2**20:.1f} MiB, {len(m['files'])} files"


def test_every_checkpoint_damaged_is_refused_and_restart_from_scratch_keeps_them(finished_run, tmp_path):
    cfg, run_dir = copy_run(finished_run, tmp_path)
    for step in (4, 6):
        flip_byte(run_dir / "checkpoints" / f"iter_{step:07d}" / "common.pt")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    proc = cli("train", "--config", str(cfg), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no usable checkpoint" in proc.stderr and "iter_0000006: common.pt" in proc.stderr
    assert "iter_0000004: common.pt" in proc.stderr and "--restart-from-scratch" in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing touched
    assert_every_step_once(run_dir, 6)
    proc = cli("train", "--config", str(cfg), "--restart-from-scratch")
    aside = sorted(p.name for p in run_dir.iterdir() if ".discarded-" in p.name)
    assert [a.split(".discarded-")[0] for a in aside] == ["checkpoints", "metrics.jsonl"]
    assert sorted(p.name for p in (run_dir / aside[0]).iterdir()) == before  # kept as they were
    assert len((run_dir / aside[1]).read_text().splitlines()) == 6
    assert "resumed from" not in proc.stderr
    assert_every_step_once(run_dir, 8)


@pytest.fixture
def tmpfs(tmp_path):
    """A 600 KiB tmpfs (root and a mount-capable sandbox only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_caught_before_start_and_a_failed_save_says_enospc(finished_run, tmp_path, tmpfs):
    cfg, run_dir = copy_run(finished_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").symlink_to(tmpfs)
    (run_dir / "metrics.jsonl").unlink()
    proc = cli("train", "--config", str(cfg), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"not enough free space for a checkpoint in {run_dir / 'checkpoints'}" in proc.stderr
    assert "MiB free" in proc.stderr and not (run_dir / "metrics.jsonl").exists()
    assert "engine" not in proc.stderr  # refused before any process started
    # (a save that runs out of room mid-way: tests/distributed/test_learner_checkpoint.py)


def test_a_read_only_run_directory_is_refused_before_anything_starts(tmp_path, tmpfs):
    cfg, _ = config(tmp_path, "ro")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    cfg_data = yaml.safe_load(cfg.read_text())
    cfg_data["logging"]["run_dir"] = str(tmpfs / "run")
    cfg.write_text(yaml.safe_dump(cfg_data))
    proc = cli("train", "--config", str(cfg), check=False)
    assert proc.returncode == 2 and "Read-only file system" in proc.stderr, proc.stderr[-2000:]
    assert str(tmpfs / "run") in proc.stderr


def test_killed_and_stalled_engines_are_replaced_and_a_killed_rank_restarts_the_learner(tmp_path):
    """One job, three faults, each injected at a fixed point (utils/faults.py, no polling race): the
    engine kills itself (SIGKILL) when first asked to generate at version 3, its replacement stops
    itself (SIGSTOP: alive, silent) at version 6 (both replaced, the job goes on), then learner rank 0
    kills itself when asked to train version 16, after checkpoints taken since both replacements
    (launcher.max_restarts 1: new ranks from the last checkpoint, the engine kept)."""
    steps, kill_at, stop_at, rank_at = 24, 3, 6, 16
    cfg, run_dir = config(tmp_path, "faults", train_steps=steps)  # checkpoints every CKPT_EVERY steps
    data = yaml.safe_load(cfg.read_text())  # a SIGSTOPped engine: silent for 5 s, no health answer in 3 s
    data["rollout"] = {**data["rollout"], "poll_timeout_s": 5.0, "push_timeout_s": 20.0,
                       "embedded": {**data["rollout"]["embedded"], "health_timeout_s": 3.0}}
    data["launcher"]["max_restarts"] = 1
    cfg.write_text(yaml.safe_dump(data))
    (tmp_path / "fault_markers").mkdir()
    env = {**os.environ, FAULT_DIR_ENV: str(tmp_path / "fault_markers"),
           FAULT_ENV: f"engine@{kill_at}:generate:kill;engine@{stop_at}:generate:stop;rank0@{rank_at}:train:kill"}
    job = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(cfg)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = job.communicate(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    assert sorted(p.name for p in (tmp_path / "fault_markers").iterdir()) == ["fault-0", "fault-1", "fault-2"]
    assert "embedded engine 0 failed (the engine process exited (exit code -9))" in err, err[-4000:]
    assert "a learner rank failed" in err and "(launcher.max_restarts: 1 of 1)" in err, err[-4000:]
    assert "the engines kept" in err and "starting a new one (replacement 3" not in err, err[-4000:]
    assert json.loads(out.strip().splitlines()[-1])["learner_restarts"] == 1
    assert_every_step_once(run_dir, steps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restarts = [row["engines/restarts"] for row in rows]
    # The kill at version 3 (step 3's generation or earlier in flight) is counted by step 3 or later;
    # the stalled replacement is replaced too: two in all.
    assert restarts[:kill_at] == [0] * kill_at and restarts[-1] == 2 and restarts == sorted(restarts), restarts
    resumed = int(err.split("resuming from step ")[1].split()[0])  # the redone steps were written again
    assert restarts.index(2) <= resumed <= rank_at, (restarts, resumed)  # a checkpoint after both replacements
    assert [row["learner/restarts"] for row in rows] == [0] * resumed + [1] * (steps - resumed)
    print(f"\nengine killed at version {kill_at}, replaced by step {restarts.index(1)}; its replacement stopped at "
          f"version {stop_at}, replaced by step {restarts.index(2)}; learner rank 0 killed at version {rank_at}: "
          f"resumed from step {resumed}")


def _held_until(condition, timeout_s: float):
    """A mock server's `tamper` that holds each answer until `condition()` is true, at most `timeout_s`
    (then sends it: the test's asserts say what failed), and sends it unchanged."""
    def hold(answer):
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        return answer
    return hold


def test_an_sglang_server_given_by_url_that_dies_is_set_aside_and_taken_back_when_it_returns(tmp_path):
    """Two mock SGLang servers given by URL (tests/e2e/test_train_sglang.py's, joining the weight
    group over gloo); one dies on a /generate call (every connection dropped), the run goes on with
    the other, and when a server is started again on its port it is taken back with the learner's
    weights (it holds the final weights at the end)."""
    from test_train_sglang import GlooServer, MockSGLangServer, final_weights, vocab_size, write_run

    steps = 12
    v = vocab_size()
    servers = [MockSGLangServer(vocab_size=v, weight_version="0").start() for _ in range(2)]
    gloo = [GlooServer(s) for s in servers]
    servers[1].crash_after = 5  # its 6th /generate: in step 2 or 3 (4 prompts a step over 2 servers)
    crash, times = servers[1].crash, {}
    servers[1].crash = lambda: times.setdefault("crash", time.monotonic()) and crash()
    port = int(servers[1].url.rsplit(":", 1)[1])
    cfg, run_dir = write_run(tmp_path, "sglang", [s.url for s in servers], "sync", poll_timeout_s=10.0,
                             sglang={"urls": [s.url for s in servers], "request_timeout_s": 2.0, "http_retries": 1,
                                     "retry_backoff_s": 0.1, "probe_interval_s": 0.5})
    data = yaml.safe_load(cfg.read_text())
    data["controller"]["train_steps"] = steps
    data["task"]["eval_size"] = 0
    cfg.write_text(yaml.safe_dump(data))
    job = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(cfg)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    back = None
    try:
        deadline = time.monotonic() + 600
        while job.poll() is None and back is None:
            assert time.monotonic() < deadline, job.communicate()[1][-3000:]
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
                if (run_dir / "metrics.jsonl").exists() else []
            if rows and rows[-1]["engines/out_of_service"] == 1:
                down_at, times["aside"] = len(rows), time.monotonic()
                back = MockSGLangServer(port=port, vocab_size=v, weight_version="default").start()  # restarted
                gloo.append(GlooServer(back))
                times["back"] = time.monotonic()
                # the survivor's rollouts wait for the prober's first /health on the restarted server, so the
                # run cannot end before it is noticed (the probe's backoff reaches seconds; the steps are fast)
                servers[0].tamper = _held_until(lambda: back.calls_to("/health"), 120.0)
            time.sleep(0.2)
        while job.poll() is None and "readmitted" not in times:
            if back.calls_to("/update_weights_from_distributed"):
                times["readmitted"] = time.monotonic()
            time.sleep(0.05)
        out, err = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
        for s in servers + ([back] if back is not None else []):
            if not s.crashed:
                s.stop()
    assert job.returncode == 0, err[-4000:]
    assert back is not None, "the server's failure was never noticed"
    assert f"SGLang server {servers[1].url} (rollout.sglang.urls) failed" in err and "going on without it" in err
    assert f"SGLang server {servers[1].url} answers again: taken back at weight version" in err, err[-4000:]
    assert_every_step_once(run_dir, steps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out_of_service = [row["engines/out_of_service"] for row in rows]
    first_down = out_of_service.index(1)
    assert out_of_service == [0] * first_down + [1] * (out_of_service.count(1)) + [0] * (steps - first_down -
                                                                                        out_of_service.count(1))
    assert out_of_service[-1] == 0 and down_at >= first_down + 1
    assert all(row["engines/restarts"] == 0 for row in rows)  # not ours to restart
    expected = final_weights(run_dir)  # the returned server holds the learner's final weights
    assert back.weight_version == str(steps) and gloo[-1].versions()
    for name, t in expected.items():
        torch.testing.assert_close(gloo[-1].held[name], t.float(), rtol=0, atol=0, msg=name)
    first_up = first_down + out_of_service.count(1)  # its row: taken back after that step's rollouts
    if first_up < steps - 1:  # (under load the probe's backoff can bring it back only after the last rollouts)
        assert back.calls_to("/generate"), "it served rollouts again"
    print(f"\nSGLang server died: its step's row out of service {times['aside'] - times['crash']:.1f} s later; "
          f"restarted: weights pushed to it {times['readmitted'] - times['back']:.1f} s later")

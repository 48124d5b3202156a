"""`entr-megatron train` end to end, as a user runs it (subprocesses, real learner ranks and engines).

A tiny Qwen3-style model gets a short SFT warm-up once (module fixture); every
test then trains from it for a few steps. Checked from what the run leaves on
disk: metrics.jsonl (the lag bound, per-token versions reaching the loss),
checkpoints (kill -9 and resume gives the same next-step metrics as a run that
was never interrupted), and the Ray launcher on a single-node local cluster (its engine
actor and a learner rank actor killed mid-run, both recovered).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from entr_megatron.utils.faults import FAULT_DIR_ENV, FAULT_ENV
from entr_megatron.utils.run_log import read_metrics

ARCH = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
        "tie_word_embeddings": True}


def base_config(run_dir: Path, **sections) -> dict:
    cfg = {
        "model": {"architecture": ARCH, "max_prompt_len": 16, "max_seq_len": 32},
        "algorithm": {"correction": "entr", "tau": 0.5},
        "learner": {"optim": {"lr": 2.0e-4}},
        "rollout": {"prompts_per_step": 4, "sampling": {"max_new_tokens": 6, "n": 4},
                    "embedded": {"num_threads": 1, "max_batch_size": 32}},
        "controller": {"mode": "sync", "train_steps": 4, "max_policy_lag": 2, "checkpoint_interval": 0},
        "task": {"name": "arithmetic", "eval_size": 16,
                 "arithmetic": {"digits": 1, "operations": ["+"], "format_reward": 0.2}},
        "launcher": {"cpu_threads_per_rank": 1},
        "logging": {"run_dir": str(run_dir), "progress_bar": True, "log_interval": 1, "tensorboard": True},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if isinstance(values, dict) else values
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    """A short warm-up, so that rewards vary within groups (RL from random weights has no signal)."""
    root = tmp_path_factory.mktemp("sft")
    config = write_config(root / "sft.yaml", base_config(root, sft={"steps": 30, "lr": 3.0e-3, "batch_size": 32}))
    cli("sft", "--config", str(config))
    model = root / "sft" / "model"
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()
    return model


def rl_config(tmp: Path, sft_model: Path, name: str, **sections) -> tuple[Path, Path]:
    run_dir = tmp / name
    cfg = base_config(run_dir, **sections)
    cfg["model"] = {**cfg["model"], "path": str(sft_model), "architecture": None}
    return write_config(tmp / f"{name}.yaml", cfg), run_dir


def assert_lag_bound(rows: list[dict], bound: int) -> None:
    assert rows, "no metrics"
    for row in rows:
        for key in ("step", "policy_version", "reward/mean", "entr/mask_fraction", "policy_lag/max",
                    "mismatch/k3", "throughput/tokens_per_s"):
            assert key in row, f"metrics.jsonl lacks {key!r} at step {row.get('step')}"
        assert row["policy_lag/max"] <= bound, f"step {row['step']}: policy lag {row['policy_lag/max']} > {bound}"


@pytest.mark.parametrize("mode, bound", [("sync", 0), ("one_step_off", 1)])  # fully_async: the next test
def test_each_mode_trains_within_the_lag_bound(tmp_path, sft_model, mode, bound):
    config, run_dir = rl_config(tmp_path, sft_model, mode, controller={"mode": mode, "max_policy_lag": max(bound, 1)})
    launched = time.time()
    proc = cli("train", "--config", str(config), "--max-steps", "4")
    finished = time.time()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    assert_lag_bound(rows, bound)
    if mode == "sync":
        assert all(r["policy_lag/max"] == 0 and r["policy_lag/spread_max"] == 0 for r in rows)
        # on policy at TP=1 (other layouts: test_on_policy_consistency): fp32 engine and learner hold the
        # same weights at every step, so their log-probs agree to rounding and ENTR masks nothing
        assert all(0.0 <= r["mismatch/k3"] <= 1e-6 and r["entr/mask_fraction"] == 0.0 for r in rows), \
            [(r["mismatch/k3"], r["entr/mask_fraction"]) for r in rows]
    if mode == "one_step_off":  # every step after the first trains on samples of the previous policy
        assert all(r["policy_lag/min"] == 1 for r in rows[1:])
    # the learner trained: weights moved (grad norm > 0 once rewards differ), the engines followed
    assert any(r["optim/grad_norm"] > 0 for r in rows)
    assert rows[-1]["weight_sync/version"] >= 3 and all(r.get("weight_sync/colocated_copies", 0) == 0 for r in rows)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["eval_after"]["eval/num_problems"] == 16
    # the start-up's timestamps (tools/bench_vs_trl.py times the start with them): RL began after the
    # process started and the evaluation before RL, and its steps ended before the process did
    assert launched + result["eval_before_s"] < result["rl_started_unix"] < finished - result["wall_s"]
    assert (run_dir / "final_model" / "config.json").exists()
    assert any((run_dir / "tensorboard").iterdir())


def test_fully_async_tight_bound_regenerates_instead_of_exceeding(tmp_path, sft_model):
    """Lag bound 1 with many groups in flight: stale groups are regenerated (counted), never trained on;
    the run ends like the other modes' (evaluation, final model, TensorBoard)."""
    config, run_dir = rl_config(tmp_path, sft_model, "tight", controller={"mode": "fully_async", "max_policy_lag": 1},
                                rollout={"prompts_per_step": 2})
    proc = cli("train", "--config", str(config), "--max-steps", "6", "controller.train_steps=6")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 6
    assert_lag_bound(rows, 1)
    assert any(r["optim/grad_norm"] > 0 for r in rows) and rows[-1]["weight_sync/version"] >= 5
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 6 and result["eval_after"]["eval/num_problems"] == 16
    assert (run_dir / "final_model" / "config.json").exists() and any((run_dir / "tensorboard").iterdir())


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_colocated_engines_take_the_weights_through_shared_memory(tmp_path, sft_model, mode):
    """rollout.placement colocated: every version reaches the engine by the shared-memory handoff
    (weight_sync/colocated.py). sync: the engine holds exactly the learner's weights at every step
    (on-policy, ENTR masks nothing); fully_async: an engine killed at version 2 is replaced, its
    successor takes the weights the same way; then learner rank 0 killed at version 3 restarts
    from the step-2 checkpoint and hands its weights to the engine kept; every step trains
    within the lag bound."""
    bound = {"sync": 0, "one_step_off": 1, "fully_async": 2}[mode]
    controller = {"mode": mode, "max_policy_lag": max(bound, 1)}
    env, launcher = dict(os.environ), {"cpu_threads_per_rank": 1}
    if mode == "fully_async":
        (tmp_path / "faults").mkdir()
        env.update({FAULT_DIR_ENV: str(tmp_path / "faults"), FAULT_ENV: "engine@2:generate:kill;rank0@3:train:kill"})
        controller["checkpoint_interval"], launcher["max_restarts"] = 2, 1
    config, run_dir = rl_config(tmp_path, sft_model, mode, controller=controller, launcher=launcher,
                                rollout={"placement": "colocated"})
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config),
                           "--max-steps", "4"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert_lag_bound(rows, bound)
    assert rows[-1]["weight_sync/version"] >= 3 and any(r["optim/grad_norm"] > 0 for r in rows)
    copies = [r["weight_sync/colocated_copies"] for r in rows if "weight_sync/colocated_copies" in r]
    assert copies and copies[-1] > 0 and min(copies) >= 0, copies  # the versions went through the handoff
    if mode == "sync":
        assert all(0.0 <= r["mismatch/k3"] <= 1e-6 and r["entr/mask_fraction"] == 0.0 for r in rows), \
            [(r["mismatch/k3"], r["entr/mask_fraction"]) for r in rows]
    if mode == "fully_async":
        assert "embedded engine 0 failed" in proc.stderr and rows[-1]["engines/restarts"] == 1, proc.stderr[-4000:]
        assert "a learner rank failed" in proc.stderr and rows[-1]["learner/restarts"] == 1, proc.stderr[-4000:]


DETERMINISTIC = ("reward/mean", "loss", "optim/grad_norm", "mismatch/k3", "entr/mask_fraction",
                 "rollout/response_len_mean", "policy_lag/max", "policy_version")


def _latest(run_dir: Path) -> int | None:
    latest = run_dir / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def test_kill_and_resume_gives_the_same_next_steps(tmp_path, sft_model):
    """Run A: 5 uninterrupted steps. Run B: the same config, its driver SIGKILLed right after its
    step-2 checkpoint (by itself: utils/faults.py, no polling race), then resumed. B's steps 2..
    equal A's (sync mode: sampling seeds follow the data position, the learner restores weights,
    optimizer and RNG, the engines get the checkpoint's weights)."""
    sections = {"controller": {"mode": "sync", "train_steps": 5, "checkpoint_interval": 2}}
    config_a, run_a = rl_config(tmp_path, sft_model, "a", **sections)
    config_b, run_b = rl_config(tmp_path, sft_model, "b", **sections)
    log_a = (tmp_path / "a.log").open("w")  # a file, not a pipe nobody reads while B runs
    run_a_job = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config_a)],
                                 stdout=subprocess.DEVNULL, stderr=log_a, text=True)  # beside B

    (tmp_path / "faults-b").mkdir()  # the driver only: its ranks and engine must notice and exit
    env = {**os.environ, FAULT_ENV: "driver@2:checkpoint", FAULT_DIR_ENV: str(tmp_path / "faults-b")}
    proc = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config_b)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, err[-4000:]
    assert _latest(run_b) == 2
    killed_rows = read_metrics(run_b / "metrics.jsonl")
    assert len(killed_rows) == 2

    cli("train", "--config", str(config_b))
    assert run_a_job.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-4000:]
    rows_a, rows_b = read_metrics(run_a / "metrics.jsonl"), read_metrics(run_b / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [0, 1, 2, 3, 4], "resumed metrics must continue, not repeat steps"
    assert any(rows_a[k]["optim/grad_norm"] > 0 for k in (2, 3, 4)), "a test without learning proves nothing"
    for k in (2, 3, 4):
        for key in DETERMINISTIC:
            a, b = rows_a[k][key], rows_b[k][key]
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), f"step {k} {key}: uninterrupted {a} vs resumed {b}"


def test_invalid_config_fails_before_start_naming_the_field(tmp_path, sft_model):
    config, run_dir = rl_config(tmp_path, sft_model, "bad")
    for override, field in [("controller.max_policy_lag=-1", "controller.max_policy_lag"),
                            ("controller.mode=semi_async", "controller.mode"),
                            ("algorithm.tau=-1", "algorithm.tau"),
                            ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
                            ("controller.max_polcy_lag=4", "max_policy_lag")]:
        proc = cli("train", "--config", str(config), override, check=False, timeout=120)
        assert proc.returncode == 2, (override, proc.stderr[-2000:])
        assert field in proc.stderr, (override, proc.stderr[-2000:])
    assert not run_dir.exists(), "nothing may start (or be written) before the config is valid"


def _ray_actors(job: subprocess.Popen, cls: str) -> list:
    """The job's Ray actor processes of class `cls`: the raylet's children that Ray titled
    `ray::<class>[.<method>]` (not the processes they fork, e.g. Megatron's checkpoint writers,
    which keep their parent's title)."""
    import psutil

    def actor(p):
        try:
            title, parent = p.cmdline()[:1], p.parent()
            return title and title[0].split(".")[0].split()[0] == f"ray::{cls}" and "raylet" in parent.name()
        except (psutil.Error, AttributeError):  # gone, or no parent
            return False

    return [p for p in psutil.Process(job.pid).children(recursive=True) if actor(p)]


def test_ray_launcher_on_a_local_cluster(tmp_path, sft_model):
    """The Ray launcher on a single-node local cluster, with two faults in the one job: the engine
    actor's process killed (-9) after the first step (replaced by a new actor: engines/restarts 1),
    then learner rank 0's actor (launcher.max_restarts 1: new rank actors from the last
    checkpoint, the engine actor kept); every step written exactly once, within the lag bound."""
    pytest.importorskip("ray")
    steps = 14  # of 20: no final evaluation and export, which other tests cover; steps after the engine's
    # replacement can take 0.1 s each, so the rank's kill needs room before the run ends
    config, run_dir = rl_config(tmp_path, sft_model, "ray", launcher={"max_restarts": 1},
                                controller={"mode": "fully_async", "max_policy_lag": 2, "train_steps": 20,
                                            "checkpoint_interval": 2})
    out, err = (tmp_path / "ray.out").open("w"), (tmp_path / "ray.err").open("w")  # files: nobody reads a pipe
    job = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config),
                            "--launcher", "ray", "--max-steps", str(steps)], stdout=out, stderr=err, text=True)
    times, engine = {}, None  # fault -> seconds from it to the first step row that counts its recovery
    try:
        deadline = time.monotonic() + 900
        while job.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "ray.err").read_text()[-4000:]
            rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            if "engine" not in times and rows:
                [victim] = _ray_actors(job, "_EngineActor")
                victim.kill()  # SIGKILL of the actor's process (its engine process dies with it)
                times["engine"] = time.monotonic()
            elif "engine" in times and "engine_s" not in times and rows and rows[-1]["engines/restarts"] == 1:
                times["engine_s"], engine = time.monotonic() - times["engine"], _ray_actors(job, "_EngineActor")
                replaced_at = len(rows)
                assert [p.pid for p in engine] != [victim.pid]
            elif "engine_s" in times and "rank" not in times and (_latest(run_dir) or 0) >= replaced_at:
                [rank] = _ray_actors(job, "_RayRank")
                rank.kill()  # after a checkpoint taken since the engine's replacement
                times["rank"], killed_after = time.monotonic(), len(rows)
                assert killed_after < steps, "the run ended before the rank could be killed"
            elif "rank" in times and rows and rows[-1].get("learner/restarts") == 1:
                times["rank_s"] = time.monotonic() - times["rank"]
                assert [p.pid for p in _ray_actors(job, "_EngineActor")] == [p.pid for p in engine]  # kept
                break
            time.sleep(0.05)
        assert job.wait(timeout=600) == 0, (tmp_path / "ray.err").read_text()[-6000:]
    finally:
        if job.poll() is None:
            job.kill()
    log = (tmp_path / "ray.err").read_text()
    assert "rank_s" in times, f"the job ended before both faults were recovered: {times}\n{log[-4000:]}"
    assert "embedded engine 0 failed (" in log and "starting a new one (replacement 1 of at most 3)" in log, log[-4000:]
    assert "a learner rank failed" in log and "(launcher.max_restarts: 1 of 1)" in log, log[-4000:]
    assert "replacement 2" not in log, log[-4000:]  # the engine actor kept through the learner's restart
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), "every step exactly once"
    assert_lag_bound(rows, 2)
    assert rows[0]["engines/restarts"] == 0 and rows[-1]["engines/restarts"] == 1
    resumed = int(log.split("resuming from step ")[1].split()[0])
    assert [r["learner/restarts"] for r in rows] == [0] * resumed + [1] * (steps - resumed)
    assert json.loads((tmp_path / "ray.out").read_text().strip().splitlines()[-1])["learner_restarts"] == 1
    print(f"\nRay engine actor killed: its replacement's first step row {times['engine_s']:.1f} s after the kill; "
          f"rank 0's actor killed after step {killed_after - 1}: resumed from step {resumed}, the first step row "
          f"{times['rank_s']:.1f} s after the kill")


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, sft_model):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does): the step finishes,
    a checkpoint of exactly the steps logged is saved, every process exits."""
    config, run_dir = rl_config(tmp_path, sft_model, "ctrlc",
                                controller={"mode": "fully_async", "train_steps": 200, "max_policy_lag": 2})
    proc = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir / "metrics.jsonl")) < 2:
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    steps = len(read_metrics(run_dir / "metrics.jsonl"))
    assert f"stopped at step {steps} (checkpoint saved)" in err
    assert _latest(run_dir) == steps < 200
    assert json.loads(out.strip().splitlines()[-1])["stopped"] is True
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(steps))
    # (resuming after a graceful stop: test_faults.py's SIGTERM test)


def test_eval_greedy_accuracy_matches_transformers_generate(tmp_path, sft_model):
    """`eval`'s greedy accuracy equals what HF transformers' own greedy generate scores on the
    same held-out problems (the task's exact-match rule applied to its output)."""
    import torch
    import transformers

    from entr_megatron.tasks import ArithmeticTask, load_tokenizer

    config, _ = rl_config(tmp_path, sft_model, "eval")
    out = json.loads(cli("eval", "--config", str(config), "--model", str(sft_model), "--n", "24")
                     .stdout.strip().splitlines()[-1])
    tok = load_tokenizer(str(sft_model))
    task = ArithmeticTask(1, ("+",), tokenizer=tok, format_reward=0.2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(sft_model)).eval()
    correct = 0
    for ids, ref in task.prompts("test", 24, seed=0):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        response = gen[0, len(ids):].tolist()
        ended = tok.eos_token_id in response
        text = tok.decode(response[:response.index(tok.eos_token_id)] if ended else response, skip_special_tokens=True)
        correct += ended and text.strip() == ref
    assert out["eval/num_problems"] == 24 and 0 < correct < 24, correct  # a comparison that can tell
    assert out["eval/accuracy"] == correct / 24
    assert 0.0 <= out["eval/sampled_accuracy"] <= 1.0


def _deterministic_fields(row: dict) -> dict:
    """A metrics row without what depends on the clock (times, rates, wall-clock stamps)."""
    clock = ("timing/", "throughput/", "time", "_s", "per_s", "/wall")
    return {k: v for k, v in row.items() if not any(part in k for part in clock)}


def test_fixed_lag_is_reproducible_and_carries_the_prescribed_versions(tmp_path, sft_model):
    """controller.mode fixed_lag (K=2, J=1, a switch after every decoded token's first): two runs
    of the same config write the same metrics.jsonl (timing aside), although the engine of the
    second kills itself (SIGKILL) when it is first asked to generate at version 2, while it
    generates ahead after step 1 (utils/faults.py: deterministic, no polling race), and is
    replaced (the segments it was generating are generated again with the same seeds:
    controller/rl/replacing.py); and every step's policy lag lies in [K, K + J] once v >= K + J
    (clamped at version 0 before)."""
    K, J = 2, 1
    jobs = []
    for name in ("a", "b"):  # at the same time: neither may depend on the other's timing
        config, run_dir = rl_config(tmp_path, sft_model, name, rollout={"dtype": "bfloat16"}, controller={
            "mode": "fixed_lag", "inter_lag": K, "intra_lag": J, "intra_lag_stride": 1, "train_steps": 5})
        env = dict(os.environ)
        if name == "b":
            (tmp_path / "faults-b").mkdir()
            env.update({FAULT_ENV: "engine@2:generate", FAULT_DIR_ENV: str(tmp_path / "faults-b")})
        log = (tmp_path / f"{name}.log").open("w")
        jobs.append((subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                                      stdout=subprocess.DEVNULL, stderr=log, text=True, env=env), run_dir))
    for job, run_dir in jobs:
        assert job.wait(timeout=600) == 0, (tmp_path / f"{run_dir.name}.log").read_text()[-4000:]
    assert (tmp_path / "faults-b" / "fault-0").exists(), "the engine's fault never fired"
    a, b = (read_metrics(run_dir / "metrics.jsonl") for _, run_dir in jobs)
    assert [r["step"] for r in a] == list(range(5))
    assert b[-1]["engines/restarts"] == 1 and a[-1]["engines/restarts"] == 0
    def comparable(rows):
        return [{k: v for k, v in _deterministic_fields(r).items() if k != "engines/restarts"} for r in rows]

    assert comparable(a) == comparable(b)
    for r in a:
        v = r["policy_version"]
        assert r["policy_lag/max"] == min(v, K + J) and r["policy_lag/min"] == max(0, min(v, K)), r
    assert any(r["optim/grad_norm"] > 0 for r in a)
    assert "generated again (same seeds)" in (tmp_path / "b.log").read_text()


def test_sft_expected_accuracy_matches_transformers_and_the_target_stops_it(tmp_path, sft_model):
    """The warm-up's held-out expected accuracy (mean p(reference | prompt), teacher forced on the
    Megatron learner) equals HF transformers' own forward on the exported model; with
    sft.target_accuracy the warm-up stops at the first check that reaches it."""
    import torch
    from transformers import AutoModelForCausalLM

    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.job.model_init import build_task, tokenizer_for

    rows = read_metrics(sft_model.parent / "metrics.jsonl")
    checked = [r for r in rows if "sft/expected_accuracy" in r]
    assert [r["step"] for r in checked] == [9, 19, 29]  # sft.eval_interval 10 of 30 steps
    cfg = load_config(write_config(tmp_path / "c.yaml", base_config(tmp_path, sft={"steps": 30})))
    examples = build_task(cfg, tokenizer_for(cfg)).sft_examples("test", cfg.sft.eval_size, seed=cfg.controller.seed)
    model = AutoModelForCausalLM.from_pretrained(sft_model, torch_dtype=torch.float64).eval()
    probs = []
    with torch.no_grad():
        for prompt, target in examples:
            ids = torch.tensor([prompt + target])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            probs.append(math.exp(sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(target))))
    reference = sum(probs) / len(probs)
    assert checked[-1]["sft/expected_accuracy"] == pytest.approx(reference, rel=1e-3, abs=1e-6)

    target = checked[0]["sft/expected_accuracy"] * 0.5 + 1e-6  # reached at the first check
    config = write_config(tmp_path / "t.yaml", base_config(tmp_path / "t", sft={
        "steps": 30, "lr": 3.0e-3, "batch_size": 32, "target_accuracy": target}))
    proc = cli("sft", "--config", str(config))
    stopped = read_metrics(tmp_path / "t" / "sft" / "metrics.jsonl")
    assert len(stopped) == 10 and stopped[-1]["sft/expected_accuracy"] >= target
    assert "reached sft.target_accuracy" in proc.stderr

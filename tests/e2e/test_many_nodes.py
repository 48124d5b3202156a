"""`entr-megatron train` on a Ray cluster of several nodes, each on its own loopback address.

One cluster for the module (`utils.ray_nodes.LoopbackCluster`): the head 127.0.0.2 (no CPUs: the
controller, i.e. the `train` process, only), node a 127.0.0.3 offering {learner: 2}, nodes b
127.0.0.4 and c 127.0.0.5 offering {engine: 2} each. The job asks for those resources
(launcher.ray_learner_resources / ray_engine_resources): its TP 2 learner ranks land on a, its two
engines on b and c (spread). Checked on the processes themselves, not only on what the job says:
every socket our processes listen on is their own node's address (Ray's own core-worker server
is the one exception, Ray's), the weights reach engines on other nodes (sync: the engines sample
from the learner's weights at every step), and the job survives node c's death (its engine
replaced on b, every step once, the lag bound kept), while node a's death ends the job with a
message naming the node, and the same command resumes from the last checkpoint once a is back.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from entr_megatron.utils.run_log import read_metrics
from test_train import assert_lag_bound, base_config, cli

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from entr_megatron.utils.ray_nodes import LoopbackCluster, RayNode, loopback_aliases_work  # noqa: E402

HEAD, A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
NODES = [RayNode("head", HEAD, cpus=0), RayNode("a", A, cpus=2, resources={"learner": 2}),
         RayNode("b", B, cpus=2, resources={"engine": 2}), RayNode("c", C, cpus=2, resources={"engine": 2})]
WILDCARD = ("0.0.0.0", "::")


@pytest.fixture(scope="module")
def cluster():
    if not loopback_aliases_work(HEAD):
        pytest.skip(f"this machine cannot listen on {HEAD} (only Linux routes all of 127.0.0.0/8 to loopback)")
    with LoopbackCluster(NODES) as c:
        yield c


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    """The tiny model after a short warm-up (local, one process): rewards vary within groups, so
    the learner's weights move at every step and a push that did not arrive would show."""
    root = tmp_path_factory.mktemp("sft")
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump(base_config(root, sft={"steps": 30, "lr": 3.0e-3, "batch_size": 32})))
    cli("sft", "--config", str(config))
    return root / "sft" / "model"


def job_config(tmp: Path, cluster: LoopbackCluster, sft_model: Path, name: str, **controller) -> tuple[Path, Path]:
    run_dir = tmp / name
    cfg = base_config(run_dir, parallel={"tp": 2},
                      launcher={"kind": "ray", "ray_address": cluster.address, "nproc_per_node": 2,
                                "cpu_threads_per_rank": 1, "ray_learner_resources": {"learner": 1},
                                "ray_engine_resources": {"engine": 1}},
                      rollout={"num_engines": 2, "prompts_per_step": 4, "sampling": {"max_new_tokens": 6, "n": 4},
                               "embedded": {"num_threads": 1, "max_batch_size": 32}},
                      controller={"max_policy_lag": 2, **controller})
    cfg["model"] = {**cfg["model"], "path": str(sft_model), "architecture": None}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def start(cluster: LoopbackCluster, config: Path, log: Path) -> subprocess.Popen:
    """`train` as a user runs it on the head (with the cluster's token in its environment)."""
    with log.open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **cluster.driver_env})


def finish(job: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The job's stdout once it ended; a job still running after `timeout_s` is asked for its
    threads' stacks (SIGUSR1: cli/main.py), killed, and the test fails with its log's tail."""
    try:
        return job.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        job.send_signal(signal.SIGUSR1)
        time.sleep(3)
        job.kill()
        job.communicate()
        pytest.fail(f"the job did not end within {timeout_s:.0f} s; its log's tail, with its threads' stacks:\n"
                    f"{log.read_text()[-12000:]}")


def listeners(cluster: LoopbackCluster) -> dict[int, tuple[str, str, set]]:
    """pid -> (node, process name (ps's), {(ip, port) it listens on}) of every process of every node."""
    out = {}
    for node in cluster.nodes:
        for pid in cluster.pids(node):
            try:
                p = psutil.Process(pid)
                socks = {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
                         for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
                out[pid] = (node, p.name(), socks)
            except psutil.Error:
                continue
    return out


def test_sync_run_places_the_learner_and_engines_on_their_nodes_and_pushes_across_nodes(tmp_path, cluster, sft_model):
    config, run_dir = job_config(tmp_path, cluster, sft_model, "sync", mode="sync", train_steps=4)
    log = tmp_path / "sync.err"
    job = start(cluster, config, log)
    # pid -> (node, {process name: the sockets seen under it}). Kept by name: a Ray worker's title
    # changes with the method it runs ("ray::IDLE", "ray::_RayRank.start", "ray::_RayRank"), and a child caught
    # between fork and exec still holds its parent's sockets (a Ray worker's server on every
    # interface) under the parent's name, not the one it gives itself after
    by_name: dict[int, tuple[str, dict[str, set]]] = {}
    while job.poll() is None:  # what listens where, sampled while the job runs
        for pid, (node, name, socks) in listeners(cluster).items():
            by_name.setdefault(pid, (node, {}))[1].setdefault(name, set()).update(socks)
        time.sleep(0.3)
    seen = {pid: (node, "|".join(names), set().union(*names.values())) for pid, (node, names) in by_name.items()}
    out = job.stdout.read()
    text = log.read_text()
    assert job.returncode == 0, text[-6000:]

    # placement: both ranks on a, the engines one on b and one on c, the controller on the head
    m = re.search(r"learner ranks \(rl\): rank 0 pid (\d+) on (\S+), rank 1 pid (\d+) on (\S+); "
                  r"rendezvous (\S+):(\d+); the controller on (\S+)", text)
    assert m, text[-4000:]
    rank_pids = {int(m[1]), int(m[3])}
    assert (m[2], m[4], m[5], m[7]) == (A, A, A, HEAD)
    rendezvous = (A, int(m[6]))
    engines = re.search(r"engines: 0 pid (\d+) on (\S+), 1 pid (\d+) on (\S+)", text)
    assert engines and {engines[2], engines[4]} == {B, C}, text[-4000:]
    meet = re.search(r"weight groups meet at (\S+):(\d+)", text)
    assert meet and meet[1] == A, text[-4000:]

    # what listens: ours on the node's own address only; Ray's core-worker server in each actor
    # process is Ray's (every interface), one per actor process, and the only exception
    nodes = {n.name: n.address for n in NODES}
    by_pid = {pid: seen[pid] for pid in rank_pids}
    assert all(node == "a" for node, _, _ in by_pid.values()), by_pid
    rank0 = next(pid for pid in rank_pids if pid == int(m[1]))
    assert rendezvous in seen[rank0][2], seen[rank0]  # the rendezvous store, on a only
    assert (A, int(meet[2])) in seen[rank0][2], seen[rank0]  # the weight group's store, on a only
    engine_procs = {pid: (node, "entr-engine", names["entr-engine"])  # (utils.spawn.name_process)
                    for pid, (node, names) in by_name.items() if "entr-engine" in names}
    assert sorted(node for node, _, _ in engine_procs.values()) == ["b", "c"], seen
    for pid, (node, name, socks) in {**by_pid, **engine_procs}.items():
        ours = {s for s in socks if s[0] not in WILDCARD}
        assert ours and all(ip == nodes[node] for ip, _ in ours), (node, name, socks)
        assert len(socks - ours) <= 1, (node, name, socks)  # Ray's core worker (actors only)
    for pid, (node, name, socks) in engine_procs.items():  # the engine process is ours alone: no Ray server
        assert not socks - {s for s in socks if s[0] == nodes[node]}, (node, name, socks)

    # the pushes crossed nodes: the engines sample from the learner's weights at every step, which moved
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert_lag_bound(rows, 0)
    assert any(r["optim/grad_norm"] > 0 for r in rows), "a test without learning proves nothing"
    assert all(r["mismatch/k3"] < 1e-4 for r in rows), [r["mismatch/k3"] for r in rows]
    assert rows[-1]["weight_sync/version"] >= 3 and all(r["weight_sync/transfer_s"] > 0 for r in rows[1:])
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 4



def rows_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def latest_checkpoint(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def test_fully_async_run_survives_the_death_of_an_engine_node(tmp_path, cluster, sft_model):
    """Node c (an engine's) SIGKILLed whole after the third step: its engine is replaced on b, the
    node that lives; every step is trained once, within the lag bound, and the run ends as usual."""
    steps, bound = 12, 2
    config, run_dir = job_config(tmp_path, cluster, sft_model, "async", mode="fully_async", train_steps=steps,
                                 max_policy_lag=bound)
    log = tmp_path / "async.err"
    job = start(cluster, config, log)
    killed_at = None
    try:
        deadline = time.monotonic() + 600
        while job.poll() is None and killed_at is None:
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            if len(rows_of(run_dir)) >= 3:  # mid-run: the weight groups joined, pushes under way
                cluster.kill("c")  # raylet, agents, the engine's actor and its engine process: all at once
                killed_at = time.monotonic()
            time.sleep(0.1)
        out = finish(job, log, 600)
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert killed_at is not None, f"the run ended before node c could be killed\n{text[-4000:]}"
    assert job.returncode == 0, text[-6000:]
    on_c = re.search(r"engines: .*?(\d) pid \d+ on " + re.escape(C), text)
    assert on_c, text[-4000:]
    index = on_c[1]
    assert f"embedded engine {index} failed (" in text, text[-4000:]
    assert re.search(rf"embedded engine {index} replaced: pid \d+ on {re.escape(B)}", text), text[-4000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(steps)), "every step exactly once"
    assert_lag_bound(rows, bound)
    assert rows[0]["engines/restarts"] == 0 and rows[-1]["engines/restarts"] == 1
    assert max(r.get("weight_sync/version", 0) for r in rows) >= steps - 1  # the engines kept up to the end
    assert json.loads(out.strip().splitlines()[-1])["steps"] == steps


def test_the_learner_nodes_death_ends_the_run_naming_it_and_the_same_command_resumes(tmp_path, cluster, sft_model):
    """Node a (both learner ranks) SIGKILLed whole after a checkpoint: the job ends (exit 1) with one
    message naming the node; with a back, the same command resumes from the last checkpoint and
    finishes, every step written once."""
    steps = 6
    config, run_dir = job_config(tmp_path, cluster, sft_model, "learner", mode="sync", train_steps=steps,
                                 checkpoint_interval=2)
    log = tmp_path / "learner.err"
    job = start(cluster, config, log)
    try:
        deadline = time.monotonic() + 600
        while job.poll() is None and (latest_checkpoint(run_dir) or 0) < 2:
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        assert job.poll() is None, f"the run ended before node a could be killed\n{log.read_text()[-4000:]}"
        cluster.kill("a")
        t0 = time.monotonic()
        finish(job, log, 300)
        ended_s = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert job.returncode == 1, text[-6000:]
    assert re.search(rf"learner rank \d (failed in|died during) .*: its node {re.escape(A)} left the Ray cluster", text), \
        text[-4000:]
    assert "run the same command: it resumes from the last checkpoint" in text, text[-4000:]
    assert "Traceback" not in text.split("left the Ray cluster")[-1], text[-4000:]  # one message, no traceback
    saved = latest_checkpoint(run_dir)
    assert saved is not None and saved < steps

    cluster.restart("a")
    log = tmp_path / "learner-resumed.err"
    job = start(cluster, config, log)
    finish(job, log, 600)
    text = log.read_text()
    assert job.returncode == 0, text[-6000:]
    assert f"resumed from step {saved} (" in text, text[-4000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(steps)), "resumed metrics continue, every step once"
    assert_lag_bound(rows, 0)
    print(f"\nnode a killed after the step-{saved} checkpoint: the job ended {ended_s:.1f} s later; resumed there")

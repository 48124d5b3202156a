"""examples/slurm/train_ray.sbatch on a real SLURM: three nodes of one machine on loopback addresses
(examples/slurm/local_slurm.sh: slurmctld, one slurmd per node, a munge daemon of its own).

The job starts Ray across its allocation (the head on n1 127.0.0.2 runs the controller only, n2
127.0.0.3 the learner ranks, n3 127.0.0.4 the engine) and runs `entr-megatron train`; checked on
what it leaves: the job's exit status, where each part ran, the metrics, and no Ray process of the
job left after it. Needs root (the daemons run as SlurmUser=root) and Debian's slurm-wlm and munge,
which the fixture installs with apt-get when they are missing; it skips, saying why, where either
cannot be had.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from entr_megatron.utils.run_log import read_metrics
from entr_megatron.utils.ray_nodes import port_above_ray_workers
from test_train import base_config, cli

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "slurm"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a local SLURM needs root (its daemons run as SlurmUser=root)")
    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        got = subprocess.run(["bash", str(SCRIPTS / "local_slurm.sh"), "install"], capture_output=True, text=True,
                             timeout=900)
        if got.returncode:
            pytest.skip(f"SLURM is not installed and could not be: {got.stderr.strip()[-500:]}")
    root = Path(tmp_path_factory.mktemp("slurm"))
    started = subprocess.run(["bash", str(SCRIPTS / "local_slurm.sh"), "start", str(root / "cluster"), "3", "2"],
                             capture_output=True, text=True, timeout=180)
    try:
        if started.returncode:
            pytest.skip(f"a local SLURM did not start here: {started.stderr.strip()[-800:]}")
        yield {**os.environ, "SLURM_CONF": str(root / "cluster" / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SCRIPTS / "local_slurm.sh"), "stop", str(root / "cluster")], timeout=60)


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump(base_config(root, sft={"steps": 30, "lr": 3.0e-3, "batch_size": 32})))
    cli("sft", "--config", str(config))
    return root / "sft" / "model"


def test_the_sbatch_script_starts_ray_across_the_allocation_and_trains(tmp_path, slurm, sft_model):
    run_dir = tmp_path / "run"
    cfg = base_config(run_dir, parallel={"tp": 2}, launcher={"nproc_per_node": 2, "cpu_threads_per_rank": 1},
                      rollout={"num_engines": 1, "prompts_per_step": 4, "sampling": {"max_new_tokens": 6, "n": 4},
                               "embedded": {"num_threads": 1, "max_batch_size": 32}},
                      controller={"mode": "sync", "train_steps": 4, "max_policy_lag": 1})
    cfg["model"] = {**cfg["model"], "path": str(sft_model), "architecture": None}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg))
    ray_tmp = Path(tempfile.mkdtemp(prefix="entr-ray-", dir="/tmp"))  # Ray's socket paths: at most 107 bytes
    env = {**slurm, "ENTR_BIN": str(Path(sys.executable).parent), "ENTR_CPUS_PER_NODE": "2",
           "ENTR_RAY_TMP": str(ray_tmp), "ENTR_RAY_PORT": str(port_above_ray_workers("127.0.0.2"))}
    job = subprocess.run(["sbatch", "--wait", "--nodes=3", f"--output={tmp_path}/job-%j.out", "--chdir", str(tmp_path),
                          str(SCRIPTS / "train_ray.sbatch"), str(config), "--max-steps", "4"],
                         capture_output=True, text=True, env=env, timeout=900)
    [out] = tmp_path.glob("job-*.out")
    text = out.read_text(errors="replace")
    assert job.returncode == 0, f"{job.stderr}\n{text[-6000:]}"
    assert "train_ray.sbatch: 3 Ray nodes: 127.0.0.2, 127.0.0.3, 127.0.0.4" in text, text[-4000:]
    assert "train_ray.sbatch: node n1 (head) on 127.0.0.2" in text and "node n2 (learner) on 127.0.0.3" in text \
        and "node n3 (engine) on 127.0.0.4" in text, text[-4000:]
    assert re.search(r"rank 0 pid \d+ on 127\.0\.0\.3, rank 1 pid \d+ on 127\.0\.0\.3; rendezvous 127\.0\.0\.3:\d+; "
                     r"the controller on 127\.0\.0\.2", text), text[-4000:]
    assert re.search(r"engines: 0 pid \d+ on 127\.0\.0\.4", text), text[-4000:]
    assert "entr-megatron train exited with status 0" in text
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(r["policy_lag/max"] == 0 for r in rows)
    assert any(r["optim/grad_norm"] > 0 for r in rows)
    left = subprocess.run(["pgrep", "-f", "--", f"--temp-dir={ray_tmp}"], capture_output=True, text=True).stdout.split()
    assert not left, f"Ray processes of the job outlived it: {left}"
    shutil.rmtree(ray_tmp, ignore_errors=True)

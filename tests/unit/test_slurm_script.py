"""examples/slurm/train_ray.sbatch's checks that need no SLURM (its run on a SLURM: tests/e2e/test_slurm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train_ray.sbatch"


def run_script(tmp_path, port: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("{}\n")
    bin_dir = tmp_path / "bin"  # the three tools the script checks for, as stand-ins
    bin_dir.mkdir(exist_ok=True)
    for tool in ("entr-megatron", "ray", "python"):
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(ENTR_BIN=str(bin_dir), ENTR_RAY_PORT=port)
    return subprocess.run(["bash", str(SCRIPT), str(cfg)], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("port", ["15809", "10002", "19999", "0", "70000", "http"])
def test_a_head_port_ray_cannot_take_is_refused_before_anything_starts(tmp_path, port):
    # 10002-19999: ray start's own worker ports; a GCS port there made `ray start --head` fail
    got = run_script(tmp_path, port)
    assert got.returncode == 2, got
    assert f"ENTR_RAY_PORT={port} is not a port the head can use" in got.stderr and "10002-19999" in got.stderr


@pytest.mark.parametrize("port", ["6379", "10001", "20000"])
def test_a_usable_head_port_passes_the_check(tmp_path, port):
    got = run_script(tmp_path, port)  # then it stops for want of a SLURM allocation
    assert "is not a port the head can use" not in got.stderr, got.stderr
    assert got.returncode != 0

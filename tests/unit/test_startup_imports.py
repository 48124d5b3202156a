"""What `train` pays before its learner ranks and engines start: asking whether model.path is a
learner checkpoint must not import Megatron (3-4 s on the CPU machine, on the start-up's critical
path: the driver spawns the ranks only after it), and the answer is the same as before it moved
to checkpoint.directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from entr_megatron.checkpoint.directory import LATEST_FILE, is_learner_checkpoint, learner_checkpoint_roots

ROOT = Path(__file__).resolve().parents[2]


def test_learner_checkpoint_roots_by_layout(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    root = tmp_path / "root"
    (root / "iter_0000002").mkdir(parents=True)
    latest_only = tmp_path / "latest_only"
    latest_only.mkdir()
    (latest_only / LATEST_FILE).write_text("7")
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000004").mkdir(parents=True)
    assert not is_learner_checkpoint(hf) and learner_checkpoint_roots(hf) == []
    assert not is_learner_checkpoint(tmp_path / "missing") and not is_learner_checkpoint(hf / "config.json")
    assert learner_checkpoint_roots(root) == [(root, None)] and is_learner_checkpoint(root)
    assert learner_checkpoint_roots(latest_only) == [(latest_only, None)]
    assert learner_checkpoint_roots(run) == [(run / "checkpoints", run)] and is_learner_checkpoint(run)


def test_an_hf_model_path_is_recognised_without_importing_megatron(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    code = f"""
import sys
from entr_megatron.config.loader import load_config
from entr_megatron.controller.job.model_init import from_learner_checkpoint
cfg = load_config({str(ROOT / 'examples' / 'cpu_demo.yaml')!r}, ["model.path={hf}", "model.architecture=null", "sft=null"])
assert from_learner_checkpoint(cfg, {str(tmp_path / 'run')!r}) is cfg
print(sorted(m for m in sys.modules if m.split(".")[0] == "megatron"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]

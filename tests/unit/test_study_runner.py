"""`study run` under bad conditions (issue 33): one runner per study directory (a second exits 2
naming the first), a failed cell recorded with its error message (not a cut traceback), a cell
stopped while starting labelled interrupted (not failed), and a report of a partly run study
listing the cells never run as pending. Cells are replaced by functions (no train processes);
the lock is held by a real second process."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml

from entr_megatron.study import runner
from entr_megatron.study.cell_log import cell_error
from entr_megatron.study.report import load_cells, write_report
from entr_megatron.study.spec import load_spec

BASE = {"controller": {"mode": "fixed_lag", "train_steps": 3}, "rollout": {"sampling": {"max_new_tokens": 8}}}
TAUS = [0.5, 1.0, 2.0]


def _spec(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "grid": {"algorithm.tau": TAUS}}))
    return load_spec(tmp_path / "spec.yaml")


def _states(out: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "status.json").read_text()) for d in (out / "cells").iterdir()}


# ---- the study lock ----------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from entr_megatron.utils.run_lock import RunLock
    lock = RunLock(sys.argv[1], command="study run", flag="--out").acquire()
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


def test_a_second_runner_on_the_same_out_exits_2_naming_the_first(tmp_path, monkeypatch, capsys):
    spec, out = _spec(tmp_path), tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        ran = []
        monkeypatch.setattr(runner, "_cell_attempt", lambda d: ran.append(d) or {"returncode": 0, "wall_s": 0.1})
        with pytest.raises(runner.StudyLockedError) as e:
            runner.run_study(spec, out)
        message = str(e.value)
        assert f"{out} is in use by another study run: pid {holder.pid} on {socket.gethostname()} " \
               "(command: study run, since " in message and message.endswith("or use another --out")
        assert ran == [] and not (out / "cells").exists() and not (out / "study.json").exists()  # nothing touched

        from entr_megatron.cli import study as study_cli

        parser = argparse.ArgumentParser()
        study_cli.add_parser(parser.add_subparsers())
        args = parser.parse_args(["study", "run", str(tmp_path / "spec.yaml"), "--out", str(out)])
        with pytest.raises(SystemExit) as code:
            args.func(args)
        err = capsys.readouterr().err
        assert code.value.code == 2 and f"pid {holder.pid}" in err and "Traceback" not in err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the first runner gone, the study runs (and its lock is released after it)
    result = runner.run_study(spec, out)
    assert len(result["done"]) == len(TAUS) and len(ran) == len(TAUS)
    assert runner.run_study(spec, out)["skipped"] == result["done"]


# ---- a failed cell's error ---------------------------------------------------------------------

FRAMES = """Traceback (most recent call last):
  File "/x/entr_megatron/cli/main.py", line 40, in main
    args.func(args)
  File "/x/entr_megatron/checkpoint/hf_files.py", line 88, in read_header
    raise ValueError(f"{path}: truncated")
"""


def test_cell_error_is_the_message_of_the_last_attempt():
    first = "===== 2026-01-01 10:00:00 entr-megatron train --config c.yaml\nentr-megatron train: old problem\n"
    last = ("===== 2026-01-01 11:00:00 entr-megatron train --config c.yaml\n[train] step 0\n"
            + FRAMES + "ValueError: /m/model.safetensors: truncated\n  (expected 4096 bytes, found 100)\n")
    # by hand: the exception's lines after the frames (a message's own lines, indented or not), of
    # the last attempt only; the frames and the progress lines are not the message
    assert cell_error(first + last, 1) == ("exit 1: ValueError: /m/model.safetensors: truncated\n"
                                           "  (expected 4096 bytes, found 100)")
    multi = "===== t\n" + FRAMES + "ValueError: two problems:\nmodel.path has no tokenizer.json\n\nshutdown\n"
    assert cell_error(multi, 1) == "exit 1: ValueError: two problems:\nmodel.path has no tokenizer.json"
    chained = ("===== t\n" + FRAMES + "KeyError: 'x'\n\nDuring handling of the above exception, another exception "
               "occurred:\n\n" + FRAMES + "RuntimeError: rank 1 failed\n")
    assert cell_error(chained, 1) == "exit 1: RuntimeError: rank 1 failed"
    cli = "===== t\n[train] loading\nentr-megatron train: invalid config: rollout.sampling.n=0 is not valid\n"
    assert cell_error(cli, 2) == "exit 2: entr-megatron train: invalid config: rollout.sampling.n=0 is not valid"
    plain = "===== t\n" + "".join(f"line {i}\n" for i in range(20)) + "\n"
    assert cell_error(plain, 137) == "exit 137: " + "\n".join(f"line {i}" for i in range(8, 20))
    assert cell_error("===== t\n", -9) == "exit -9: (no output; see train.log)"
    assert len(cell_error("===== t\nentr-megatron train: " + "x" * 5000, 2)) == len("exit 2: ") + 2000 + 4


def test_a_failed_cell_records_its_error_message_not_a_traceback(tmp_path, monkeypatch):
    spec, out = _spec(tmp_path), tmp_path / "out"

    def fake_train(args, log_path, env=None):
        with open(log_path, "a") as log:  # as run_command writes it: a header, then the output
            log.write("\n===== 2026-01-01 entr-megatron train\n" + "[train] x\n" * 400 + FRAMES
                      + "ValueError: /m/model.safetensors: truncated\n  (4096 | 100 bytes)\n")
        return 1, ""

    monkeypatch.setattr(runner, "run_command", fake_train)
    result = runner.run_study(spec, out)
    assert len(result["failed"]) == len(TAUS)
    message = "exit 1: ValueError: /m/model.safetensors: truncated\n  (4096 | 100 bytes)"
    for status in _states(out).values():
        assert status["state"] == "failed" and status["error"] == message
    # report.md's cell table: the message on the cell's one row (markdown_table folds the newline and
    # escapes the pipe)
    text = write_report(out).read_text()
    rows = [line for line in text.splitlines() if line.startswith("| tau=") and "| failed |" in line]
    assert len(rows) == 3 and all(
        r.endswith("| exit 1: ValueError: /m/model.safetensors: truncated   (4096 \\| 100 bytes) |") for r in rows)


def test_per_seed_warmups_run_once_each_and_feed_their_seed_s_cells(tmp_path, monkeypatch):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**BASE, "sft": {"steps": 2}}))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "grid": {"algorithm.tau": [1.0]},
                                                        "seeds": [0, 4], "warmup": {"per_seed": True}}))
    spec, out, warmed, cells = load_spec(tmp_path / "spec.yaml"), tmp_path / "out", [], []

    def fake(args, log_path, env=None):  # `sft` writes the run's model; `train` is the cell
        run_dir = Path(args[args.index("--run-dir") + 1])
        if args[0] == "sft":
            warmed.append(yaml.safe_load((run_dir / "warmup.yaml").read_text())["controller"]["seed"])
            (run_dir / "sft" / "model").mkdir(parents=True)
            (run_dir / "sft" / "model" / "config.json").write_text("{}")
        else:
            cells.append(yaml.safe_load((run_dir / "cell.yaml").read_text())["model"]["path"])
        return 0, ""

    monkeypatch.setattr(runner, "run_command", fake)
    runner.run_study(spec, out, jobs=2)
    assert sorted(warmed) == [0, 4]
    assert sorted(cells) == [str(out / "warmup" / f"seed={s}" / "sft" / "model") for s in (0, 4)]
    runner.run_study(spec, out)  # done: neither warm-up runs again
    assert sorted(warmed) == [0, 4]


def test_warmups_only_runs_each_seed_s_warm_up_and_no_cell(tmp_path, monkeypatch):
    """`study run --warmups-only`: the warm-ups a per-seed spec needs, nothing else; the cells then
    start from them without a warm-up running again."""
    ran = []

    def fake(args, log_path, env=None):
        run_dir = Path(args[args.index("--run-dir") + 1])
        ran.append((args[0], run_dir.name))
        if args[0] == "sft":
            (run_dir / "sft" / "model").mkdir(parents=True)
            (run_dir / "sft" / "model" / "config.json").write_text("{}")
        return 0, ""

    monkeypatch.setattr(runner, "run_command", fake)
    spec, out = _per_seed_spec(tmp_path, [0, 3]), tmp_path / "out"
    result = runner.run_study(spec, out, warmups_only=True)
    assert sorted(ran) == [("sft", "seed=0"), ("sft", "seed=3")]
    assert result["done"] == result["skipped"] == result["failed"] == []
    assert json.loads((out / "study.json").read_text())["cells"]  # the report lists the cells as pending
    runner.run_study(spec, out)
    assert sorted(name for what, name in ran if what == "sft") == ["seed=0", "seed=3"]
    assert sum(what == "train" for what, _ in ran) == 2


def _per_seed_spec(tmp_path, seeds, sft_steps=2):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**BASE, "sft": {"steps": sft_steps}}))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "grid": {"algorithm.tau": [1.0]},
                                                        "seeds": seeds, "warmup": {"per_seed": True}}))
    return load_spec(tmp_path / "spec.yaml")


def test_a_warm_up_made_with_another_config_is_refused_naming_the_field(tmp_path, monkeypatch):
    """A study directory whose warm-up was made before the spec changed (here sft.steps 2 -> 5): its
    model would be taken for the new spec's. Refused before anything runs, naming the field."""
    ran = []

    def fake(args, log_path, env=None):
        run_dir = Path(args[args.index("--run-dir") + 1])
        ran.append(args[0])
        if args[0] == "sft":
            (run_dir / "sft" / "model").mkdir(parents=True)
            (run_dir / "sft" / "model" / "config.json").write_text("{}")
        return 0, ""

    monkeypatch.setattr(runner, "run_command", fake)
    out = tmp_path / "out"
    runner.run_study(_per_seed_spec(tmp_path, [0, 1]), out)
    assert ran == ["sft", "sft", "train", "train"]
    changed = _per_seed_spec(tmp_path, [0, 1], sft_steps=5)
    with pytest.raises(runner.SpecError, match=r"seed 0's warm-up in .*seed=0 was made with another config "
                                               r"\(sft\.steps: 2 there, 5 in the spec\)"):
        runner.run_study(changed, out)
    assert ran == ["sft", "sft", "train", "train"]  # nothing ran
    # a partial warm-up (its warmup.yaml written, no model yet) of another config is refused too
    (out / "warmup" / "seed=1" / "sft" / "model" / "config.json").unlink()
    with pytest.raises(runner.SpecError, match="seed 0's warm-up"):
        runner.run_study(changed, out)
    assert ran == ["sft", "sft", "train", "train"]


def test_a_failed_or_stopped_warm_up_starts_no_other(tmp_path, monkeypatch):
    """Three seeds' warm-ups, one at a time. The first fails: WarmupError naming its log, and neither
    other starts. Then a SIGTERM reaches the study during the first: WarmupStopped, none other
    starts, and the same command runs all three."""
    spec, out, started = _per_seed_spec(tmp_path, [0, 1, 2]), tmp_path / "out", []

    def failing(args, log_path, env=None):
        started.append(args[0])
        return 1, ""

    monkeypatch.setattr(runner, "run_command", failing)
    with pytest.raises(runner.WarmupError, match=r"seed 0's warm-up failed \(exit 1\); see .*seed=0/sft\.log"):
        runner.run_study(spec, out, jobs=1)
    assert started == ["sft"]

    handled = threading.Event()
    original = runner.StopRequest._handle

    def handle(self, signum, frame):  # the stop is seen by the study before the warm-up returns
        original(self, signum, frame)
        handled.set()

    def stopped(args, log_path, env=None):
        started.append(args[0])
        os.kill(os.getpid(), signal.SIGTERM)
        assert handled.wait(10)
        return 130, ""

    monkeypatch.setattr(runner.StopRequest, "_handle", handle)
    monkeypatch.setattr(runner, "run_command", stopped)
    started.clear()
    with pytest.raises(runner.WarmupStopped, match="seed 0's warm-up stopped"):
        runner.run_study(spec, out, jobs=1)
    assert started == ["sft"]
    assert signal.getsignal(signal.SIGTERM) is not handle  # the study's handlers are gone again

    def fine(args, log_path, env=None):
        run_dir = Path(args[args.index("--run-dir") + 1])
        started.append(args[0])
        if args[0] == "sft":
            (run_dir / "sft" / "model").mkdir(parents=True, exist_ok=True)
            (run_dir / "sft" / "model" / "config.json").write_text("{}")
        return 0, ""

    monkeypatch.setattr(runner, "run_command", fine)
    started.clear()
    assert len(runner.run_study(spec, out, jobs=1)["done"]) == 3
    assert started == ["sft"] * 3 + ["train"] * 3


# ---- interrupted cells -------------------------------------------------------------------------


def test_a_cell_interrupted_while_starting_is_interrupted_not_failed(tmp_path, monkeypatch):
    """Cell 1: Ctrl-C reached it during start-up (entr-megatron exits 130, no checkpoint); cell 2: the
    study got a SIGTERM while the cell started and the cell died of it (exit 1); cell 3 never starts."""
    spec, out = _spec(tmp_path), tmp_path / "out"
    calls = []

    def attempt(cell_dir):
        calls.append(cell_dir)
        if len(calls) == 1:
            return {"returncode": 130, "wall_s": 0.1, "error": "exit 130: entr-megatron train: interrupted"}
        os.kill(os.getpid(), signal.SIGTERM)
        return {"returncode": 1, "wall_s": 0.1, "error": "exit 1: KeyboardInterrupt"}

    monkeypatch.setattr(runner, "_cell_attempt", attempt)
    result = runner.run_study(spec, out)
    states = _states(out)
    assert len(calls) == 2 and result["interrupted"] and result["failed"] == [] and result["done"] == []
    assert sorted(s["state"] for s in states.values()) == ["interrupted", "interrupted", "pending"]
    assert all(s["error"] is None for s in states.values())
    again = []
    monkeypatch.setattr(runner, "_cell_attempt", lambda d: again.append(d) or {"returncode": 0, "wall_s": 0.1})
    assert len(runner.run_study(spec, out)["done"]) == 3 and len(again) == 3  # interrupted ones run again
    assert 130 in runner.INTERRUPTED_CODES and -signal.SIGINT in runner.INTERRUPTED_CODES
    # a cell failing on its own, with no stop, is still failed
    monkeypatch.setattr(runner, "_cell_attempt", lambda d: {"returncode": 1, "wall_s": 0.1, "error": "exit 1: boom"})
    failed = runner.run_study(spec, tmp_path / "other")
    assert len(failed["failed"]) == 3 and not failed["interrupted"]
    assert {s["state"] for s in _states(tmp_path / "other").values()} == {"failed"}




# ---- a partly run study's report ---------------------------------------------------------------


def test_a_report_of_a_partly_run_study_lists_the_cells_never_run_as_pending(tmp_path, monkeypatch):
    spec, out = _spec(tmp_path), tmp_path / "out"
    monkeypatch.setattr(runner, "_cell_attempt", lambda d: {"returncode": 0, "wall_s": 0.1})
    runner.run_study(spec, out, only=["tau=1.0"])  # one of three cells placed and run
    assert sorted(d.name for d in (out / "cells").iterdir()) == ["tau=1.0,seed=0"]
    cells = load_cells(out).set_index("cell")
    assert sorted(cells.index) == ["tau=0.5,seed=0", "tau=1.0,seed=0", "tau=2.0,seed=0"]
    assert cells["state"].to_dict() == {"tau=0.5,seed=0": "pending", "tau=1.0,seed=0": "done",
                                        "tau=2.0,seed=0": "pending"}
    assert cells.loc["tau=2.0,seed=0", "algorithm.tau"] == 2.0 and cells.loc["tau=2.0,seed=0", "steps"] == 0
    text = write_report(out).read_text()
    assert "3 cells (1 done, 0 failed, 0 running, 2 pending)" in text

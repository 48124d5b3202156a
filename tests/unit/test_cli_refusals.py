"""What the probe of issue 46 found at the command line, one test per kind: a value the docs allow
that crashed later (eval with task.eval_size 0), flags that contradict each other (eval --run-dir
with --model), errors that arrived as tracebacks (a failed save on a rank, a corrupt study.json,
Ctrl-C while a command imports), data dropped without a word (a metrics line that is not UTF-8),
and outputs written onto inputs (score, generate, study report, train and sft). Each is refused or
reported in one line naming the file or field, before anything starts."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers import sigint_default

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "cpu_demo.yaml"


def _cli(capsys, *argv) -> tuple[int, str]:
    """(exit status, stderr) of `entr-megatron ARGV` in this process; it must exit."""
    from entr_megatron.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    code = e.value.code
    err = capsys.readouterr().err
    return (code if isinstance(code, int) else 1), (err if isinstance(code, int) else f"{err}{code}\n")


# --- eval: a value the docs allow, flags that contradict ----------------------------------


def test_eval_with_eval_size_0_is_refused_before_the_engine_starts(tmp_path, capsys):
    code, err = _cli(capsys, "eval", "--config", str(DEMO), "--model", str(tmp_path / "model"), "task.eval_size=0")
    assert code == 2 and err.count("\n") == 1, err
    assert ("entr-megatron eval: task.eval_size=0 is not valid for eval; 0 turns off train's evaluations: "
            "pass --n N or set task.eval_size >= 1") in err, err


def test_eval_refuses_run_dir_and_model_together(tmp_path, capsys):
    code, err = _cli(capsys, "eval", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"),
                     "--model", str(tmp_path / "model"))
    assert code == 2 and err.count("\n") == 1, err
    assert ("entr-megatron eval: --run-dir and --model are exclusive: --model names the model to evaluate, "
            "--run-dir the run whose newest model is evaluated") in err, err
    assert not (tmp_path / "run").exists()


# --- errors that arrived as tracebacks ----------------------------------------------------


def test_a_failed_save_on_a_rank_reaches_the_driver_as_itself():
    """ENOSPC mid-run: the rank's CheckpointSaveError (one line, the numbers) came back as a
    WorkerError holding its traceback, which the CLI does not catch (82 lines, 4 tracebacks)."""
    from entr_megatron.checkpoint.directory import CheckpointSaveError
    from entr_megatron.controller.ranks.workers import ProcessWorkerGroup
    from workers_fixture import EchoWorker, make_echo

    group = ProcessWorkerGroup(2, make_echo, ("t",))
    try:
        with pytest.raises(CheckpointSaveError) as e:
            group.call(EchoWorker.save_fails, 7)
        assert str(e.value) == "saving the checkpoint of step 7 failed: no space left on device (ENOSPC)"
    finally:
        group.shutdown()


def test_the_cli_prints_a_failed_save_in_one_line_and_exits_1(capsys):
    from entr_megatron.checkpoint.directory import CheckpointSaveError
    from entr_megatron.cli.train import _refused

    def job():
        raise CheckpointSaveError("saving the checkpoint of step 7 into /r failed: no space left on device (ENOSPC)")

    with pytest.raises(SystemExit) as e:
        _refused("train", job)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    assert err.splitlines()[0] == ("entr-megatron train: saving the checkpoint of step 7 into /r failed: no space "
                                   "left on device (ENOSPC)")


def _study(tmp_path: pathlib.Path, study_json: str | None = None) -> pathlib.Path:
    study = tmp_path / "study"
    cell = study / "cells" / "c1"
    cell.mkdir(parents=True)
    (study / "study.json").write_text(study_json if study_json is not None else json.dumps(
        {"name": "s", "axes": ["algorithm.tau"], "cells": [{"id": "c1", "axes": {"algorithm.tau": 1.0}}]}))
    (cell / "cell.json").write_text(json.dumps({"id": "c1", "axes": {"algorithm.tau": 1.0}}))
    (cell / "status.json").write_text(json.dumps({"state": "done"}))
    (cell / "metrics.jsonl").write_bytes(b"".join(
        json.dumps({"step": s, "reward/mean": s / 10}).encode() + b"\n" for s in range(3)))
    return study


@pytest.mark.parametrize("text, problem", [
    ("{not json", "study.json: not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                  "(char 1))"),
    ("[1, 2]", "study.json: must be a JSON object with name, axes, report and cells, got list"),
    ('{"name": "s", "axes": 5}', "study.json: axes=5 is not valid; must be a list of dotted config fields"),
    ('{"name": "s", "axes": [], "report": "x"}', "study.json: report='x' is not valid; must be an object"),
    (b"\xff\xfe{}", "study.json: not UTF-8 text"),
], ids=["not-json", "a-list", "axes", "report", "not-utf8"])
def test_a_corrupt_study_json_is_one_line_naming_it(tmp_path, capsys, text, problem):
    study = _study(tmp_path)
    if isinstance(text, bytes):
        (study / "study.json").write_bytes(text)
    else:
        (study / "study.json").write_text(text)
    code, err = _cli(capsys, "study", "report", str(study))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"entr-megatron study: {study / problem}"), err


def _importing_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def test_ctrl_c_while_a_command_imports_is_one_line_exit_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "convert", "hf-to-megatron",
                             "--hf", str(tmp_path / "m"), "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 60
    while not _importing_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # until torch's library is mapped: its Python modules load for a while yet
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == ["entr-megatron convert: interrupted"], err


# --- data silently dropped ----------------------------------------------------------------


def test_a_non_utf8_metrics_line_is_named_and_the_other_lines_kept(tmp_path, caplog):
    from entr_megatron.study.results import load_results

    study = _study(tmp_path)
    metrics = study / "cells" / "c1" / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(lines[0] + b'{"step": 1, "note": "caf\xe9"}\n' + lines[2])
    with caplog.at_level(logging.WARNING):
        frame = load_results(study)
    assert list(frame["step"]) == [0, 2] and list(frame["reward/mean"]) == [0.0, 0.2]
    assert f"{metrics}:2: not UTF-8 (byte 0xe9 at column 25); line skipped" in caplog.text, caplog.text


# --- outputs onto inputs ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["score", "generate"])
def test_score_and_generate_refuse_an_output_onto_their_input(tmp_path, capsys, command):
    data = tmp_path / "in.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    model = tmp_path / "model"
    model.mkdir()
    for out, flag, src, how in [(data, "--input", data, "is"), (model / "out.jsonl", "--model", model, "is inside")]:
        code, err = _cli(capsys, command, "--model", str(model), "--input", str(data), "--output", str(out))
        assert code == 1 and err.count("\n") == 1, err  # these commands' exit status for a refused input
        assert f"--output {out} {how} the source {flag} {src}: writing it would replace" in err, err
    assert data.read_text() == '{"input_ids": [1, 2, 3]}\n' and os.listdir(model) == []


def test_study_report_refuses_an_out_among_the_studys_inputs(tmp_path, capsys):
    study = _study(tmp_path)
    before = sorted(str(p.relative_to(study)) for p in study.rglob("*"))
    for out, how in [(study, "is"), (study / "cells" / "c1", "is inside"), (tmp_path, "contains")]:
        code, err = _cli(capsys, "study", "report", str(study), "--out", str(out))
        assert code == 2 and err.count("\n") == 1, err
        assert f"--out {out} {how} the source" in err, err
    assert sorted(str(p.relative_to(study)) for p in study.rglob("*")) == before


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_run_directory_onto_the_model_it_reads_is_refused(tmp_path, capsys, command):
    run = tmp_path / "run"
    model = run / "final_model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    for run_dir, how in [(run, "contains"), (model, "is"), (model / "sub", "is inside")]:
        code, err = _cli(capsys, command, "--config", str(DEMO), "--run-dir", str(run_dir), f"model.path={model}",
                         "model.architecture=null", "model.tokenizer=null")
        assert code == 2 and err.count("\n") == 1, err
        assert f"the run directory {run_dir} {how} the source model.path {model}" in err, err
    assert sorted(p.name for p in run.rglob("*")) == ["config.json", "final_model"]

"""metrics.jsonl logging, resume truncation, TensorBoard events and the plain progress output."""

import io
import logging
import math
import re

import pytest
import torch

from entr_megatron.utils.run_log import MetricsLogger, ProgressBar, read_metrics


def test_lines_are_written_json_safe_and_read_back(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"loss": torch.tensor(0.25, dtype=torch.float64), "step": 1, "tokens": torch.tensor(12)})
        log.log({"step": torch.tensor(2), "loss": float("nan"), "kl": math.inf, "hist": torch.tensor([1.5, 2.0])})
    text = (tmp_path / "metrics.jsonl").read_text()
    # Written by hand: step first, numbers plain, NaN/inf as null.
    assert text == ('{"step":1,"loss":0.25,"tokens":12}\n'
                    '{"step":2,"loss":null,"kl":null,"hist":[1.5,2.0]}\n')
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 0.25, "tokens": 12},
        {"step": 2, "loss": None, "kl": None, "hist": [1.5, 2.0]},
    ]


def test_log_needs_an_int_step_and_plain_values(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for bad in ({"loss": 1.0}, {"step": 1.5}, {"step": True}, {"step": "3"}):
            with pytest.raises(ValueError, match="int 'step'"):
                log.log(bad)
        with pytest.raises(TypeError, match="'obj'"):
            log.log({"step": 1, "obj": object()})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_appends_to_an_existing_file_without_resume(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"step": 1, "a": 1})
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"step": 2, "a": 2})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_resume_keeps_steps_before_it_and_drops_a_partial_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":1,"a":1}\n{"step":2,"a":2}\n{"step":3,"a":3}\n{"step":4,"a"')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert "partial last line" in caplog.text
    with MetricsLogger(tmp_path, tensorboard=False, resume_from_step=3) as log:
        assert not (tmp_path / "metrics.jsonl.tmp").exists()
        assert path.read_text() == '{"step":1,"a":1}\n{"step":2,"a":2}\n'
        log.log({"step": 3, "a": 30})
    assert path.read_text() == '{"step":1,"a":1}\n{"step":2,"a":2}\n{"step":3,"a":30}\n'


def test_a_partial_line_is_repaired_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":1}\n{"ste')
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"step": 2})
    assert path.read_text() == '{"step":1}\n{"step":2}\n'


def test_a_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":1}\nnot json\n{"step":2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_tensorboard_events_are_readable(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        log.log({"step": 1, "loss": 0.5, "reward/mean": torch.tensor(0.25), "note": "x"})
        log.log({"step": 2, "loss": 0.75, "reward/mean": 0.5, "hist": [1.0, 2.0]})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "reward/mean"]  # no "step", no strings or lists
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_progress_bar_plain_lines(capsys):
    bar = ProgressBar(total=25, desc="train", log_interval=10)  # captured stderr is no terminal
    for step in range(1, 26):
        metrics = {"step": step, "reward/mean": step / 50, "throughput/tokens_per_s": 812.4}
        if step >= 20:
            metrics["policy_lag/max"] = 3
        bar.update(metrics)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3  # steps 10, 20 and the last one
    assert re.fullmatch(r"train step 10/25 \| reward 0\.20 \| 812 tok/s \| \d+\.\d s/step", lines[0])
    assert re.fullmatch(r"train step 20/25 \| reward 0\.40 \| lag max 3 \| 812 tok/s \| \d+\.\d s/step", lines[1])
    assert lines[2].startswith("train step 25/25 | reward 0.50 | lag max 3 | 812 tok/s | ")


def test_progress_bar_without_metrics_counts_and_disabled_prints_nothing(capsys):
    bar = ProgressBar(total=4, initial=2, log_interval=1)
    bar.update()
    bar.update({})
    assert bar.step == 4
    quiet = ProgressBar(total=4, enabled=False, log_interval=1)
    quiet.update({"step": 1, "reward/mean": 1.0})
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" | ")[0] for line in err] == ["train step 3/4", "train step 4/4"]


def test_progress_bar_tqdm_mode():
    stream = io.StringIO()
    with ProgressBar(total=5, use_tqdm=True, file=stream) as bar:
        bar.update({"step": 3, "reward/mean": 0.5, "policy_lag/max": 2})
    out = stream.getvalue()
    assert "3/5" in out and "reward 0.50 | lag max 2" in out


def test_missing_tensorboard_warns_once_and_logs_to_the_file(tmp_path, monkeypatch, caplog):
    import sys

    from entr_megatron.utils import run_log

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setattr(run_log, "_warned_no_tensorboard", False)
    with caplog.at_level(logging.WARNING):
        for run in ("a", "b"):
            with MetricsLogger(tmp_path / run) as log:
                log.log({"step": 1, "loss": 1.0})
    assert caplog.text.count("TensorBoard is not installed") == 1
    assert read_metrics(tmp_path / "b") == [{"step": 1, "loss": 1.0}]
    assert not (tmp_path / "a" / "tensorboard").exists()

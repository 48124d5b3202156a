"""The W&B sink in offline mode, read back from the run file W&B writes (its record log of
protobuf `Record`s): a resumed run continues the same W&B run id and group, and every record
carries its training step in "step" even when steps arrive out of order."""

from __future__ import annotations

import struct
import time

import pytest

wandb = pytest.importorskip("wandb")

from entr_megatron.config import WandbConfig  # noqa: E402
from entr_megatron.utils.run_log import MetricsLogger  # noqa: E402
from entr_megatron.utils.wandb_log import RUN_ID_FILE  # noqa: E402


def read_records(path):
    """W&B's offline file: a 7-byte header, then a LevelDB-style log (32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            out.append(record)
            pending = b""
        else:  # first, middle
            pending += chunk
    return out


def read_until_exit(path, timeout_s=30.0):
    """The file's records once W&B's writer has put its closing "exit" record on disk:
    `finish()` can return before its service flushes the file (seen on a loaded CI machine)."""
    deadline = time.monotonic() + timeout_s
    from google.protobuf.message import DecodeError

    while True:
        try:
            records = read_records(path)
        except DecodeError:  # a record half written
            records = []
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_offline_run_resumes_the_same_run_with_the_training_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = WandbConfig(project="p", group="study-x", name="cell-1", mode="offline")
    with MetricsLogger(tmp_path, tensorboard=False, wandb=cfg, config={"algorithm": {"tau": 0.5}}) as log:
        for step in (0, 2, 1):  # out of order
            log.log({"step": step, "reward/mean": step / 10})
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    with MetricsLogger(tmp_path, tensorboard=False, resume_from_step=3, wandb=cfg) as log:
        log.log({"step": 3, "reward/mean": 0.3})
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == run_id
    # W&B names a start's directory by its second and the run id, with "-1", "-2"... added when
    # a start of the same id in the same second made that one already (as here, often)
    files = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(files) == 2  # two starts, one W&B run id (wandb sync merges them)
    history, runs = [], []
    for path in files:
        for record in read_until_exit(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append((record.run.run_id, record.run.run_group, record.run.project))
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                history.append((int(items["step"]), float(items["reward/mean"])))
    assert set(runs) == {(run_id, "study-x", "p")}
    assert history == [(0, 0.0), (2, 0.2), (1, 0.1), (3, 0.3)]

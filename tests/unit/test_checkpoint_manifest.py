"""Checkpoint manifests and the run-directory lock, on plain files (no ranks).

Each damage a checkpoint can suffer (a flipped byte, a truncated, deleted or extra file, a
deleted or garbage `latest`) is made by hand and must be named; `choose_checkpoint` must then
pick the newest undamaged checkpoint, never one newer than `latest`. The manifest's digests are
checked against hashlib computed independently here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os

import pytest

from entr_megatron.checkpoint.directory import (
    COMPLETE_MARKERS,
    CheckpointError,
    CheckpointNotFoundError,
    commit,
    prepare_tmp_dir,
)
from entr_megatron.checkpoint.manifest import (
    MANIFEST_FILE,
    choose_checkpoint,
    data_files,
    digest_files,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from entr_megatron.utils.run_lock import RunLock, RunLockedError


def save(root, step, payload=b"weights"):
    """A fake checkpoint of `step` published the way save_checkpoint does (manifest last)."""
    tmp = prepare_tmp_dir(root, step)
    for name in COMPLETE_MARKERS:
        (tmp / name).write_bytes(f"{name} of {step}".encode())
    for rank in (0, 1):
        (tmp / f"__{rank}_0.distcp").write_bytes(payload * (100 + step) + bytes([rank]))
    write_manifest(tmp, step, digest_files(tmp, data_files(tmp)))
    return commit(root, step)


def test_manifest_records_every_file_with_its_sha256(tmp_path):
    path = save(tmp_path, 3)
    m = read_manifest(path)
    assert m["step"] == 3 and sorted(m["files"]) == sorted([*COMPLETE_MARKERS, "__0_0.distcp", "__1_0.distcp"])
    for name, entry in m["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert m["total_bytes"] == sum(len((path / n).read_bytes()) for n in m["files"])
    assert verify_checkpoint(path) == []


def test_commit_refuses_a_save_without_manifest(tmp_path):
    tmp = prepare_tmp_dir(tmp_path, 1)
    for name in COMPLETE_MARKERS:
        (tmp / name).write_text("x")
    with pytest.raises(CheckpointError, match="refusing to publish .*manifest.json missing"):
        commit(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"not hashed \['common.pt'\]"):
        write_manifest(tmp, 1, {n: {"size": 1, "sha256": "0"} for n in COMPLETE_MARKERS if n != "common.pt"})


def test_every_kind_of_damage_is_named(tmp_path):
    path = save(tmp_path, 1)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(path) == ["__0_0.distcp: SHA-256 differs from the manifest (damaged)"]
    assert verify_checkpoint(path, checksums=False) == []  # sizes alone cannot see a flipped byte
    shard.write_bytes(bytes(data[:-10]))
    assert verify_checkpoint(path) == [f"__0_0.distcp: {len(data) - 10} bytes, the manifest says {len(data)} "
                                       "(truncated or rewritten)"]
    shard.unlink()
    (path / "stray.bin").write_bytes(b"?")
    assert verify_checkpoint(path) == ["__0_0.distcp: missing", "stray.bin: not in the manifest"]
    (path / MANIFEST_FILE).write_text("{not json")
    assert verify_checkpoint(path)[0].startswith(f"{path / MANIFEST_FILE}: not valid JSON")


def test_a_checkpoint_without_manifest_is_checked_for_completeness_only(tmp_path, caplog):
    path = save(tmp_path, 1)
    (path / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        assert verify_checkpoint(path) == []
    assert "has no manifest.json" in caplog.text
    (path / "metadata.json").unlink()
    assert verify_checkpoint(path) == ["incomplete: metadata.json missing"]


def test_choose_falls_back_to_the_newest_good_checkpoint(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    assert choose_checkpoint(tmp_path).step == 30
    (tmp_path / "iter_0000030" / "__1_0.distcp").write_bytes(b"garbage of the same size?")
    choice = choose_checkpoint(tmp_path)
    assert choice.step == 20 and choice.skipped[0][0] == "iter_0000030"
    assert "__1_0.distcp" in choice.skipped[0][1][0]
    with pytest.raises(CheckpointError, match=r"iter_0000030 is damaged: __1_0.distcp: \d+ bytes"):
        choose_checkpoint(tmp_path, step=30)
    (tmp_path / "latest").unlink()  # deleted: never a fresh start while checkpoints exist
    choice = choose_checkpoint(tmp_path)
    assert choice.step == 20 and choice.skipped[0] == ("latest", ["missing (deleted?): choosing among the "
                                                                  "iter_* directories"])
    (tmp_path / "latest").write_text("twenty")
    choice = choose_checkpoint(tmp_path)
    assert choice.step == 20 and "expected a step number, found 'twenty'" in choice.skipped[0][1][0]
    (tmp_path / "latest").write_text("10\n")  # a rollback to 10: the abandoned 20 and 30 are not candidates
    assert choose_checkpoint(tmp_path).step == 10
    (tmp_path / "iter_0000010" / "common.pt").write_text("flipped")
    with pytest.raises(CheckpointError, match="no usable checkpoint in .*\n  iter_0000010: common.pt: "):
        choose_checkpoint(tmp_path)


def test_choose_names_what_is_missing(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        choose_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointNotFoundError, match="no 'latest' file .*an empty directory"):
        choose_checkpoint(tmp_path)
    save(tmp_path, 5)
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint for step 7 .*complete steps there: \[5\]"):
        choose_checkpoint(tmp_path, step=7)
    (tmp_path / "latest").write_text("9\n")
    choice = choose_checkpoint(tmp_path)
    assert choice.step == 5 and choice.skipped == [("iter_0000009", ["missing: 'latest' names it"])]


# --- one job per run directory ----------------------------------------------------------------

def _hold(run_dir, ready, release):
    with RunLock(run_dir, "train"):
        ready.set()
        release.wait(30)


def test_a_second_job_on_a_run_directory_is_refused_and_a_dead_holder_is_taken_over(tmp_path):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(RunLockedError, match=rf"in use by another job: pid {holder.pid} on .*command: train"):
            RunLock(tmp_path).acquire()
    finally:
        release.set()
        holder.join(30)
    with RunLock(tmp_path) as lock:  # released: free again
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    # A holder killed outright: the kernel dropped its lock; the next job takes it and knows whose it was.
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(30)
    holder.kill()
    holder.join(30)
    with RunLock(tmp_path) as lock:
        assert lock.previous["pid"] == holder.pid

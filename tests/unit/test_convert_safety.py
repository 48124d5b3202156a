"""`convert` never destroys what a user made: OUT may not be or hold a source, --overwrite deletes
nothing a conversion did not write, an interrupt leaves no temp directory (and a killed run's is
cleaned by the next), a missing tokenizer is a warning naming what `train` will need.

The command runs in this process on a small model directory with the streamed conversion replaced
by a stand-in (it writes what a converted root holds): what is tested is everything around it.
The real conversion is tests/e2e/test_convert.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from model_dir_fixture import write_model_dir

pytest.importorskip("safetensors")


def _fake_hf_to_dist(files, spec, out, **kwargs) -> None:
    (out / "latest").write_text("0\n")
    (out / "iter_0000000").mkdir()
    (out / "iter_0000000" / "weights").write_bytes(b"new")


@pytest.fixture
def conversion(monkeypatch):
    """The streamed conversion and the tensor-by-tensor name check stood in for (the model dir is not a whole model)."""
    from entr_megatron.checkpoint import dist_convert
    from entr_megatron.learner import hf_load

    monkeypatch.setattr(hf_load, "check_hf_checkpoint", lambda ckpt, spec, allow=(): [])
    monkeypatch.setattr(dist_convert, "hf_to_dist", _fake_hf_to_dist)
    return monkeypatch


def _convert(capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of `entr-megatron convert hf-to-megatron ARGS --no-verify` in this process."""
    from entr_megatron.cli.main import main

    try:
        code = main(["convert", "hf-to-megatron", *args, "--no-verify"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    return code, capsys.readouterr().err


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_out_that_is_inside_or_holds_the_source_is_refused(tmp_path, capsys, conversion):
    src = write_model_dir(tmp_path / "models" / "m")
    before = _snapshot(tmp_path)
    (tmp_path / "link").symlink_to(src)
    for out, relation in [(src, "is"), (src / "out", "is inside"), (tmp_path / "models", "contains"),
                          (tmp_path / "link", "is")]:
        code, err = _convert(capsys, "--hf", str(src), "--out", str(out), "--overwrite")
        assert code == 2, err
        assert err.startswith(f"entr-megatron convert: error: --out {out} {relation} the source --hf {src}"), err
        assert err.count("\n") == 1, err
    assert "(real paths" in err  # the symlink: the paths that were compared are shown
    assert _snapshot(tmp_path) == before  # the source as it was, nothing written beside it


def test_overwrite_keeps_files_a_conversion_does_not_write(tmp_path, capsys, conversion):
    src, out = write_model_dir(tmp_path / "m"), tmp_path / "ckpt"
    out.mkdir()
    (out / "latest").write_text("7\n")
    (out / "notes.txt").write_text("my notes")
    code, err = _convert(capsys, "--hf", str(src), "--out", str(out), "--overwrite")
    assert code == 0, err
    assert (out / "latest").read_text() == "0\n" and (out / "iter_0000000" / "weights").read_bytes() == b"new"
    [kept] = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.previous-")]
    assert _snapshot(kept) == {"latest": b"7\n", "notes.txt": b"my notes"}  # the old OUT, whole
    assert f"held files this command does not write (notes.txt); it is kept whole as {kept}" in err, err
    # An OUT holding only what this direction writes (here: the previous output) is replaced.
    code, err = _convert(capsys, "--hf", str(src), "--out", str(out), "--overwrite")
    assert code == 0 and "kept whole" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", "ckpt", kept.name])


def test_overwrite_patterns_are_what_each_direction_writes():
    from entr_megatron.cli.conversion import _WRITES

    to_m, to_hf = _WRITES["hf-to-megatron"].match, _WRITES["megatron-to-hf"].match
    assert all(to_m(n) for n in ("latest", "model_config.json", "iter_0000000", "iter_0012345", "hf_assets",
                                 "conversion.json"))
    assert all(to_hf(n) for n in ("config.json", "model.safetensors", "model-00001-of-00003.safetensors",
                                  "model.safetensors.index.json", "tokenizer.json", "generation_config.json",
                                  "conversion.json"))
    assert not any(f(n) for f in (to_m, to_hf) for n in ("notes.txt", "README.md", "pytorch_model.bin", "iter_12",
                                                          "model-1-of-2.safetensors", "runs"))


def test_a_missing_tokenizer_is_a_warning_naming_what_train_needs(tmp_path, capsys, conversion):
    src, out = write_model_dir(tmp_path / "m", tokenizer=False), tmp_path / "ckpt"
    code, err = _convert(capsys, "--hf", str(src), "--out", str(out))
    assert code == 0, err
    assert (f"warning: --hf {src} has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
            f"vocab.json): the checkpoint's hf_assets/ gets no tokenizer; `train` with model.path {out} will need "
            "model.tokenizer") in err, err
    assert not (out / "hf_assets").exists()  # nothing to hold (no generation_config.json either): not made empty
    code, err = _convert(capsys, "--hf", str(write_model_dir(tmp_path / "t")), "--out", str(tmp_path / "ckpt2"))
    assert code == 0 and "warning" not in err, err
    assert sorted(os.listdir(tmp_path / "ckpt2" / "hf_assets")) == ["tokenizer_config.json"]


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_temp_directory_is_removed_by_the_next_and_said(tmp_path, capsys, conversion):
    src, out = write_model_dir(tmp_path / "m"), tmp_path / "ckpt"
    pid = _exited_pid()
    stale = tmp_path / f"ckpt.tmp-{pid}"
    (stale / "iter_0000000").mkdir(parents=True)
    (stale / "iter_0000000" / "half").write_bytes(b"x" * 1000)  # what SIGKILL left
    code, err = _convert(capsys, "--hf", str(src), "--out", str(out))
    assert code == 0, err
    assert f"removed {stale}, the unfinished output of an interrupted run (pid {pid}, no longer running)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m"]


def test_a_temp_directory_of_a_running_conversion_is_not_touched(tmp_path):
    from entr_megatron.checkpoint.hf_files import staged_dir

    # A live process whose command line names entr (as `entr-megatron convert` does).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "entr-megatron"])
    try:
        busy = tmp_path / f"out.tmp-{proc.pid}"
        busy.mkdir()
        with pytest.raises(ValueError, match=rf"{busy}: process {proc.pid} is writing {tmp_path / 'out'} now"):
            with staged_dir(tmp_path / "out"):
                pass
        assert busy.is_dir()
    finally:
        proc.kill()
        proc.wait()


def test_an_output_moved_aside_by_a_killed_run_is_restored(tmp_path):
    from entr_megatron.checkpoint.hf_files import clean_stale

    out, pid = tmp_path / "out", _exited_pid()
    (tmp_path / f"out.old-{pid}").mkdir()
    (tmp_path / f"out.old-{pid}" / "latest").write_text("3\n")  # killed between its two renames
    said = []
    clean_stale(out, said.append)
    assert (out / "latest").read_text() == "3\n" and said == [
        f"restored {out} from {tmp_path / f'out.old-{pid}'}, where a run interrupted while replacing it had moved it"]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_conversion_says_so_and_leaves_no_temp_directory(tmp_path, capsys, conversion, signum, code):
    def interrupted(files, spec, out, **kwargs):
        (out / "half").write_bytes(b"x" * 1000)
        try:
            signal.raise_signal(signum)  # arrives while torch writes a file ...
        except KeyboardInterrupt:  # ... whose writer then fails with its own error
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0") from None

    from entr_megatron.checkpoint import dist_convert

    conversion.setattr(dist_convert, "hf_to_dist", interrupted)
    src, out = write_model_dir(tmp_path / "m"), tmp_path / "ckpt"
    got, err = _convert(capsys, "--hf", str(src), "--out", str(out))
    name = signal.Signals(signum).name
    assert got == code, err
    assert err.endswith(f"\nentr-megatron convert: interrupted ({name}); no partial output is left\n"), err
    assert err.count("convert: interrupted") == 1 and "unexpected pos" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert signal.getsignal(signal.SIGTERM) is not None  # the command's handlers are undone


_KILLED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from entr_megatron.checkpoint import dist_convert
    from entr_megatron.learner import hf_load

    def slow(files, spec, out, **kwargs):
        (out / "half").write_bytes(b"x" * 1000)
        Path(sys.argv[3]).write_text("converting")
        time.sleep(120)

    hf_load.check_hf_checkpoint = lambda *a, **k: []
    dist_convert.hf_to_dist = slow
    from entr_megatron.cli.main import main
    sys.exit(main(["convert", "hf-to-megatron", "--hf", sys.argv[1], "--out", sys.argv[2], "--no-verify"]))
""")


def test_sigterm_from_outside_exits_143_and_removes_the_temp_directory(tmp_path):
    src, out, started = write_model_dir(tmp_path / "m"), tmp_path / "ckpt", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(src), str(out), str(started)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        deadline = time.monotonic() + 240  # imports take long on a loaded machine
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), proc.communicate(timeout=10)
        assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [f"ckpt.tmp-{proc.pid}"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "entr-megatron convert: interrupted (SIGTERM); no partial output is left"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "started"]


def test_megatron_to_hf_without_a_tokenizer_warns_and_a_missing_tokenizer_dir_is_an_error(tmp_path, capsys,
                                                                                          monkeypatch):
    """megatron-to-hf's source stood in for: a checkpoint root with no hf_assets/ (what --hf without tokenizer made)."""
    from entr_megatron import models
    from entr_megatron.checkpoint import hf_dir
    from entr_megatron.cli import conversion
    from model_dir_fixture import CONFIG

    root = tmp_path / "ckpt"
    (root / "iter_0000000").mkdir(parents=True)
    monkeypatch.setattr(hf_dir, "resolve_source", lambda path: (root, None))
    monkeypatch.setattr(hf_dir, "source_model", lambda r: (CONFIG, models.model_spec(CONFIG)))
    monkeypatch.setattr(hf_dir, "checked_step", lambda r, step: (0, root / "iter_0000000"))
    monkeypatch.setattr(conversion, "read_manifest", lambda path: None)
    monkeypatch.setattr(conversion, "_saved_layout", lambda path: None)
    monkeypatch.setattr(hf_dir, "write_hf_dir", lambda out, *a, **k: hf_dir.HfDir(
        {}, type("Files", (), {"nbytes": 0, "files": []})(), []))
    from entr_megatron.cli.main import main

    args = ["convert", "megatron-to-hf", "--ckpt", str(root), "--no-verify", "--out"]
    assert main([*args, str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert (f"warning: no tokenizer in {root / 'hf_assets'}: {tmp_path / 'hf'} gets no tokenizer; `train` from it "
            "will need model.tokenizer") in err, err
    with pytest.raises(SystemExit) as e:
        main([*args, str(tmp_path / "hf2"), "--tokenizer", str(tmp_path / "nope")])
    assert e.value.code == f"entr-megatron convert: error: --tokenizer {tmp_path / 'nope'}: not a directory"
    assert not (tmp_path / "hf2").exists()

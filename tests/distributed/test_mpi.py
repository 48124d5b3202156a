"""Real mpirun: the launch bootstrap and `entr-megatron score` on MPI ranks (gloo on CPU).

mpirun and mpi4py come with the `dev` and `cluster` extras (MPICH's wheel puts `mpirun`
next to the interpreter); without them these tests are skipped, saying which is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.slow

NP = 2
TIMEOUT_S = 180
VOCAB = 96


def _mpirun() -> str:
    """The mpirun of this interpreter's environment (the MPI mpi4py loads), else the one on PATH."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[dev]' or '.[cluster]')")
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if found is None:
        pytest.skip(f"no mpirun next to {sys.executable} or on PATH (pip install mpich)")
    return found


def _env() -> dict[str, str]:
    """This environment without torchrun's variables (they would win over MPI's), rendezvous on loopback."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    return dict(env, MASTER_ADDR="127.0.0.1", HF_HUB_OFFLINE="1")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env or _env())


BOOTSTRAP = textwrap.dedent("""
    import json
    import os
    import sys
    import torch
    import torch.distributed as dist
    from entr_megatron.parallel.groups import init_distributed_from_env

    info = init_distributed_from_env(timeout_minutes=2)
    x = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(x)
    # One file per rank: mpirun interleaves the ranks' stdout.
    with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
        json.dump(dict(rank=info.rank, world=info.world_size, launcher=info.launcher, sum=float(x),
                       dist_rank=dist.get_rank(), dist_world=dist.get_world_size(), backend=dist.get_backend(),
                       local=(info.local_rank, info.local_world_size),
                       env=[os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")],
                       gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME")), f)
    dist.destroy_process_group()
""")


def test_bootstrap_under_mpirun_joins_a_gloo_world(tmp_path):
    mpirun = _mpirun()
    script = tmp_path / "bootstrap.py"
    script.write_text(BOOTSTRAP)
    proc = _run([mpirun, "-np", str(NP), sys.executable, str(script), str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NP)]
    want_sum = float(sum(range(1, NP + 1)))
    # One node: MPI's local rank and size; the torchrun variables exported for Megatron; gloo kept on
    # loopback because rank 0's MASTER_ADDR is 127.0.0.1 (utils.spawn.enter_rank).
    assert rows == [dict(rank=r, world=NP, launcher="mpirun", sum=want_sum, dist_rank=r, dist_world=NP,
                         backend="gloo", local=[r, NP], env=[str(r), str(NP), str(r), str(NP)], gloo_ifname="lo")
                    for r in range(NP)], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen2 saved as an HF directory, and a JSONL of token sequences for it."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("mpi_score")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=48, vocab_size=VOCAB, initializer_range=0.3)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
    g = torch.Generator().manual_seed(1)
    lines = [{"id": i, "input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()}
             for i, n in enumerate((9, 3, 14, 6))]
    (root / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(root / "model"), str(root / "in.jsonl")


def _score(model: str, inp: str, out: str, *, tp: int = NP) -> list[str]:
    """The `entr-megatron score` command line (the installed script, as a user runs it)."""
    script = os.path.join(os.path.dirname(sys.executable), "entr-megatron")
    cmd = [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "entr_megatron.cli.main"]
    return [*cmd, "score", "--model", model, "--tp", str(tp), "--input", inp, "--output", out]


def test_score_under_mpirun_matches_hf_transformers(tiny_model, tmp_path):
    """`mpirun -np 2 score --tp 2` against HF transformers' own forward of the model (float64)."""
    import transformers

    mpirun = _mpirun()
    model, inp = tiny_model
    mpi = str(tmp_path / "mpi.jsonl")
    proc = _run([mpirun, "-np", str(NP), *_score(model, inp, mpi)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("scoring 4 sequences") == 1 and f"on {NP} MPI rank(s)" in proc.stderr, proc.stderr
    assert proc.stdout.count("scored 4 sequences") == 1, proc.stdout  # rank 0 alone writes and reports
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float64).eval()
    want = [json.loads(x) for x in open(inp)]
    got = [json.loads(x) for x in open(mpi)]
    assert [r["id"] for r in got] == [r["id"] for r in want]
    for g, w in zip(got, want):
        ids = torch.tensor([w["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, :-1], dim=-1)
        ref_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
        ref_h = -(logp.exp() * logp).sum(-1)
        assert g["input_ids"] == w["input_ids"] and len(g["logprobs"]) == len(w["input_ids"]) - 1
        torch.testing.assert_close(torch.tensor(g["logprobs"], dtype=torch.float64), ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(g["entropy"], dtype=torch.float64), ref_h, rtol=0, atol=1e-5)


def test_score_refuses_an_mpi_world_that_is_not_tp_times_pp(tiny_model, tmp_path):
    mpirun = _mpirun()
    model, inp = tiny_model
    out = tmp_path / "out.jsonl"
    proc = _run([mpirun, "-np", str(NP), *_score(model, inp, str(out), tp=1)])
    assert proc.returncode != 0
    assert f"mpirun started {NP} rank(s) but --tp 1 x --pp 1 needs 1: run mpirun -np 1" in proc.stderr, proc.stderr
    assert not out.exists()
